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
    """Running per-layer statistics over blocks of stored rows ``[n, L, H]`` of float bits.

    One accumulator per sample: the rows are widened to float32 in a scratch buffer that is
    reused from block to block (a fresh buffer per block cost page faults: a third of the time),
    and finite blocks add to running sums, so ``LayerStats`` are built once at the end.

    Args:
        dtype: The logical dtype of the bits.
        layers: One id per layer (axis 1).
    """

    def __init__(self, dtype: str, layers: list[int | str]) -> None:
        self._spec = dtype_spec(dtype)
        self._layers = layers
        n = len(layers)
        self._sums, self._squares, self._peak = np.zeros(n), np.zeros(n), np.zeros(n)
        self._finite_rows, self._hidden = 0, 0
        self._slow: list[LayerStats] = []
        self._scratch: np.ndarray | None = None

    def add(self, bits: np.ndarray) -> None:
        """Account rows ``[n, L, H]``, in blocks of at most `BLOCK_ROWS` rows."""
        self._hidden = bits.shape[2]
        for start in range(0, bits.shape[0], BLOCK_ROWS):
            self._add_block(bits[start : start + BLOCK_ROWS])

    def result(self) -> list[LayerStats]:
        """The statistics of every row added so far, one per layer."""
        shape = (self._finite_rows, len(self._layers), self._hidden)
        fast = _block_stats(shape, self._sums, self._squares, self._peak, None)
        total = merge_layer_lists(fast, self._slow)
        return [p.model_copy(update={"layer": n}) for p, n in zip(total, self._layers, strict=True)]

    def _add_block(self, block: np.ndarray) -> None:
        values = self._widen(block)
        with np.errstate(over="ignore", invalid="ignore"):
            # einsum sums in SIMD lanes, faster than add.reduce's pairwise sum
            # (benchmarks/bench_store_steps.py); float32 row sums of 7168 values stay within 1e-6
            # of their size.
            block_sums = np.einsum("tlh->tl", values)
            block_squares = np.einsum("tlh,tlh->tl", values, values)
        # A NaN or Inf (or float32 overflow of a square) shows in the row sums: exact path.
        if np.isfinite(block_sums).all() and np.isfinite(block_squares).all():
            self._sums += block_sums.sum(0, dtype=np.float64)
            self._squares += block_squares.sum(0, dtype=np.float64)
            np.maximum(self._peak, _max_abs(block, self._spec), out=self._peak)
            self._finite_rows += block.shape[0]
        else:
            self._slow = merge_layer_lists(self._slow, _nonfinite_block_stats(values))

    def _widen(self, block: np.ndarray) -> np.ndarray:
        if self._scratch is None or self._scratch.shape[1:] != block.shape[1:]:
            self._scratch = np.empty((BLOCK_ROWS, *block.shape[1:]), np.float32)
        return self._spec.to_float32(block, out=self._scratch[: block.shape[0]])


def _max_abs(bits: np.ndarray, spec: DtypeSpec) -> np.ndarray:
    """Largest magnitude per layer of a finite block."""
    if not bits.shape[0]:
        return np.zeros(bits.shape[1])
    # Without the sign bit, float bits order like magnitudes: max the bits, not the floats.
    peak = np.ascontiguousarray(spec.peak_magnitude(bits, axis=(0, 2)))
    return spec.to_float32(peak)


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
