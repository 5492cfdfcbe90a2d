"""Reading a published dump: the one read path, and turning it into `HiddenStates`.

`read_dump` is how every dump is read (the client's `load_dump` goes through it): the
directory opened without following a link, its markers and ``meta.json`` checked, then each tensor
file mapped copy-on-write (read into fresh memory where it cannot be) with its size and values
checked (`read_checked`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from hsdump._client.dumpfiles import read_checked
from hsdump._client.validate import Expected, validate_meta
from hsdump._protocol import (
    AUX_FILE,
    FINAL_FILE,
    MOMENTS_FILE,
    REQ_PREFIX,
    DumpMeta,
    dtype_spec,
    moments_error,
    open_dump_dir,
    read_meta,
    spot_rows,
)
from hsdump._types import HiddenStates

if TYPE_CHECKING:
    import os

    import torch

    from hsdump._types import Sample

__all__ = ["Dump", "load_dump", "read_dump", "to_torch"]


@dataclass(frozen=True)
class Dump:
    """A published dump as read and checked: ``aux [T, K, H]`` and ``final [T, H]``.

    The arrays hold the values' raw bits (``meta.dtype``'s
    `bits`); `to_torch` views them as floats. ``moments`` is ``moments.bin`` (float32
    ``[T, K + 1, 2]``), spot-checked against the values, when it was read.
    """

    path: Path
    meta: DumpMeta
    aux: np.ndarray
    final: np.ndarray
    moments: np.ndarray | None = None

    def states(
        self, sample_id: str, loss_mask: torch.Tensor | None = None, *, values_checked: bool = True
    ) -> HiddenStates:
        """The dump as `HiddenStates`, its tensors views of the dump's files."""
        import torch

        meta = self.meta
        return HiddenStates(
            sample_id=sample_id,
            input_ids=torch.tensor(meta.input_ids, dtype=torch.int64),
            aux_hidden_states=to_torch(self.aux, meta.dtype),
            final_hidden_state=to_torch(self.final, meta.dtype),
            layer_ids=list(meta.layer_ids),
            loss_mask=loss_mask,
            meta=meta,
            values_checked=values_checked,
            row_moments=None if self.moments is None else torch.from_numpy(self.moments),
        )


def to_torch(bits: np.ndarray, dtype: str) -> torch.Tensor:
    """View an array of raw bits as a torch tensor of protocol dtype ``dtype`` without copying."""
    return dtype_spec(dtype).tensor_of(bits)


def read_dump(
    path: str | os.PathLike[str],
    *,
    sample_id: str | None = None,
    rid: str | None = None,
    check: Callable[[DumpMeta], None] | None = None,
    check_values: bool = True,
    moments: bool = False,
) -> Dump:
    """Read the published dump at ``path`` and check its files and values.

    Args:
        path: The dump's directory (``req_<rid>``).
        sample_id: Named in errors.
        rid: The request id (named in errors); by default the directory's.
        check: Called with the metadata before any tensor is read; raises to refuse the dump.
        check_values: Check the values (finite, no vector all zeros) as they are read; False
            leaves that to the caller (a store's placement, `HiddenStates.values_checked`).
        moments: Read ``moments.bin`` too (the producer announced ``row_moments``) and check it
            against the values of a few rows (`hsdump._protocol.spot_rows`).

    Raises:
        DumpFailed: The producer published an ``error`` marker.
        DumpValidationError: The dump is incomplete, a link or holds one, its metadata is malformed,
            a file's size differs from its shape, or a value is non-finite or a row all zeros.
        MomentsMismatch: ``moments.bin`` does not describe the dump's values.
    """
    path = Path(path)
    rid = rid or path.name.removeprefix(REQ_PREFIX)
    with open_dump_dir(path, sample_id=sample_id, rid=rid) as dir_fd:
        meta = read_meta(path, sample_id=sample_id, dir_fd=dir_fd)
        if check is not None:
            check(meta)
        context: dict[str, Any] = {
            "sample_id": sample_id,
            "rid": rid,
            "dir_fd": dir_fd,
            "check_values": check_values,
        }
        aux = read_checked(
            path / AUX_FILE, meta.aux_shape, meta.dtype, "aux_hidden_states", **context
        )
        final = read_checked(
            path / FINAL_FILE,
            meta.final_shape,
            meta.dtype,
            "final_hidden_state",
            **context,
        )
        declared = _read_moments(path, meta, aux, final, context) if moments else None
    return Dump(path=path, meta=meta, aux=aux, final=final, moments=declared)


def _read_moments(
    path: Path, meta: DumpMeta, aux: np.ndarray, final: np.ndarray, context: dict[str, Any]
) -> np.ndarray:
    """``moments.bin``, read into fresh memory (64 bytes a token), checked on a few rows."""
    shape = (meta.num_tokens, len(meta.layer_ids) + 1, 2)
    context = {**context, "check_values": False}
    bits = read_checked(path / MOMENTS_FILE, shape, "float32", "moments", **context)
    declared = np.array(bits.view(np.float32))  # a private copy: the mapping goes with the dump
    rows = spot_rows(meta.num_tokens)
    error = moments_error(
        declared,
        aux,
        final,
        meta.dtype,
        rows,
        layer_ids=meta.layer_ids,
        sample_id=context["sample_id"],
        rid=context["rid"],
    )
    if error is not None:
        raise error
    return declared


def load_dump(
    path: Path, *, sample: Sample, rid: str, expected: Expected, check_values: bool = True
) -> HiddenStates:
    """Read the dump at ``path``, check it belongs to ``sample`` (sent as ``rid``), and load it.

    With ``check_values`` False the values are left unchecked (`HiddenStates.values_checked`);
    that is only allowed when ``expected`` is complete (it learns nothing from such a dump).

    The directory is opened without following a link and every file is read relative to it, so a
    dump that is a link or holds one is refused (DumpValidationError), never read.
    """
    import torch

    def belongs(meta: DumpMeta) -> None:
        validate_meta(
            meta, path, rid=rid, input_ids=sample.input_ids, sample_id=sample.id, expected=expected
        )

    if not (check_values or expected.complete):
        raise ValueError("a dump's values may go unchecked only against complete expectations")
    dump = read_dump(
        path,
        sample_id=sample.id,
        rid=rid,
        check=belongs,
        check_values=check_values,
        moments=expected.row_moments,
    )
    expected.remember(dump.meta)  # only now: a refused dump must not set what the next are held to
    mask = None if sample.loss_mask is None else torch.tensor(sample.loss_mask, dtype=torch.uint8)
    return dump.states(sample.id, mask, values_checked=check_values)
