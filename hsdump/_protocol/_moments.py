"""Row moments: the sum and the sum of squares of every vector of a dump, declared beside it.

``moments.bin`` holds float32 ``[T, K + 1, 2]``: for each token, its K aux vectors and then its
final one, the sum and the sum of squares of the H values, accumulated in float32 or wider. A
producer that announces ``capabilities.row_moments`` writes it with every dump; the SGLang plugin
computes it on the GPU, where the states are, so the client's store takes its per-layer statistics
(mean, standard deviation) without widening every value on the CPU (a quarter of a write's work).

The file is a claim about the dump, so the client checks it against the dump's own values on a
few rows of every dump (`moments_error`): moments that describe other rows are refused. The value
check (finite, no vector all zeros) still reads every row's bits itself.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from hsdump._exceptions import MomentsMismatch
from hsdump._protocol._dtypes import dtype_spec

if TYPE_CHECKING:
    import numpy as np

__all__ = ["MOMENTS_FILE", "SPOT_ROWS", "moments_error", "row_moments", "spot_rows"]

MOMENTS_FILE = "moments.bin"
#: Rows of each dump whose declared moments the client recomputes (all rows of a shorter dump).
SPOT_ROWS = 16
# Float32 sums of H values in any order stay within ~1e-6 of their size; a row's moments taken
# from another row miss by far more.
_TOLERANCE = 1e-3
_FLOAT32_MAX = 3.4e38
_BLOCK_ROWS = 64


def row_moments(aux: np.ndarray, final: np.ndarray, dtype: str) -> np.ndarray:
    """The moments of rows ``aux [n, K, H]`` and ``final [n, H]`` (raw bits of ``dtype``), float32
    ``[n, K + 1, 2]``, computed on the CPU (what a producer without a GPU writes)."""
    import numpy as np

    spec, n, k = dtype_spec(dtype), aux.shape[0], aux.shape[1]
    out = np.empty((n, k + 1, 2), np.float32)
    with np.errstate(over="ignore", invalid="ignore"):
        for lo in range(0, n, _BLOCK_ROWS):
            hi = min(n, lo + _BLOCK_ROWS)
            for values, dest in (
                (spec.to_float32(aux[lo:hi]), out[lo:hi, :k]),
                (spec.to_float32(final[lo:hi, None]), out[lo:hi, k:]),
            ):
                dest[..., 0] = np.einsum("tlh->tl", values)
                dest[..., 1] = np.einsum("tlh,tlh->tl", values, values)
    return out


def spot_rows(num_tokens: int, count: int = SPOT_ROWS) -> np.ndarray:
    """The rows to check: the first, the last and others drawn at random (all of a short dump)."""
    import numpy as np

    if num_tokens <= count:
        return np.arange(num_tokens)
    drawn = np.random.default_rng().choice(num_tokens - 2, count - 2, replace=False) + 1
    return np.unique(np.concatenate([[0, num_tokens - 1], drawn]))


def moments_error(
    moments: np.ndarray,
    aux: np.ndarray,
    final: np.ndarray,
    dtype: str,
    rows: np.ndarray,
    *,
    layer_ids: list[int],
    sample_id: str | None,
    rid: str | None,
) -> MomentsMismatch | None:
    """Why ``moments`` do not describe ``rows`` of the dump's values, if they do not
    (``layer_ids``: the aux layers, named in the error).

    Rows whose values are not finite are skipped: the value check refuses them.
    """
    import numpy as np

    spec, k = dtype_spec(dtype), aux.shape[1]
    with np.errstate(over="ignore", invalid="ignore"):
        values = np.concatenate(
            [spec.to_float32(aux[rows]), spec.to_float32(final[rows][:, None])], axis=1
        ).astype(np.float64)
        sums, squares = values.sum(axis=2), np.square(values).sum(axis=2)
        declared = moments[rows].astype(np.float64)
        hidden = values.shape[2]
        off = (np.abs(declared[..., 0] - sums) > _TOLERANCE * np.sqrt(hidden * squares)) | (
            np.abs(declared[..., 1] - squares) > _TOLERANCE * squares
        )
    off &= np.isfinite(sums) & (squares < _FLOAT32_MAX)
    if not off.any():
        return None
    i, layer = (int(x) for x in np.argwhere(off)[0])
    name = "the final state" if layer == k else f"aux layer {layer_ids[layer]}"
    return MomentsMismatch(
        f"{MOMENTS_FILE} does not describe the dump: at token {int(rows[i])}, {name} declares "
        f"sum {declared[i, layer, 0]:.6g} and sum of squares {declared[i, layer, 1]:.6g}, its "
        f"values give {sums[i, layer]:.6g} and {squares[i, layer]:.6g}. The producer's moments "
        "or its row writes are wrong: a retry may pass; if it persists, the plugin is broken.",
        sample_id=sample_id,
        rid=rid,
    )
