"""Waiting for a request's dump: the `DumpWatcher` protocol and its implementations.

`InotifyWatcher` reads Linux inotify events straight from the kernel in one of its waiting
tasks (``anyio.wait_readable``: asyncio and trio alike), so a dump is seen within microseconds and
an idle watcher costs no CPU.
watchfiles was measured first: its Rust loop wakes every ``step`` ms (p50 wake-up 2.0 ms at
``step=1``) and ``step=0`` spins a whole core, so it cannot meet a sub-millisecond wake-up; it is
offered as `WatchfilesWatcher` (``watcher="watchfiles"``) for platforms where the Rust
``notify`` crate has a backend and inotify_simple does not.
`PollingWatcher` is the fallback for filesystems without inotify (NFS, some containers).
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import anyio
import anyio.from_thread
import anyio.lowlevel

from hsdump._exceptions import ConfigError, DumpTimeout
from hsdump._protocol import DONE_MARKER, ERROR_MARKER, REQ_PREFIX, request_dir, validate_rid
from hsdump._settings import setting

__all__ = [
    "DumpWatcher",
    "InotifyWatcher",
    "PollingWatcher",
    "WatchfilesWatcher",
    "default_watcher",
]

logger = logging.getLogger(__name__)


@runtime_checkable
class DumpWatcher(Protocol):
    """Waits until a request's dump directory is published.

    Implementations must return when ``req_<rid>`` holds ``done`` or ``error``, including when it
    was published before the wait began, and must leave no task, watch or file handle behind when a
    wait times out or is cancelled.
    """

    root: Path

    async def wait(self, rid: str, timeout: float) -> Path:
        """Return the published ``req_<rid>`` directory; raise DumpTimeout after ``timeout`` s."""
        ...

    async def aclose(self) -> None:
        """Release every resource; later waits raise."""
        ...


def _is_published(path: Path) -> bool:
    return (path / DONE_MARKER).exists() or (path / ERROR_MARKER).exists()


def _timeout_error(root: Path, rid: str, timeout: float) -> DumpTimeout:
    return DumpTimeout(
        f"no dump appeared in {request_dir(root, rid)} within {timeout:g} s. Check that the server "
        "dumps into this directory and is not overloaded; raise dump_timeout for very long "
        "prompts.",
        rid=rid,
    )


class PollingWatcher:
    """Checks for the markers with ``stat`` at a short interval that backs off to ``max_interval``.

    Args:
        root: The dump root.
        interval: First polling interval in seconds.
        max_interval: Longest polling interval in seconds.
    """

    def __init__(
        self, root: str | os.PathLike[str], *, interval: float = 0.001, max_interval: float = 0.02
    ):
        self.root = Path(root)
        self.interval = interval
        self.max_interval = max_interval
        self._closed = False

    async def wait(self, rid: str, timeout: float) -> Path:
        """See `DumpWatcher.wait`."""
        path = request_dir(self.root, validate_rid(rid))
        if self._closed:
            raise ConfigError("this watcher is closed")
        delay = self.interval
        with anyio.move_on_after(timeout):
            while not _is_published(path):
                await anyio.sleep(delay)
                delay = min(delay * 1.5, self.max_interval)
            return path
        raise _timeout_error(self.root, rid, timeout)

    async def aclose(self) -> None:
        """See `DumpWatcher.aclose`."""
        self._closed = True


class InotifyWatcher:
    """Wakes waiters from Linux inotify events on the dump root (any anyio backend).

    One inotify descriptor watches the root for directories moved or created in; a directory that
    appears before its marker (a producer that writes in place instead of renaming a finished
    directory) gets a watch of its own for as long as a wait for it lasts, however many files
    arrive before the marker. No task of its own reads the descriptor: one of the waits at a
    time does, waking the others, and hands the reading to another when it ends.

    Args:
        root: The dump root (created if missing).
    """

    def __init__(self, root: str | os.PathLike[str]):
        self.root = Path(root)
        self._waiters: dict[str, set[_Wakeup]] = {}
        self._subdirs: dict[int, str] = {}
        self._inotify: Any = None  # inotify_simple.INotify once started
        self._reader: _Wakeup | None = None  # the wait that reads the descriptor now
        self._closed = False

    def _start(self) -> None:
        from inotify_simple import INotify, flags

        self.root.mkdir(parents=True, exist_ok=True)
        inotify = INotify(nonblocking=True)
        mask = flags.CREATE | flags.MOVED_TO | flags.ONLYDIR | flags.DELETE_SELF
        inotify.add_watch(self.root, mask)
        self._inotify = inotify

    async def _next_wakeup(self, wakeup: _Wakeup) -> None:
        """Return once ``wakeup`` is set, reading the events meanwhile if no other wait does."""
        if self._reader is not None:
            await wakeup.wait()
            return
        self._reader = wakeup
        try:
            while not wakeup.is_set():
                await anyio.wait_readable(self._inotify.fileno())
                self._on_events()
        except anyio.ClosedResourceError:
            pass  # aclose() closed the descriptor: the wait sees the watcher closed
        finally:
            self._reader = None  # a reader that leaves the wait hands over in _unregister
        wakeup.clear()

    def _hand_over(self) -> None:
        """Wake one wait, which then reads the events in place of the reader that left."""
        for waiters in self._waiters.values():
            for other in waiters:
                other.set()
                return

    def _on_events(self) -> None:
        from inotify_simple import flags

        for event in self._inotify.read(timeout=0):
            if event.mask & (flags.Q_OVERFLOW | flags.DELETE_SELF | flags.IGNORED):
                self._wake_all()  # events were lost: let every waiter look again
            elif event.wd in self._subdirs:
                self._wake(self._subdirs[event.wd])
            elif event.name.startswith(REQ_PREFIX):
                self._on_request_dir(event.name[len(REQ_PREFIX) :])

    def _on_request_dir(self, rid: str) -> None:
        if rid not in self._waiters:
            return
        path = request_dir(self.root, rid)
        if not _is_published(path):
            self._watch_request_dir(rid, path)
        if _is_published(path):  # also when the marker landed before the watch
            self._wake(rid)

    def _watch_request_dir(self, rid: str, path: Path) -> None:
        from inotify_simple import flags

        mask = flags.CREATE | flags.MOVED_TO | flags.ONLYDIR | flags.DONT_FOLLOW
        try:
            wd = self._inotify.add_watch(path, mask)
        except OSError:
            return  # not there (yet, or any more), or a link: the root's watch reports changes
        self._subdirs[wd] = rid

    def _wake(self, rid: str) -> None:
        for wakeup in self._waiters.get(rid, ()):
            wakeup.set()

    def _wake_all(self) -> None:
        for rid in list(self._waiters):
            self._wake(rid)

    async def wait(self, rid: str, timeout: float) -> Path:
        """See `DumpWatcher.wait`."""
        path = request_dir(self.root, validate_rid(rid))
        if self._closed:
            raise ConfigError("this watcher is closed")
        if self._inotify is None:
            self._start()
        wakeup = _Wakeup()
        self._waiters.setdefault(rid, set()).add(wakeup)
        try:
            with anyio.move_on_after(timeout):
                # Registered, and the directory watched if it exists, before looking, so no event
                # slips by; both last until the wait ends, however many wake-ups it takes.
                self._watch_request_dir(rid, path)
                while not _is_published(path):
                    await self._next_wakeup(wakeup)
                    if self._closed:
                        raise ConfigError("the watcher was closed while waiting")
                return path
        finally:
            self._unregister(rid, wakeup)
        raise _timeout_error(self.root, rid, timeout)

    def _unregister(self, rid: str, wakeup: _Wakeup) -> None:
        waiters = self._waiters.get(rid)
        if waiters is not None:
            waiters.discard(wakeup)
            if not waiters:
                del self._waiters[rid]
                self._drop_subdir_watches(rid)
        if self._reader is None:
            self._hand_over()

    def _drop_subdir_watches(self, rid: str) -> None:
        for wd in [wd for wd, owner in self._subdirs.items() if owner == rid]:
            del self._subdirs[wd]
            if self._inotify is None:
                continue  # closed: the descriptor took its watches with it
            # A gone directory's watch was already dropped by the kernel.
            with contextlib.suppress(OSError):
                self._inotify.rm_watch(wd)

    async def aclose(self) -> None:
        """See `DumpWatcher.aclose`."""
        self._closed = True
        if self._inotify is not None:
            anyio.notify_closing(self._inotify.fileno())  # the reading wait stops, then closes
            self._inotify.close()
            self._inotify = None
        self._wake_all()


class WatchfilesWatcher:
    """Wakes waiters from the change sets of watchfiles' Rust ``notify`` watcher on the dump root.

    One watcher covers the root recursively; a thread of its own blocks in watchfiles and hands
    each change set to the event loop (any anyio backend), which wakes the waits for the
    ``req_<rid>`` directories it names. A change set arrives about two ``step_ms`` after the
    change, and the thread takes the GIL once per step while idle (see docs/performance.md).

    Args:
        root: The dump root (created if missing).
        step_ms: watchfiles' step in milliseconds: how often its loop looks for changes.
        rescan: Seconds between a wait's own looks at its directory, whatever the events say.
    """

    def __init__(
        self, root: str | os.PathLike[str], *, step_ms: int = 1, rescan: float = 0.02
    ) -> None:
        self.root = Path(root)
        self.step_ms = step_ms
        self.rescan = rescan
        self._waiters: dict[str, set[_Wakeup]] = {}
        self._notify: Any = None  # watchfiles' RustNotify once started
        self._notify_threads: set[str] = set()
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._token: Any = None  # the event loop's anyio token once started
        self._closed = False
        # notify reports absolute paths, joined to the working directory if the root is relative
        self._watched = os.path.abspath(self.root)

    def _start(self) -> None:
        # RustNotify is what watchfiles.watch() runs on (documented as its Rust backend); used
        # directly so that the watch can be stopped and its threads known.
        from watchfiles._rust_notify import RustNotify

        self.root.mkdir(parents=True, exist_ok=True)
        before = _notify_threads()
        try:
            self._notify = RustNotify([self._watched], False, False, 300, True, False)
        except (OSError, RuntimeError) as exc:
            raise ConfigError(
                f"watchfiles cannot watch the dump root {self.root}: {exc}. Check that it is a "
                "readable directory, or use watcher='inotify' or 'poll'"
            ) from exc
        self._notify_threads = _notify_threads() - before
        self._token = anyio.lowlevel.current_token()
        self._thread = threading.Thread(target=self._run, name="hsdump-watchfiles", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                changes = self._notify.watch(self.step_ms, self.step_ms, 0, self._stop)
            except Exception:  # the waits go on with their rescans
                logger.exception("watchfiles stopped watching %s", self.root)
                return
            if not isinstance(changes, set):
                continue  # "stop" ends the loop; no "timeout" or "signal" off the main thread
            try:
                anyio.from_thread.run_sync(self._on_changes, changes, token=self._token)
            except RuntimeError:
                return  # the event loop has finished

    def _on_changes(self, changes: set[tuple[int, str]]) -> None:
        prefix = os.path.join(self._watched, REQ_PREFIX)
        for _, path in changes:
            if path.startswith(prefix):
                self._wake(path[len(prefix) :].split(os.sep, 1)[0])

    def _wake(self, rid: str) -> None:
        for wakeup in self._waiters.get(rid, ()):
            wakeup.set()

    async def wait(self, rid: str, timeout: float) -> Path:
        """See `DumpWatcher.wait`."""
        path = request_dir(self.root, validate_rid(rid))
        if self._closed:
            raise ConfigError("this watcher is closed")
        if self._notify is None:
            self._start()
        wakeup = _Wakeup()
        self._waiters.setdefault(rid, set()).add(wakeup)
        try:
            with anyio.move_on_after(timeout):
                while not _is_published(path):
                    # notify reports a new directory before it watches it, so a marker written
                    # in between raises no event, and this look may have come before the marker;
                    # events lost to a full kernel queue are the same. So look again now and then.
                    with anyio.move_on_after(self.rescan):
                        await wakeup.wait()
                    if self._closed:
                        raise ConfigError("the watcher was closed while waiting")
                return path
        finally:
            waiters = self._waiters[rid]
            waiters.discard(wakeup)
            if not waiters:
                del self._waiters[rid]
        raise _timeout_error(self.root, rid, timeout)

    def _shut_down(self) -> None:
        assert self._thread is not None
        self._thread.join()
        self._notify.close()
        # close() only asks notify's thread to stop; that thread closes the inotify and epoll
        # descriptors as it exits, and nothing reports the exit: look until it is gone.
        deadline = time.monotonic() + 1
        while _alive(self._notify_threads) and time.monotonic() < deadline:
            time.sleep(0.0002)

    async def aclose(self) -> None:
        """See `DumpWatcher.aclose`."""
        self._closed = True
        if self._thread is not None:
            self._stop.set()  # seen within one step
            with anyio.CancelScope(shield=True):
                await anyio.to_thread.run_sync(self._shut_down)
            self._thread = None
        for waiters in self._waiters.values():
            for wakeup in waiters:
                wakeup.set()


def _notify_threads() -> set[str]:
    """Ids of this process's threads that the notify crate runs (empty without ``/proc``)."""
    found = set()
    with contextlib.suppress(OSError):
        for tid in os.listdir("/proc/self/task"):
            with contextlib.suppress(OSError), open(f"/proc/self/task/{tid}/comm") as comm:
                if comm.read().startswith("notify-rs"):
                    found.add(tid)
    return found


def _alive(tids: set[str]) -> bool:
    return any(os.path.exists(f"/proc/self/task/{tid}") for tid in tids)


class _Wakeup:
    """Tells one wait to look again; wake-ups that arrive before it looks merge into one."""

    def __init__(self) -> None:
        self._event = anyio.Event()

    def set(self) -> None:
        self._event.set()

    def is_set(self) -> bool:
        return self._event.is_set()

    def clear(self) -> None:
        self._event = anyio.Event()

    async def wait(self) -> None:
        await self._event.wait()
        self.clear()


def default_watcher(root: str | os.PathLike[str], kind: str | None = None) -> DumpWatcher:
    """The watcher for ``root``: ``kind`` or ``$HSDUMP_WATCHER`` ("inotify", "poll" or
    "watchfiles").

    Without either, inotify where the platform has it, else polling.
    """
    kind = kind or setting("watcher") or ("inotify" if _has_inotify() else "poll")
    if kind == "inotify":
        return InotifyWatcher(root)
    if kind == "poll":
        return PollingWatcher(root)
    if kind == "watchfiles":
        return WatchfilesWatcher(root)
    raise ConfigError(
        f"unknown watcher {kind!r}: use 'inotify', 'poll' or 'watchfiles' (HSDUMP_WATCHER)"
    )


def _has_inotify() -> bool:
    try:
        import inotify_simple  # noqa: F401
    except (ImportError, OSError):
        return False
    return hasattr(os, "uname") and os.uname().sysname == "Linux"
