"""The store process: one part of a store, written from requests over a socket (`RemoteStore`).

Run as ``python -m hsdump._store.serve FD PARENT_PID`` by `hsdump._store.remote`. It owns its
part as any writer does (its lock, its commits), and maps each sample's states from the
descriptors that come with the request (`hsdump._mapped.attach`), so the pages of a dump are
never copied between processes.

It dies with the process that started it (``SIGKILL``, through ``PR_SET_PDEATHSIG``) and ignores
SIGINT and SIGTERM: that process stops it by closing it, after the store writes in flight. When
the socket ends without a close, it exits without committing more, so a sample its starter could
not report is redone by a rerun, never stored twice.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import multiprocessing
import multiprocessing.connection
import os
import pickle
import resource
import signal
import socket
import sys
from typing import Any

from hsdump._exceptions import DumpValidationError, HsdumpError

__all__ = ["main", "usage"]

logger = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1


def usage(store: Any) -> dict[str, float]:
    """The counters a reply carries: the store's bytes, this process's CPU and peak memory."""
    own = resource.getrusage(resource.RUSAGE_SELF)
    counters: dict[str, float] = {
        "cpu_s": own.ru_utime + own.ru_stime,
        "peak_rss_bytes": own.ru_maxrss * 1024,
    }
    if store is not None:
        counters.update(bytes_raw_written=store.bytes_raw_written, bytes_stored=store.bytes_stored)
    return counters


def main(fd: int, parent_pid: int) -> None:
    """Serve one store part on the socket ``fd`` until it is closed."""
    _die_with_parent(parent_pid)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    # Locks made here by default (numcodecs' Blosc lock) unlink their semaphore at once, so a
    # SIGKILL leaves nothing in /dev/shm (see hsdump._run.worker).
    multiprocessing.set_start_method("fork", force=True)
    conn = multiprocessing.connection.Connection(fd)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM, fileno=os.dup(fd))
    _Server(conn, sock).run()


def _die_with_parent(parent_pid: int) -> None:
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent_pid:
        os._exit(1)  # the parent died before prctl took effect


class _Server:
    def __init__(self, conn: multiprocessing.connection.Connection, sock: socket.socket):
        self.conn, self.sock = conn, sock
        self.store: Any = None
        self.counted: Any = None  # the store the counters come from, also once it is closed

    def run(self) -> None:
        while True:
            try:
                request = pickle.loads(self.conn.recv_bytes())
            except (EOFError, OSError):
                return  # the starter is gone: commit nothing more
            reply = self._answer(request[0], request[1:])
            with contextlib.suppress(OSError):
                self.conn.send_bytes(pickle.dumps(reply))
            if request[0] == "close":
                return

    def _answer(self, kind: str, args: tuple[Any, ...]) -> tuple[Any, ...]:
        try:
            value = getattr(self, f"_{kind}")(*args)
        except HsdumpError as exc:
            return ("error", type(exc).__name__, exc.message, exc.sample_id, exc.rid, self._usage())
        except Exception as exc:  # a bug: say what failed in the starter's words
            logger.exception("the store process failed on a %s request", kind)
            message = f"the store process failed: {type(exc).__name__}: {exc}"
            sample_id = args[0].get("sample_id") if kind == "write" else None
            return ("error", "StoreError", message, sample_id, None, self._usage())
        return ("ok", value, self._usage())

    def _usage(self) -> dict[str, float]:
        try:
            return usage(self.counted)
        except HsdumpError:
            return usage(None)

    def _open(self, path: Any, writer_id: str, options: dict[str, Any]) -> None:
        from hsdump._store.store import open_store

        self.store = self.counted = open_store(path, "a", writer_id=writer_id, **options)

    def _write(self, fields: dict[str, Any], shared: list[Any], if_exists: str) -> bool:
        from multiprocessing.reduction import recvfds

        from hsdump._mapped import attach
        from hsdump._types import HiddenStates

        fds = list(recvfds(self.sock, len(shared)))
        try:
            aux, final = [attach(fd, where) for fd, where in zip(fds, shared, strict=True)]
        except (OSError, ValueError) as exc:
            raise DumpValidationError(
                f"the store process could not map the sample's states: {exc} (did something "
                "else cut the dump short after it was checked?)",
                sample_id=fields["sample_id"],
            ) from exc
        finally:
            for fd in fds:
                os.close(fd)
        states = HiddenStates(aux_hidden_states=aux, final_hidden_state=final, **fields)
        return bool(self.store.write(states, if_exists=if_exists))

    def _contains(self, sample_id: str) -> bool:
        return sample_id in self.store

    def _flush(self) -> None:
        self.store.flush()

    def _close(self) -> None:
        if self.store is not None:
            store, self.store = self.store, None
            store.close()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]))
