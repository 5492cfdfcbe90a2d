"""Always-on checks that a response and a dump belong to the sample and hold usable values.

Every check raises its own :class:`~hsdump.DumpValidationError` subclass naming the sample, the
request, what was expected and what was found. The value checks read the bf16/fp16 bits directly
(no conversion) in cache-sized blocks, so they cost one pass over the dump.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from hsdump._exceptions import (
    DegenerateValues,
    DtypeMismatch,
    LayerMismatch,
    NonFiniteValues,
    RidMismatch,
    ServerResponseError,
    ShapeMismatch,
    TokenMismatch,
)
from hsdump._protocol import Dump, DumpMeta

__all__ = ["Expected", "check_response", "copy_checked", "validate_meta"]

# Exponent masks of the 16-bit float formats: all ones means Inf or NaN.
_EXP_MASK = {"bfloat16": 0x7F80, "float16": 0x7C00}
_BLOCK_BYTES = 1 << 23  # as fast as 2 MiB blocks here, with 4x fewer GIL hand-offs


@dataclass
class Expected:
    """What every dump of a run must agree on; unset fields are learnt from the first dump."""

    layer_ids: list[int] | None = None
    hidden_size: int | None = None
    dtype: str | None = None
    final_norm: str | None = None

    def check(self, meta: DumpMeta, sample_id: str) -> None:
        """Compare ``meta`` with what is expected, then remember anything that was unset."""
        if self.layer_ids is not None and meta.layer_ids != self.layer_ids:
            raise LayerMismatch(
                f"the dump holds layers {meta.layer_ids}, expected {self.layer_ids}. The server's "
                "capture layers changed or differ from what you asked for.",
                sample_id=sample_id,
                rid=meta.rid,
            )
        for name, cls in (("hidden_size", ShapeMismatch), ("dtype", DtypeMismatch)):
            want, got = getattr(self, name), getattr(meta, name)
            if want is not None and want != got:
                raise cls(
                    f"{name} is {got!r}, expected {want!r} like the run's earlier dumps",
                    sample_id=sample_id,
                    rid=meta.rid,
                )
        self.layer_ids = self.layer_ids or list(meta.layer_ids)
        self.hidden_size = self.hidden_size or meta.hidden_size
        self.dtype = self.dtype or meta.dtype
        self.final_norm = self.final_norm or meta.final_norm


def check_response(body: Any, *, rid: str, num_tokens: int, sample_id: str) -> None:
    """Check SGLang's ``/generate`` response for a prefill-only request."""
    meta = body.get("meta_info") if isinstance(body, dict) else None
    if not isinstance(meta, dict):
        raise ServerResponseError(
            f"the response has no meta_info: {str(body)[:200]}", sample_id=sample_id, rid=rid
        )
    if meta.get("id") != rid:
        raise RidMismatch(
            f"the response is for request {meta.get('id')!r}, expected {rid!r}",
            sample_id=sample_id,
            rid=rid,
        )
    if meta.get("prompt_tokens") != num_tokens:
        raise TokenMismatch(
            f"the server processed {meta.get('prompt_tokens')} prompt tokens, "
            f"expected {num_tokens} "
            "(was the prompt truncated? do not run the server with --allow-auto-truncate)",
            sample_id=sample_id,
            rid=rid,
        )
    if meta.get("cached_tokens", 0):
        raise ShapeMismatch(
            f"{meta['cached_tokens']} prompt tokens came from the prefix cache, so the capture is "
            "short. Start the server with --disable-radix-cache.",
            sample_id=sample_id,
            rid=rid,
        )


def validate_meta(
    dump: Dump, *, rid: str, input_ids: Sequence[int], sample_id: str, expected: Expected
) -> None:
    """Check that ``dump`` is request ``rid``'s capture of ``input_ids`` (values: copy_checked)."""
    meta = dump.meta
    if meta.rid != rid:
        raise RidMismatch(
            f"{dump.path} holds request {meta.rid!r}, expected {rid!r}",
            sample_id=sample_id,
            rid=rid,
        )
    _check_tokens(meta.input_ids, input_ids, sample_id, rid)
    expected.check(meta, sample_id)


def _check_tokens(got: Sequence[int], sent: Sequence[int], sample_id: str, rid: str) -> None:
    if len(got) != len(sent):
        raise TokenMismatch(
            f"the dump covers {len(got)} tokens, the sample has {len(sent)}",
            sample_id=sample_id,
            rid=rid,
        )
    if list(got) != list(sent):
        pos = next(i for i, (a, b) in enumerate(zip(got, sent, strict=True)) if a != b)
        raise TokenMismatch(
            f"token {pos} of the dump is {got[pos]}, the sample sent {sent[pos]}: these hidden "
            "states belong to other input ids",
            sample_id=sample_id,
            rid=rid,
        )


def copy_checked(
    array: np.ndarray,
    dtype: str,
    name: str,
    *,
    sample_id: str | None = None,
    rid: str | None = None,
) -> np.ndarray:
    """Copy ``array`` into fresh memory, checking each block while it is in cache.

    Raises unless every value is finite and no row (or layer of a row) is all zeros. ``array`` is
    ``[T, ..., H]``; for 16-bit dtypes it holds the raw bits as ``uint16``. One pass over the
    source: the copy lets the dump's shared memory be freed at once.
    """
    out = np.empty(array.shape, array.dtype)
    rows = max(1, _BLOCK_BYTES // max(1, array[0].nbytes)) if array.size else 1
    for start in range(0, array.shape[0], rows):
        block = out[start : start + rows]
        np.copyto(block, array[start : start + rows])
        bad, zero = _scan_block(block, dtype)
        if bad is not None:
            raise NonFiniteValues(
                f"{name} has NaN or Inf at token {start + bad}. The server produced non-finite "
                "activations (check the model's dtype and weights).",
                sample_id=sample_id,
                rid=rid,
            )
        if zero is not None:
            raise DegenerateValues(
                f"{name} is all zeros at token {start + zero}: the server did not fill this row "
                "(a capture bug, e.g. an unsupported model or padding).",
                sample_id=sample_id,
                rid=rid,
            )
    return out


def _scan_block(block: np.ndarray, dtype: str) -> tuple[int | None, int | None]:
    """First row with a non-finite value, and first row with an all-zero vector, in ``block``."""
    if dtype in _EXP_MASK:
        # Without the sign bit, a 16-bit float's bits order like its magnitude, and its exponent
        # is all ones (Inf/NaN) exactly when they reach the mask: one max per vector finds both.
        peak = np.bitwise_and(block, 0x7FFF).max(axis=-1)
        nonfinite, nonzero = peak >= _EXP_MASK[dtype], peak > 0  # -0.0 counts as zero
    else:
        nonfinite = ~np.isfinite(block).all(axis=-1)
        nonzero = block.any(axis=-1)
    bad_rows = nonfinite.reshape(block.shape[0], -1).any(axis=1)
    zero_rows = ~nonzero.reshape(block.shape[0], -1).all(axis=1)
    return _first(np.asarray(bad_rows)), _first(np.asarray(zero_rows))


def _first(flags: np.ndarray) -> int | None:
    hits = np.flatnonzero(flags)
    return int(hits[0]) if hits.size else None
