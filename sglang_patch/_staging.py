"""Device-to-host staging: a bounded pinned ring buffer and the copies that fill it.

The copies are queued on the stream that ran the forward, right after it: stream order makes them
read the hidden states before any later forward (or CUDA graph replay, whose outputs are views of
one shared buffer) can overwrite them, without stalling the GPU. The scheduler thread blocks only
when the ring is full, which is the back-pressure that keeps host memory bounded.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["Piece", "PinnedRing", "Stager", "record_event"]

_ALIGN = 64


@dataclass
class _Block:
    start: int
    end: int
    freed: bool = False


class PinnedRing:
    """A ring allocator over one pinned host buffer; blocks are freed in any order, reused in order.

    Args:
        capacity: Size in bytes.
        pin: Pin the buffer (needs CUDA); unpinned buffers serve CPU tests.
        alive: Called while waiting for space; when it returns False the wait raises
            ``RuntimeError`` instead of hanging (the consumer thread died).
    """

    def __init__(self, capacity: int, *, pin: bool, alive: Callable[[], bool] = lambda: True):
        self.capacity = capacity
        self.buffer = torch.empty(capacity, dtype=torch.uint8, pin_memory=pin)
        self._alive = alive
        self._blocks: deque[_Block] = deque()
        self._cond = threading.Condition()

    @property
    def used(self) -> int:
        """Bytes between the oldest live block and the newest (what is not reusable now)."""
        with self._cond:
            if not self._blocks:
                return 0
            first, last = self._blocks[0].start, self._blocks[-1].end
            return last - first if last > first else self.capacity - first + last

    def try_alloc(self, nbytes: int) -> tuple[_Block, torch.Tensor] | None:
        """A block of ``nbytes`` bytes, or None if the ring has no room now."""
        if nbytes > self.capacity:
            raise ValueError(f"{nbytes} bytes do not fit a pinned buffer of {self.capacity}")
        with self._cond:
            start = self._find(-(-nbytes // _ALIGN) * _ALIGN)
            if start is None:
                return None
            block = _Block(start, start + -(-nbytes // _ALIGN) * _ALIGN)
            self._blocks.append(block)
            return block, self.buffer[start : start + nbytes]

    def alloc(self, nbytes: int, *, poll_s: float = 0.5) -> tuple[_Block, torch.Tensor]:
        """Like `try_alloc` but waits until older blocks are freed."""
        while True:
            got = self.try_alloc(nbytes)
            if got is not None:
                return got
            with self._cond:
                self._cond.wait(poll_s)
            if not self._alive():
                raise RuntimeError(
                    "the hsdump writer thread has stopped; no pinned memory frees up"
                )

    def free(self, block: _Block) -> None:
        """Return a block; space is reclaimed once every older block is free too."""
        with self._cond:
            block.freed = True
            while self._blocks and self._blocks[0].freed:
                self._blocks.popleft()
            self._cond.notify_all()

    def _find(self, size: int) -> int | None:
        if not self._blocks:
            return 0 if size <= self.capacity else None
        first, last = self._blocks[0].start, self._blocks[-1].end
        if last > first:  # not wrapped: room after the newest block, or before the oldest
            if last + size <= self.capacity:
                return last
            return 0 if size <= first else None
        return last if last + size <= first else None


@dataclass
class Piece:
    """Rows ``[start, start + n)`` of request ``rid``, staged in pinned memory.

    ``aux`` and ``final`` are uint8 views of the staged bytes (row-major ``[n, K, H]`` and
    ``[n, H]``); ``block`` is returned to the ring once they are written.
    """

    rid: str
    start: int
    n: int
    total: int
    first: bool
    input_ids: tuple[int, ...] | None
    aux: torch.Tensor
    final: torch.Tensor
    block: Any


class _DoneEvent:
    def synchronize(self) -> None:
        """Nothing to wait for: the copies ran synchronously on the CPU."""


def record_event(device: torch.device) -> Any:
    """An event after the work queued so far on ``device``'s current stream."""
    if device.type != "cuda":
        return _DoneEvent()
    event = torch.cuda.Event()  # type: ignore[no-untyped-call]
    event.record(torch.cuda.current_stream(device))
    return event


class Stager:
    """Copies a slice's rows into the pinned ring and hands groups of pieces to a consumer.

    Args:
        ring: The pinned ring.
        num_layers: K.
        hidden_size: H.
        submit: Called with ``(event, pieces)`` once the pieces' copies are queued; the consumer
            waits on the event, writes the pieces and frees their blocks.
    """

    def __init__(
        self,
        ring: PinnedRing,
        *,
        num_layers: int,
        hidden_size: int,
        submit: Callable[[Any, list[Piece]], None],
    ):
        self.ring, self.k, self.h = ring, num_layers, hidden_size
        self._submit = submit
        self._pending: list[Piece] = []
        self._device = torch.device("cpu")

    def stage(
        self, hidden: torch.Tensor, rid: str, row: int, n: int, start: int, **info: Any
    ) -> None:
        """Queue the copy of rows ``[row, row + n)`` of ``hidden`` ([rows, (K+1)*H]) for ``rid``."""
        self._device = hidden.device
        row_bytes = (self.k + 1) * self.h * hidden.element_size()
        step = max(1, min(n, (self.ring.capacity // 4) // row_bytes))
        for offset in range(0, n, step):
            m = min(step, n - offset)
            self._stage_piece(
                hidden, rid, row + offset, m, start + offset, first=offset == 0, **info
            )

    def flush(self) -> None:
        """Hand the queued pieces over, behind an event recorded after their copies."""
        if self._pending:
            pieces, self._pending = self._pending, []
            self._submit(record_event(self._device), pieces)

    def _stage_piece(
        self,
        hidden: torch.Tensor,
        rid: str,
        row: int,
        n: int,
        start: int,
        *,
        first: bool,
        **info: Any,
    ) -> None:
        kh, size = self.k * self.h, hidden.element_size()
        nbytes = n * (kh + self.h) * size
        got = self.ring.try_alloc(nbytes)
        if got is None:
            self.flush()  # the consumer can only free what it was given
            got = self.ring.alloc(nbytes)
        block, buf = got
        aux, final = buf[: n * kh * size], buf[n * kh * size :]
        aux.view(hidden.dtype).view(n, kh).copy_(hidden[row : row + n, :kh], non_blocking=True)
        final.view(hidden.dtype).view(n, self.h).copy_(
            hidden[row : row + n, kh:], non_blocking=True
        )
        self._pending.append(
            Piece(
                rid=rid,
                start=start,
                n=n,
                total=info["total"],
                first=first and start == 0,
                input_ids=info.get("input_ids") if first else None,
                aux=aux,
                final=final,
                block=block,
            )
        )
