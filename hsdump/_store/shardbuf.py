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

from hsdump._exceptions import DumpValidationError
from hsdump._protocol import value_error
from hsdump._store.integrity import crc32
from hsdump._store.stats import BLOCK_ROWS, LayerStats, RowStats

__all__ = ["Piece", "Placed", "ShardBuffer", "ValueCheck", "place_sample"]


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
    """What placing a sample computed on the way: its checksum and its statistics, or why its
    values were refused (`ValueCheck`; its rows are then zeros and it is not committed)."""

    crc: int
    stats: list[LayerStats]
    refused: DumpValidationError | None = None


@dataclass(frozen=True)
class ValueCheck:
    """The value check of a dump that ingest left to placement (`HiddenStates.values_checked`).

    It reads the peaks the statistics keep (`RowStats.peaks`), so it costs no pass of its own,
    and raises what the client's check raises: aux rows first, then the final rows.

    Attributes:
        sample_id: Named in the error.
        rid: The request the dump answered, named in the error.
        aux_layers: K, the aux layers stored before the final one in each row.
    """

    sample_id: str
    rid: str | None
    aux_layers: int

    def error(self, stats: RowStats) -> DumpValidationError | None:
        """Why the rows accounted in ``stats`` are refused, if they are."""
        peaks, k, spec = stats.peaks(), self.aux_layers, stats.spec
        sample_id, rid = self.sample_id, self.rid
        return value_error(
            peaks[:, :k], spec, name="aux_hidden_states", sample_id=sample_id, rid=rid
        ) or value_error(peaks[:, k], spec, name="final_hidden_state", sample_id=sample_id, rid=rid)


def place_sample(
    pieces: list[Piece],
    aux: np.ndarray,
    final: np.ndarray,
    ids: np.ndarray,
    mask: np.ndarray | None,
    stats: RowStats,
    check: ValueCheck | None = None,
) -> Placed:
    """Copy a sample's aux and final rows into its pieces, with its checksum and statistics.

    One pass in blocks of `BLOCK_ROWS` rows: each block is copied, then checksummed and accounted
    in ``stats`` while it is in cache (three passes over memory were the store's largest cost
    after the codec). The checksum is zlib's CRC-32 of the stored rows in order, then the token
    ids, then the mask if any. With ``check``, values that fail it are refused: the rows are
    zeroed (no bytes of the sample stay in the shard) and ``Placed.refused`` says why.
    """
    crc = _copy_rows(pieces, aux, final, aux.shape[1], stats)
    refused = None if check is None else check.error(stats)
    if refused is not None:
        for p in pieces:
            p.shard.rows[p.row : p.row + p.take] = 0
        return Placed(0, [], refused)
    crc = crc32(ids.data, crc)
    if mask is not None:
        crc = crc32(mask.data, crc)
    return Placed(crc, stats.result())


def _copy_rows(
    pieces: list[Piece], aux: np.ndarray, final: np.ndarray, k: int, stats: RowStats
) -> int:
    """Copy each block of rows in, then checksum and account it while it is in cache."""
    crc = 0
    for p in pieces:
        for lo in range(0, p.take, BLOCK_ROWS):
            n = min(BLOCK_ROWS, p.take - lo)
            rows = p.shard.rows[p.row + lo : p.row + lo + n]
            rows[:, :k] = aux[p.pos + lo : p.pos + lo + n]
            rows[:, k] = final[p.pos + lo : p.pos + lo + n]
            crc = crc32(rows.data, crc)
            stats.add(rows)
    return crc
