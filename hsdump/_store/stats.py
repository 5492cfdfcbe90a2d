"""Running per-layer statistics of the stored hidden states: the data-quality summary.

For every layer (the K aux layers, then the final state) the store keeps the number of values, their
mean and standard deviation, the largest absolute value and the number of NaN/Inf values. Partial
sums are merged with Chan's parallel formula, so statistics of several writers combine exactly.
"""

from __future__ import annotations

import math

import numpy as np
from pydantic import BaseModel, ConfigDict

from hsdump._protocol import DtypeSpec, dtype_spec

__all__ = [
    "BLOCK_ROWS",
    "LayerStats",
    "RowStats",
    "merge_layer_lists",
]

#: Rows per block: float32 row sums stay accurate, and a block's float32 copy (7 MiB at H=7168
#: with 4 layers) stays in cache for the passes over it.
BLOCK_ROWS = 64


class LayerStats(BaseModel):
    """Statistics of one layer's values.

    Attributes:
        layer: The layer id (``hidden_states`` index), or ``"final"``.
        count: Finite values seen.
        mean: Mean of the finite values.
        m2: Sum of squared deviations from the mean (``std = sqrt(m2 / count)``).
        max_abs: Largest absolute finite value.
        non_finite: NaN and infinite values seen.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    layer: int | str
    count: int = 0
    mean: float = 0.0
    m2: float = 0.0
    max_abs: float = 0.0
    non_finite: int = 0

    @property
    def std(self) -> float:
        """Population standard deviation of the finite values."""
        return math.sqrt(self.m2 / self.count) if self.count else 0.0

    def merge(self, other: LayerStats) -> LayerStats:
        """Combine two disjoint sets of values (Chan et al.)."""
        n = self.count + other.count
        if n == 0:
            return self.model_copy(update={"non_finite": self.non_finite + other.non_finite})
        delta = other.mean - self.mean
        mean = self.mean + delta * other.count / n
        m2 = self.m2 + other.m2 + delta * delta * self.count * other.count / n
        return LayerStats(
            layer=self.layer,
            count=n,
            mean=mean,
            m2=m2,
            max_abs=max(self.max_abs, other.max_abs),
            non_finite=self.non_finite + other.non_finite,
        )

    def summary(self) -> dict[str, float | int | str]:
        """A flat dict for display: layer, count, mean, std, max_abs, non_finite."""
        return {
            "layer": self.layer,
            "count": self.count,
            "mean": self.mean,
            "std": self.std,
            "max_abs": self.max_abs,
            "non_finite": self.non_finite,
        }


def merge_layer_lists(a: list[LayerStats], b: list[LayerStats]) -> list[LayerStats]:
    """Merge two per-layer lists (an empty list is the identity)."""
    if not a:
        return list(b)
    if not b:
        return list(a)
    return [x.merge(y) for x, y in zip(a, b, strict=True)]


class RowStats:
    """Per-layer statistics over blocks of stored rows ``[n, L, H]`` of float bits.

    One accumulator per sample. Each block costs five numpy calls, each of which releases the
    interpreter lock: the widening to float32 (into a scratch buffer reused from block to block;
    a fresh buffer per block cost page faults, a third of the time), the row sums, the row sums of
    squares, and the two maxima of the bits that give each row's peak magnitude. Their per-row
    results are kept, and `result` reduces them once: a dozen calls per block made the threads
    placing samples wait on the lock for each other and for the interpreter's other threads.
    Rows with a NaN or Inf (or a float32 square that overflows) are taken again on the exact
    float64 path, from the kept views of their blocks.

    With ``moments`` (the producer's row sums and sums of squares, `HiddenStates.row_moments`),
    a block costs only the two maxima: no widening and no sums.

    Args:
        dtype: The logical dtype of the bits.
        layers: One id per layer (axis 1).
        moments: Float32 ``[rows, L, 2]`` of the rows that will be added, in order, or None.
    """

    def __init__(
        self, dtype: str, layers: list[int | str], moments: np.ndarray | None = None
    ) -> None:
        self._spec = dtype_spec(dtype)
        self._layers = layers
        self._moments, self._added = moments, 0
        self._blocks: list[np.ndarray] = []
        self._sums: list[np.ndarray] = []
        self._squares: list[np.ndarray] = []
        self._unsigned: list[np.ndarray] = []
        self._signed: list[np.ndarray] = []
        self._scratch: np.ndarray | None = None

    def add(self, bits: np.ndarray) -> None:
        """Account rows ``[n, L, H]``, in blocks of at most `BLOCK_ROWS` rows.

        The rows must stay as they are until `result` (the views are kept for rows that are not
        finite).
        """
        for start in range(0, bits.shape[0], BLOCK_ROWS):
            self._add_block(bits[start : start + BLOCK_ROWS])

    @property
    def spec(self) -> DtypeSpec:
        """The float format of the bits."""
        return self._spec

    def peaks(self) -> np.ndarray:
        """The peak magnitude of every vector added so far, as bits: ``[rows, L]``, in order
        (`DtypeSpec.peak_magnitude`; what the value check of a dump reads)."""
        if not self._blocks:
            return np.zeros((0, len(self._layers)), self._spec.bits_dtype)
        return self._spec.peak_of(np.concatenate(self._unsigned), np.concatenate(self._signed))

    def result(self) -> list[LayerStats]:
        """The statistics of every row added so far, one per layer."""
        empty = [LayerStats(layer=i) for i in range(len(self._layers))]
        total = self._reduce() if self._blocks else empty
        return [p.model_copy(update={"layer": i}) for p, i in zip(total, self._layers, strict=True)]

    def _add_block(self, block: np.ndarray) -> None:
        if self._moments is not None:
            given = self._moments[self._added : self._added + block.shape[0]]
            self._sums.append(given[..., 0])
            self._squares.append(given[..., 1])
        else:
            values = self._widen(block)
            with np.errstate(over="ignore", invalid="ignore"):
                # einsum sums in SIMD lanes, faster than add.reduce's pairwise sum
                # (benchmarks/bench_store_steps.py); float32 row sums of 7168 values stay within
                # 1e-6 of their size.
                self._sums.append(np.einsum("tlh->tl", values))
                self._squares.append(np.einsum("tlh,tlh->tl", values, values))
        self._added += block.shape[0]
        # Without the sign bit, float bits order like magnitudes (DtypeSpec.peak_magnitude).
        self._unsigned.append(block.max(axis=2))
        self._signed.append(block.view(f"i{self._spec.itemsize}").max(axis=2))
        self._blocks.append(block)

    def _reduce(self) -> list[LayerStats]:
        sums, squares = np.concatenate(self._sums), np.concatenate(self._squares)
        # A NaN or Inf (or float32 overflow of a square) shows in the row's sums, and in its peaks
        # even where sums were given: exact path.
        fast = np.isfinite(squares).all(axis=1) & np.isfinite(sums).all(axis=1)
        fast &= (self.peaks() < self._spec.exponent_mask).all(axis=1)
        rows, hidden = int(fast.sum()), self._blocks[0].shape[2]
        stats = _block_stats(
            (rows, sums.shape[1], hidden),
            sums[fast].sum(0, dtype=np.float64),
            squares[fast].sum(0, dtype=np.float64),
            self._peak(fast),
            None,
        )
        if rows == fast.shape[0]:
            return stats
        bad = self._spec.to_float32(self._rows_where(~fast))
        return merge_layer_lists(stats, _nonfinite_block_stats(bad))

    def _rows_where(self, pick: np.ndarray) -> np.ndarray:
        """The kept rows where ``pick`` (one flag per row, in order) is set."""
        out, start = [], 0
        for block in self._blocks:
            mine = pick[start : start + block.shape[0]]
            start += block.shape[0]
            if mine.any():
                out.append(block[mine])
        return np.concatenate(out)

    def _peak(self, fast: np.ndarray) -> np.ndarray:
        """Largest magnitude per layer of the finite rows."""
        if not fast.any():
            return np.zeros(len(self._layers))
        peak = self.peaks()[fast].max(axis=0)
        return self._spec.to_float32(np.ascontiguousarray(peak))

    def _widen(self, block: np.ndarray) -> np.ndarray:
        if self._scratch is None or self._scratch.shape[1:] != block.shape[1:]:
            self._scratch = np.empty((BLOCK_ROWS, *block.shape[1:]), np.float32)
        return self._spec.to_float32(block, out=self._scratch[: block.shape[0]])


def _block_stats(
    shape: tuple[int, ...],
    sums: np.ndarray,
    squares: np.ndarray,
    max_abs: np.ndarray,
    bad: np.ndarray | None,
) -> list[LayerStats]:
    rows, layers, hidden = shape
    bad_counts = [0] * layers if bad is None else [int(b) for b in bad]
    out = []
    for i in range(layers):
        n = rows * hidden - bad_counts[i]
        mean = float(sums[i]) / n if n else 0.0
        m2 = max(float(squares[i]) - n * mean * mean, 0.0)
        out.append(
            LayerStats(
                layer=i,
                count=n,
                mean=mean,
                m2=m2,
                max_abs=float(max_abs[i]),
                non_finite=bad_counts[i],
            )
        )
    return out


def _nonfinite_block_stats(values: np.ndarray) -> list[LayerStats]:
    with np.errstate(invalid="ignore"):  # signalling NaNs raise "invalid" when widened
        wide = values.astype(np.float64)
    finite = np.isfinite(wide)
    bad = (~finite).sum(axis=(0, 2))
    wide = np.where(finite, wide, 0.0)
    max_abs = np.abs(wide).max(axis=(0, 2)) if wide.shape[0] else np.zeros(wide.shape[1])
    sums, squares = wide.sum(axis=(0, 2)), np.square(wide).sum(axis=(0, 2))
    return _block_stats(wide.shape, sums, squares, max_abs, bad)
