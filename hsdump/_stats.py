"""Running per-layer statistics of the stored hidden states: the data-quality summary.

For every layer (the K aux layers, then the final state) the store keeps the number of values, their
mean and standard deviation, the largest absolute value and the number of NaN/Inf values. Partial
sums are merged with Chan's parallel formula, so statistics of several writers combine exactly.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from pydantic import BaseModel, ConfigDict

if TYPE_CHECKING:
    import torch

__all__ = ["LayerStats", "merge_layer_lists", "tensor_stats"]

# Rows per block: float32 row sums stay accurate and temporaries stay small.
_BLOCK_ROWS = 512


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


def tensor_stats(x: torch.Tensor, layers: list[int | str]) -> list[LayerStats]:
    """Statistics of ``x`` ``[T, L, H]`` per layer (dimension 1)."""
    import torch

    total = [LayerStats(layer=name) for name in layers]
    for start in range(0, x.shape[0], _BLOCK_ROWS):
        block = x[start : start + _BLOCK_ROWS]
        # Reductions over the contiguous last axis run at memory speed; a NaN or Inf (or a float32
        # overflow of the squares) shows up in the row sums and sends the block to the exact path.
        sums = block.sum(2, dtype=torch.float32)
        norms = torch.linalg.vector_norm(block, dim=2, dtype=torch.float32)
        if bool(torch.isfinite(sums).all()) and bool(torch.isfinite(norms).all()):
            part = _block_stats(block, sums.double().sum(0), norms.double().square().sum(0), None)
        else:
            part = _nonfinite_block_stats(block)
        total = merge_layer_lists(
            total, [p.model_copy(update={"layer": n}) for p, n in zip(part, layers, strict=True)]
        )
    return total


def _block_stats(
    block: torch.Tensor, sums: torch.Tensor, squares: torch.Tensor, bad: torch.Tensor | None
) -> list[LayerStats]:
    rows, layers, hidden = block.shape
    bad_counts = [0] * layers if bad is None else bad.tolist()
    max_abs = block.abs().amax(dim=(0, 2)).float().tolist() if rows else [0.0] * layers
    out = []
    for i in range(layers):
        n = rows * hidden - bad_counts[i]
        mean = float(sums[i]) / n if n else 0.0
        m2 = max(float(squares[i]) - n * mean * mean, 0.0)
        out.append(
            LayerStats(
                layer=i, count=n, mean=mean, m2=m2, max_abs=max_abs[i], non_finite=bad_counts[i]
            )
        )
    return out


def _nonfinite_block_stats(block: torch.Tensor) -> list[LayerStats]:
    import torch

    values = block.double()
    finite = torch.isfinite(values)
    bad = (~finite).sum(dim=(0, 2))
    values = torch.where(finite, values, 0.0)
    return _block_stats(values, values.sum(dim=(0, 2)), values.square().sum(dim=(0, 2)), bad)
