"""Turning a published dump into verified :class:`~hsdump.HiddenStates` (torch tensors)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from hsdump._client.validate import Expected, read_checked, validate_meta
from hsdump._protocol import AUX_FILE, FINAL_FILE, open_dump_dir, read_meta
from hsdump._types import HiddenStates

if TYPE_CHECKING:
    import torch

    from hsdump._types import Sample

__all__ = ["load_dump", "to_torch"]


def to_torch(array: np.ndarray, dtype: str) -> torch.Tensor:
    """View an array as a torch tensor of protocol dtype ``dtype`` without copying.

    bf16 arrives as ``uint16`` bits (numpy has no bfloat16) and is reinterpreted in place.
    """
    import torch

    tensor = torch.from_numpy(array)
    return tensor.view(torch.bfloat16) if dtype == "bfloat16" else tensor


def load_dump(path: Path, *, sample: Sample, rid: str, expected: Expected) -> HiddenStates:
    """Read the dump at ``path``, check it belongs to ``sample`` (sent as ``rid``), and load it.

    The directory is opened without following a link and every file is read relative to it, so a
    dump that is a link or holds one is refused (DumpValidationError), never read.
    """
    with open_dump_dir(path, sample_id=sample.id, rid=rid) as dir_fd:
        return _load(path, dir_fd, sample=sample, rid=rid, expected=expected)


def _load(path: Path, dir_fd: int, *, sample: Sample, rid: str, expected: Expected) -> HiddenStates:
    import torch

    meta = read_meta(path, sample_id=sample.id, dir_fd=dir_fd)
    validate_meta(
        meta, path, rid=rid, input_ids=sample.input_ids, sample_id=sample.id, expected=expected
    )
    context: dict[str, Any] = {"sample_id": sample.id, "rid": rid, "dir_fd": dir_fd}
    aux = read_checked(path / AUX_FILE, meta.aux_shape, meta.dtype, "aux_hidden_states", **context)
    final = read_checked(
        path / FINAL_FILE, meta.final_shape, meta.dtype, "final_hidden_state", **context
    )
    expected.remember(meta)  # only now: a refused dump must not set what the next are held to
    mask = None if sample.loss_mask is None else torch.tensor(sample.loss_mask, dtype=torch.uint8)
    return HiddenStates(
        sample_id=sample.id,
        input_ids=torch.tensor(meta.input_ids, dtype=torch.int64),
        aux_hidden_states=to_torch(aux, meta.dtype),
        final_hidden_state=to_torch(final, meta.dtype),
        layer_ids=list(meta.layer_ids),
        loss_mask=mask,
        meta=meta,
    )
