"""A command's graceful stop on SIGINT or SIGTERM: the first signal stops, later ones wait.

The first signal stops the run once: inside `GracefulStop.cancelling` it cancels that
scope from the event loop (the run then flushes the store, reports and cleans up), elsewhere it
raises `Stopped`, a ``KeyboardInterrupt``, so sync code unwinds through its ``finally``
blocks. Later signals, until the process exits, only say that the stop is under way: a second
Ctrl-C used to cut that cleanup short, the embedded server's and the interpreter's teardown among
it, and could abort with exit code 134.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
from collections.abc import Callable, Iterator
from types import FrameType
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import anyio

__all__ = ["GracefulStop", "Stopped"]

_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class Stopped(KeyboardInterrupt):
    """Raised by the first stop signal outside an async scope.

    Attributes:
        signum: The signal's number.
        exit_code: ``128 + signum``: 130 for SIGINT, 143 for SIGTERM.
    """

    def __init__(self, signum: int):
        super().__init__(f"stopped by {signal.Signals(signum).name}")
        self.signum = signum
        self.exit_code = 128 + signum


class GracefulStop:
    """Handles SIGINT and SIGTERM while the ``with`` block runs (in the main thread).

    Args:
        notice: Written to stderr on the first signal.
        repeat: Written to stderr on each later one, while the stop is under way.
    """

    def __init__(
        self,
        notice: str = "stopping: committing what is done, then cleaning up\n",
        repeat: str = "still stopping: cleaning up, please wait\n",
    ):
        self.signum: int | None = None
        self._notices = notice.encode(), repeat.encode()
        self._cancels: list[Callable[[], Any]] = []
        self._previous: dict[int, Any] = {}

    @property
    def exit_code(self) -> int | None:
        """``128 + signum`` once a signal came, else None."""
        return None if self.signum is None else 128 + self.signum

    def __enter__(self) -> GracefulStop:
        with contextlib.suppress(ValueError):  # not the main thread: signals are not ours
            for signum in _SIGNALS:
                self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def __exit__(self, *exc_info: object) -> None:
        if self.signum is not None:
            return  # stopping: later signals wait until the process has exited, teardown too
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous.clear()

    @contextlib.contextmanager
    def cancelling(self, scope: anyio.CancelScope) -> Iterator[None]:
        """While the block runs, the first signal cancels ``scope`` (the innermost one wins).

        Enter it from the event loop's thread; a signal that came before cancels at once.
        """
        loop = asyncio.get_running_loop()

        def cancel() -> None:
            loop.call_soon_threadsafe(scope.cancel)  # the handler may interrupt the loop itself

        self._cancels.append(cancel)
        try:
            if self.signum is not None:
                scope.cancel()
            yield
        finally:
            self._cancels.remove(cancel)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        first = self.signum is None
        if first:
            self.signum = signum  # before the write, which a later signal may interrupt
        with contextlib.suppress(OSError):  # not print(): the handler may interrupt a write
            os.write(2, self._notices[not first])
        if not first:
            return
        if not self._cancels:
            raise Stopped(signum)
        self._cancels[-1]()
