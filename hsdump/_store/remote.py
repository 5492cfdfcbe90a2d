"""A store part written by a process of its own: `RemoteStore`, what an extract worker writes to.

In one interpreter, the client's requests, watcher and checks and the store's codec and shard
threads take turns on one lock, and the store's threads wait for it between their native calls.
`RemoteStore` runs the store in a child process (`hsdump._store.serve`) and sends it each
sample over a Unix socket: the small fields pickled, the two hidden-state tensors as file
descriptors of the pages they lie in (`hsdump._mapped.share`), so the child maps the dump itself
and the bytes are not copied between the processes.

It is a `SampleSink` with the store's writing calls (``write``, ``awrite``, ``flush``,
``close``) and its byte counters, plus the child's CPU seconds and peak memory, which the
extraction adds to its own.
"""

from __future__ import annotations

import functools
import multiprocessing.connection
import os
import pickle
import socket
import subprocess
import sys
import threading
from multiprocessing.reduction import sendfds
from typing import TYPE_CHECKING, Any

from hsdump import _exceptions
from hsdump._exceptions import HsdumpError, StoreError

if TYPE_CHECKING:
    from hsdump._store.store import IfExists
    from hsdump._types import HiddenStates

__all__ = ["RemoteStore", "StoreProcessLost"]

_CLOSE_WAIT_S = 60.0


class StoreProcessLost(StoreError):
    """The store process exited without being closed (killed, or out of memory)."""


class RemoteStore:
    """One store part, written by a child process; see the module docstring.

    The child starts at construction (it imports the store's dependencies while the caller opens
    its client) and opens the part on `open` (or entering the ``with`` block).
    """

    def __init__(self, path: Any, *, writer_id: str, **options: Any) -> None:
        self._args = (path, writer_id, options)
        self._where = f"store part {writer_id!r} of {path}"
        self._lock = threading.Lock()
        # The child's counters as of its last reply: the store's bytes, its CPU and peak memory.
        self.bytes_raw_written = self.bytes_stored = self.peak_rss_bytes = 0
        self.cpu_s = 0.0
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        self._process = subprocess.Popen(
            [sys.executable, "-m", "hsdump._store.serve", str(theirs.fileno()), str(os.getpid())],
            pass_fds=(theirs.fileno(),),
            stdin=subprocess.DEVNULL,
        )
        theirs.close()
        self._sock = ours
        self._conn = multiprocessing.connection.Connection(os.dup(ours.fileno()))
        self._closed = False

    # -- lifecycle -------------------------------------------------------------------------------

    def open(self) -> RemoteStore:
        """Open the part in the child (raises what `open_store` raises there)."""
        try:
            self._call("open", *self._args)
        except BaseException:
            self._end()
            raise
        return self

    def __enter__(self) -> RemoteStore:
        return self.open()

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def close(self) -> None:
        """Flush and close the part, then wait for the child to exit."""
        if self._closed:
            return
        try:
            self._call("close")
        finally:
            self._end()

    def _end(self) -> None:
        self._closed = True
        self._conn.close()
        self._sock.close()
        try:
            self._process.wait(_CLOSE_WAIT_S)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait()

    # -- the sink --------------------------------------------------------------------------------

    def write(self, hs: HiddenStates, *, if_exists: IfExists = "error") -> bool:
        """Write one sample (blocking), as `HiddenStateStore.write` does, in the child."""
        from hsdump._mapped import share

        shared = [share(t) for t in (hs.aux_hidden_states, hs.final_hidden_state)]
        fields = {
            "sample_id": hs.sample_id, "input_ids": hs.input_ids, "layer_ids": hs.layer_ids,
            "loss_mask": hs.loss_mask, "meta": hs.meta, "attrs": hs.attrs,
        }  # fmt: skip
        try:
            return bool(
                self._call("write", fields, [w for _, _, w in shared], if_exists,
                           fds=[fd for fd, _, _ in shared], sample_id=hs.sample_id)
            )  # fmt: skip
        finally:
            for fd, owned, _ in shared:
                if owned:
                    os.close(fd)

    async def awrite(self, hs: HiddenStates, *, if_exists: IfExists = "error") -> bool:
        """`write` from asyncio, in a thread; all or nothing, also when the caller is cancelled."""
        import anyio

        write = functools.partial(self.write, hs, if_exists=if_exists)
        return await anyio.to_thread.run_sync(write)

    def flush(self) -> None:
        """Commit every buffered sample."""
        self._call("flush")

    async def aflush(self) -> None:
        """`flush` from asyncio, in a thread."""
        import anyio

        await anyio.to_thread.run_sync(self.flush)

    def __contains__(self, sample_id: object) -> bool:
        return isinstance(sample_id, str) and bool(self._call("contains", sample_id))

    # -- the socket ------------------------------------------------------------------------------

    def _call(
        self, kind: str, *args: Any, fds: list[int] | None = None, sample_id: str | None = None
    ) -> Any:
        with self._lock:
            if self._closed:
                raise _exceptions.StoreClosedError(f"{self._where} is closed")
            try:
                self._conn.send_bytes(pickle.dumps((kind, *args)))
                if fds:
                    sendfds(self._sock, fds)
                reply = pickle.loads(self._conn.recv_bytes())
            except (EOFError, OSError) as exc:
                lost = self._lost(sample_id)
                self._end()  # nothing more can be sent: a later close has nothing to do
                raise lost from exc
        self._count(reply[-1])
        if reply[0] == "error":
            raise _error(*reply[1:5])
        return reply[1]

    def _count(self, usage: dict[str, float]) -> None:
        self.bytes_raw_written = int(usage.get("bytes_raw_written", self.bytes_raw_written))
        self.bytes_stored = int(usage.get("bytes_stored", self.bytes_stored))
        self.cpu_s = float(usage.get("cpu_s", self.cpu_s))
        self.peak_rss_bytes = int(usage.get("peak_rss_bytes", self.peak_rss_bytes))

    def _lost(self, sample_id: str | None) -> StoreProcessLost:
        try:
            code = self._process.wait(5.0)
        except subprocess.TimeoutExpired:
            code = None
        return StoreProcessLost(
            f"the process writing {self._where} exited (code {code}) before it was closed: "
            "samples it committed are kept, a rerun redoes the rest. If it was out of memory, "
            "lower --concurrency or the number of workers.",
            sample_id=sample_id,
        )


def _error(name: str, message: str, sample_id: str | None, rid: str | None) -> HsdumpError:
    """The child's error as the same `HsdumpError` class (a `StoreError` when it is unknown)."""
    cls = getattr(_exceptions, name, None)
    if not (isinstance(cls, type) and issubclass(cls, HsdumpError)):
        cls = StoreError
    try:
        return cls(message, sample_id=sample_id, rid=rid)
    except TypeError:
        return StoreError(message, sample_id=sample_id, rid=rid)
