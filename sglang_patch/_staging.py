"""Device-to-host staging: a bounded pinned ring buffer and the copies that fill it.

The forward's outputs may be views of a CUDA graph's output buffer that the next replay
overwrites, so a piece's rows are first copied on the stream that ran the forward, right after it,
into a snapshot of their own (device to device: ~0.3% of a prefill's time at H=7168). The copy to
pinned memory then runs on a stream of its own, beside the next forward (`SideCopies`): queued on
the forward's stream, it held the GPU ~1 us a token (57 KB at 54 GB/s), 11% of an H200's prefill
at 112k tokens/s. The scheduler thread blocks only when the ring (host memory) or the snapshots in
flight (GPU memory, `SNAPSHOT_BYTES`) reach their bounds.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

__all__ = [
    "SNAPSHOT_BYTES",
    "Piece",
    "PinnedRing",
    "SideCopies",
    "Stager",
    "record_event",
    "stage_rows",
    "vector_moments",
]

_ALIGN = 64
#: GPU memory for snapshots whose copies to pinned memory are in flight (1 GiB: the default
#: 8192-token chunk at H=7168 with 3 aux layers is 470 MB).
SNAPSHOT_BYTES = 1 << 30

logger = logging.getLogger(__name__)


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
    ``[n, H]``), ``moments`` one of the rows' float32 ``[n, K + 1, 2]`` (`vector_moments`; None
    where the GPU had no memory for them: the writer computes them); ``moments_ready``, when
    set, is the event after which they are in place (they are taken on a stream of their own, so
    the rows need not wait for them); ``block`` is returned to the ring once they are written.
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
    moments: torch.Tensor | None = None
    moments_ready: Any = None


class _DoneEvent:
    def synchronize(self) -> None:
        """Nothing to wait for: the copies ran synchronously on the CPU."""


def record_event(device: torch.device, stream: Any = None) -> Any:
    """An event after the work queued so far on ``stream`` (default: ``device``'s current one)."""
    if device.type != "cuda":
        return _DoneEvent()
    event = torch.cuda.Event()  # type: ignore[no-untyped-call]
    event.record(stream or torch.cuda.current_stream(device))
    return event


class SideCopies:
    """Copies to pinned memory on a CUDA stream of their own, from snapshots of the rows; the rows'
    moments are taken from the same snapshots on a second stream, so that the copies (and the
    writer waiting for them) never wait for the moments' kernels.

    Args:
        device: The GPU.
        limit: Bytes of snapshots in flight; above it the scheduler waits for the oldest copies.
    """

    def __init__(self, device: torch.device, limit: int):
        self.stream = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]
        self.moments_stream = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]
        self.limit = limit
        self._in_flight: deque[tuple[list[Any], int]] = deque()
        self._bytes = 0
        self._warned = False

    def copy(self, rows: torch.Tensor, dest: torch.Tensor, kh: int, moments: torch.Tensor) -> bool:
        """Queue the copy of ``rows`` ([n, (K+1)*H] on the GPU) into pinned ``dest`` (`stage_rows`'s
        layout), and of their `vector_moments` into pinned ``moments`` (float32 ``[n, K+1, 2]``),
        taken on the moments' stream from the snapshot. Without GPU memory for a snapshot, the
        copy runs on the forward's stream and no moments are taken; returns whether they were."""
        forward = torch.cuda.current_stream(rows.device)
        self._make_room(dest.nbytes)
        try:
            snapshot = torch.empty_like(dest, device=rows.device)
        except torch.cuda.OutOfMemoryError:
            if not self._warned:
                self._warned = True
                logger.warning(
                    "hsdump: no GPU memory for a %d MB snapshot; copying on the forward's stream "
                    "(lower --mem-fraction-static)",
                    dest.nbytes >> 20,
                )
            stage_rows(rows, dest, kh)
            self.stream.wait_stream(forward)  # so that `event` covers this copy too
            return False
        stage_rows(rows, snapshot, kh)  # on the forward's stream
        self.stream.wait_stream(forward)
        with torch.cuda.stream(self.stream):
            dest.copy_(snapshot, non_blocking=True)  # one contiguous copy
        snapshot.record_stream(self.stream)  # not reused before the side stream has read it
        taken = self._take_moments(snapshot, rows.shape, kh, moments)
        streams = (self.stream, self.moments_stream)
        self._in_flight.append((
            [record_event(rows.device, stream) for stream in streams], snapshot.nbytes
        ))  # fmt: skip
        self._bytes += snapshot.nbytes
        return taken

    def _take_moments(
        self, snapshot: torch.Tensor, shape: torch.Size, kh: int, dest: torch.Tensor
    ) -> bool:
        n, width = shape
        self.moments_stream.wait_stream(torch.cuda.current_stream(snapshot.device))
        with torch.cuda.stream(self.moments_stream):
            parts = [snapshot[: n * kh].view(n, -1, width - kh), snapshot[n * kh :].view(n, 1, -1)]
            taken = _moments_copy(parts, dest)
        snapshot.record_stream(self.moments_stream)
        return taken

    def event(self) -> Any:
        """An event after every copy queued so far."""
        return record_event(self.stream.device, self.stream)

    def moments_event(self) -> Any:
        """An event after every copy of moments queued so far."""
        return record_event(self.stream.device, self.moments_stream)

    def _make_room(self, nbytes: int) -> None:
        """Forget finished copies, then wait for the oldest until ``nbytes`` more fit the limit."""
        while self._in_flight:
            done, size = self._in_flight[0]
            if self._bytes + nbytes <= self.limit and not all(e.query() for e in done):
                return
            for event in done:
                event.synchronize()
            self._in_flight.popleft()
            self._bytes -= size


def stage_rows(rows: torch.Tensor, dest: torch.Tensor, kh: int) -> None:
    """Copy ``rows`` ([n, (K+1)*H]) into ``dest`` (n*(K+1)*H values): the n aux rows of K*H
    values, then the n final rows of H."""
    n = rows.shape[0]
    dest[: n * kh].view(n, kh).copy_(rows[:, :kh], non_blocking=True)
    dest[n * kh :].view(n, -1).copy_(rows[:, kh:], non_blocking=True)


def vector_moments(parts: list[torch.Tensor]) -> torch.Tensor:
    """The sum and the sum of squares of every vector of ``parts`` (each ``[n, L, H]``), in
    float32, as ``[n, sum of L, 2]`` on their device (on the GPU: no CPU time per value).

    Two reductions a part, each reading the rows once: on CUDA a bf16 or fp16 input is widened
    inside the reduction, so no float32 copy of the rows is made, and nothing is written to them.
    The sum of squares is the square of the float32 norm (relative error ~1e-7).
    """
    sums = torch.cat([p.sum(-1, dtype=torch.float32) for p in parts], 1)
    norms = torch.cat([torch.linalg.vector_norm(p, dim=-1, dtype=torch.float32) for p in parts], 1)
    return torch.stack((sums, norms.square()), -1)


def _moments_copy(parts: list[torch.Tensor], dest: torch.Tensor) -> bool:
    """Take the moments of ``parts`` into ``dest`` (pinned), queued on the current stream; False
    where the GPU has no memory for them."""
    try:
        dest.copy_(vector_moments(parts), non_blocking=True)
    except torch.cuda.OutOfMemoryError:
        return False
    return True


class Stager:
    """Copies a slice's rows, and their `vector_moments`, into the pinned ring and hands groups of
    pieces to a consumer. On a GPU the copies run through `SideCopies`; on the CPU (tests) they
    run in place.

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
        self._side: SideCopies | None = None

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
        if not self._pending:
            return
        pieces, self._pending = self._pending, []
        if self._side is None:
            self._submit(record_event(self._device), pieces)
            return
        ready = self._side.moments_event()
        for piece in pieces:
            piece.moments_ready = ready if piece.moments is not None else None
        self._submit(self._side.event(), pieces)

    def _side_copies(self, device: torch.device) -> SideCopies | None:
        if self._side is None and device.type == "cuda":
            self._side = SideCopies(device, SNAPSHOT_BYTES)
        return self._side

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
        # The moments first (float32 at the block's aligned start), then the rows.
        lead = n * (self.k + 1) * 2 * 4
        nbytes = lead + n * (kh + self.h) * size
        got = self.ring.try_alloc(nbytes)
        if got is None:
            self.flush()  # the consumer can only free what it was given
            got = self.ring.alloc(nbytes)
        block, buf = got
        moments, staged = buf[:lead], buf[lead:]
        dest = moments.view(torch.float32).view(n, self.k + 1, 2)
        rows = hidden[row : row + n]
        side = self._side_copies(hidden.device)
        if side is not None:
            taken = side.copy(rows, staged.view(hidden.dtype), kh, dest)
        else:
            stage_rows(rows, staged.view(hidden.dtype), kh)
            taken = _moments_copy([rows.reshape(n, self.k + 1, self.h)], dest)
        aux, final = staged[: n * kh * size], staged[n * kh * size :]
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
                moments=moments if taken else None,
            )
        )
