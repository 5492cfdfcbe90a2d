"""The value check every dump passes: no NaN or Inf, and no vector of all zeros.

It is decided from each vector's peak magnitude (`DtypeSpec.peak_magnitude`): the client takes
the peaks of each block as it reads a dump, the store takes them from the maxima its statistics
keep while it places a sample (`hsdump._store.stats.RowStats.peaks`). Both raise the same errors.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from hsdump._exceptions import DegenerateValues, DumpValidationError, NonFiniteValues

if TYPE_CHECKING:
    import numpy as np

    from hsdump._protocol._dtypes import DtypeSpec

__all__ = ["value_error"]


def _bad_rows(peaks: np.ndarray, spec: DtypeSpec) -> tuple[int | None, int | None]:
    """The first row with a non-finite value and the first with an all-zero vector, if any.

    ``peaks`` holds one peak magnitude per vector, rows first (``[n]`` or ``[n, layers]``).
    """
    import numpy as np

    if not peaks.shape[0] or (peaks.max() < spec.exponent_mask and peaks.min() > 0):
        return None, None  # the usual case, settled on the small array of peaks
    per_row = peaks.reshape(peaks.shape[0], -1)
    nonfinite = (per_row >= spec.exponent_mask).any(axis=1)
    zero = (per_row == 0).any(axis=1)  # -0.0 counts as zero
    return _first(np.flatnonzero(nonfinite)), _first(np.flatnonzero(zero))


def value_error(
    peaks: np.ndarray,
    spec: DtypeSpec,
    *,
    name: str,
    start: int = 0,
    sample_id: str | None,
    rid: str | None,
) -> DumpValidationError | None:
    """The error for the first bad row of tensor ``name`` (rows from token ``start``), if any."""
    bad, zero = _bad_rows(peaks, spec)
    if bad is not None:
        return NonFiniteValues(
            f"{name} has NaN or Inf at token {start + bad}. The server produced non-finite "
            "activations (check the model's dtype and weights).",
            sample_id=sample_id,
            rid=rid,
        )
    if zero is not None:
        return DegenerateValues(
            f"{name} is all zeros at token {start + zero}: the server did not fill this row "
            "(a capture bug, e.g. an unsupported model or padding).",
            sample_id=sample_id,
            rid=rid,
        )
    return None


def _first(hits: np.ndarray) -> int | None:
    return int(hits[0]) if hits.size else None
