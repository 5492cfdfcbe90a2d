"""Which rows of a prefill batch belong to which opted-in request, chunk by chunk.

Runs in the scheduler thread, synchronously inside the forward hook: under the overlap scheduler a
request's ``prefix_len`` already describes its next chunk by the time the batch result is
processed, so the mapping must be taken here. It reads only plain attributes of SGLang's
``ScheduleBatch`` and ``Req`` (``reqs``, ``extend_lens``, ``prefix_lens``, ``decoding_reqs``,
``rid``, ``origin_input_ids``, ``output_ids``), which is what the CPU tests build stand-ins of.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from hsdump._protocol import is_opted_in

__all__ = ["BatchPlan", "ChunkPlanner", "Slice"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Slice:
    """Rows ``[row, row + n)`` of a batch's hidden states: tokens ``[start, start + n)`` of ``rid``.

    Attributes:
        rid: The request id.
        row: First row in the batch's packed hidden states.
        n: Number of rows (this chunk's extend length).
        start: Position of the first row in the prompt (the chunk's prefix length).
        total: T, the prompt length.
        input_ids: The prompt's token ids, carried by the first chunk only.
        last: Whether this chunk completes the prompt.
    """

    rid: str
    row: int
    n: int
    start: int
    total: int
    input_ids: tuple[int, ...] | None
    last: bool


@dataclass(frozen=True)
class BatchPlan:
    """What one forward pass means for the dump: rows to copy and requests to fail.

    Attributes:
        slices: Rows to copy, in batch order.
        errors: ``(rid, reason)`` for requests whose capture cannot be complete.
        rows: Rows the batch's hidden states must hold at least (padding may follow).
    """

    slices: list[Slice]
    errors: list[tuple[str, str]]
    rows: int


@dataclass
class _Open:
    total: int
    next_start: int
    last_seen: float


class ChunkPlanner:
    """Tracks requests whose prefill spans several chunks and turns batches into `BatchPlan`.

    A request is open from its first chunk (which must start at token 0) until a chunk ends at
    token T; every chunk in between must start where the previous one ended.

    Only requests that opted in (`hsdump._protocol.is_opted_in`: their rid carries the protocol's
    prefix, which every hsdump client sends) are planned.

    Args:
        clock: Monotonic time source (for expiring requests that stopped arriving).
    """

    def __init__(self, *, clock: Callable[[], float] = time.monotonic):
        self._clock = clock
        self._open: dict[str, _Open] = {}

    @property
    def open_rids(self) -> list[str]:
        """Requests with some chunks seen and more to come."""
        return list(self._open)

    def plan(self, batch: Any) -> BatchPlan:
        """Map an EXTEND or MIXED batch's rows to opted-in requests."""
        decoding = {id(req) for req in (getattr(batch, "decoding_reqs", None) or ())}
        slices: list[Slice] = []
        errors: list[tuple[str, str]] = []
        row = 0
        for i, req in enumerate(batch.reqs):
            n, start = int(batch.extend_lens[i]), int(batch.prefix_lens[i])
            if id(req) not in decoding and self._wanted(req):
                outcome = self._chunk(req, row, n, start)
                (slices if isinstance(outcome, Slice) else errors).append(outcome)  # type: ignore[arg-type]
            row += n
        return BatchPlan(slices=slices, errors=errors, rows=row)

    def forget(self, rid: str) -> None:
        """Stop tracking ``rid`` (its capture failed or was dropped)."""
        self._open.pop(rid, None)

    def expire(self, ttl_s: float) -> list[str]:
        """Drop and return requests whose next chunk has not come for ``ttl_s`` seconds."""
        now = self._clock()
        stale = [rid for rid, o in self._open.items() if now - o.last_seen > ttl_s]
        for rid in stale:
            del self._open[rid]
        return stale

    def _wanted(self, req: Any) -> bool:
        # A request with output tokens is decoding (e.g. a decode batch turned into EXTEND by
        # DP attention): its rows are not prompt rows.
        return is_opted_in(req.rid) and len(req.output_ids) == 0

    def _chunk(self, req: Any, row: int, n: int, start: int) -> Slice | tuple[str, str]:
        rid, total = req.rid, len(req.origin_input_ids)
        opened = self._open.get(rid)
        if start == 0:
            if opened is not None:
                logger.warning("hsdump: request %s restarted its prefill; dropping its rows", rid)
            opened = self._open[rid] = _Open(total=total, next_start=0, last_seen=self._clock())
        elif opened is None:
            return rid, _prefix_reason(rid, start, total)
        if start != opened.next_start or start + n > total or total != opened.total:
            self.forget(rid)
            return rid, (
                f"request {rid}: a prefill chunk covers tokens [{start}, {start + n}) of {total}, "
                f"but the next expected chunk starts at token {opened.next_start}"
            )
        opened.next_start, opened.last_seen = start + n, self._clock()
        last = opened.next_start == total
        if last:
            del self._open[rid]
        ids = tuple(int(t) for t in req.origin_input_ids) if start == 0 else None
        return Slice(rid=rid, row=row, n=n, start=start, total=total, input_ids=ids, last=last)


def _prefix_reason(rid: str, start: int, total: int) -> str:
    return (
        f"request {rid}: the first {start} of its {total} prompt tokens came from the prefix "
        "cache, so their hidden states were never computed. Send a unique extra_key with every "
        "request (the hsdump client does) or start the server with --disable-radix-cache."
    )
