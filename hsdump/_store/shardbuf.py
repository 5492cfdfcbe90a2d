"""In-RAM shard buffers and the placement of a sample's rows into them.

A writer reserves a sample's rows in one or more shard buffers (a sample may straddle a shard
boundary), then one job on the codec pool copies the rows in and computes the sample's checksum
and statistics. Placement was the serial part of a write (one writer thread copying and
checksumming every byte); as a job, samples are placed in parallel while the writer takes the
next one. A shard is encoded only once every job placing rows in it is done
(`ShardBuffer.wait_placed`).
"""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from hsdump._store.integrity import crc32
from hsdump._store.stats import BLOCK_ROWS, LayerStats, RowStats

__all__ = ["Piece", "Placed", "ShardBuffer", "place_sample"]


@dataclass
class ShardBuffer:
    """One shard's rows, token ids and mask, filled before the shard is written whole."""

    rows: np.ndarray
    ids: np.ndarray
    mask: np.ndarray
    start: int = 0
    placing: list[Future[Any]] = field(default_factory=list)

    @classmethod
    def allocate(cls, tokens: int, layers: int, hidden: int, dtype: np.dtype[Any]) -> ShardBuffer:
        """Empty buffers for ``tokens`` rows of ``[layers, hidden]`` values of ``dtype``."""
        return cls(
            np.empty((tokens, layers, hidden), dtype),
            np.empty(tokens, np.int32),
            np.empty(tokens, np.uint8),
        )

    def wait_placed(self) -> None:
        """Block until every row reserved in this shard is in place (re-raising a job's error)."""
        for job in self.placing:
            job.result()
        self.placing.clear()


@dataclass(frozen=True)
class Piece:
    """Rows ``[pos, pos + take)`` of a sample go to rows ``[row, row + take)`` of ``shard``."""

    shard: ShardBuffer
    row: int
    pos: int
    take: int


@dataclass(frozen=True)
class Placed:
    """What placing a sample computed on the way: its checksum and its statistics."""

    crc: int
    stats: list[LayerStats]


def place_sample(
    pieces: list[Piece],
    aux: np.ndarray,
    final: np.ndarray,
    ids: np.ndarray,
    mask: np.ndarray | None,
    stats: RowStats,
) -> Placed:
    """Copy a sample's aux and final rows into its pieces, with its checksum and statistics.

    One pass in blocks of `BLOCK_ROWS` rows: each block is copied,
    then checksummed and accounted in ``stats`` while it is in cache (three passes over memory
    were the store's largest cost after the codec). The checksum is zlib's CRC-32 of the stored
    rows in order, then the token ids, then the mask if any.
    """
    k, crc = aux.shape[1], 0
    for p in pieces:
        for lo in range(0, p.take, BLOCK_ROWS):
            n = min(BLOCK_ROWS, p.take - lo)
            rows = p.shard.rows[p.row + lo : p.row + lo + n]
            src = slice(p.pos + lo, p.pos + lo + n)
            rows[:, :k] = aux[src]
            rows[:, k] = final[src]
            crc = crc32(rows.data, crc)
            stats.add(rows)
    crc = crc32(ids.data, crc)
    if mask is not None:
        crc = crc32(mask.data, crc)
    return Placed(crc, stats.result())
