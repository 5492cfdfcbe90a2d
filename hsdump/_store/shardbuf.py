"""In-RAM shard buffers and the placement of a sample's rows into them.

A writer reserves a sample's rows in one or more shard buffers (a sample may straddle a shard
boundary), then one job on the codec pool copies the rows in and computes the sample's checksum.
Placement was the serial part of a write (one writer thread copying and checksumming every
byte); as a job, samples are placed in parallel while the writer takes the next one. A shard is
encoded only once every job placing rows in it is done (:meth:`ShardBuffer.wait_placed`).
"""

from __future__ import annotations

import zlib
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import numpy as np

__all__ = ["Piece", "ShardBuffer", "place_sample"]


@dataclass
class ShardBuffer:
    """One shard's rows, token ids and mask, filled before the shard is written whole."""

    rows: np.ndarray
    ids: np.ndarray
    mask: np.ndarray
    start: int = 0
    placing: list[Future[int]] = field(default_factory=list)

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


def place_sample(
    pieces: list[Piece],
    aux: np.ndarray,
    final: np.ndarray,
    ids: np.ndarray,
    mask: np.ndarray | None,
) -> int:
    """Copy a sample's aux and final rows into its pieces; returns the CRC-32 of its stored bytes.

    The checksum covers the stored rows in order, then the token ids, then the mask if any.
    """
    k, crc = aux.shape[1], 0
    for p in pieces:
        rows = p.shard.rows[p.row : p.row + p.take]
        rows[:, :k] = aux[p.pos : p.pos + p.take]
        rows[:, k] = final[p.pos : p.pos + p.take]
        crc = zlib.crc32(rows.data, crc)
    crc = zlib.crc32(ids.data, crc)
    return crc if mask is None else zlib.crc32(mask.data, crc)
