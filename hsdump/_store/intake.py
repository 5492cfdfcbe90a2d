"""What a sample must be to be written: its tensors' shapes and dtypes, token ids that fit the
store's int32, and the producer's row moments."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from hsdump._exceptions import InputError
from hsdump._store.codecs import torch_dtype_name

if TYPE_CHECKING:
    from hsdump._types import HiddenStates

__all__ = ["check_tensors", "ids_int32", "moments_of"]


def check_tensors(hs: HiddenStates) -> str:
    aux, final, ids = hs.aux_hidden_states, hs.final_hidden_state, hs.input_ids
    t = int(ids.shape[0]) if ids.dim() == 1 else -1
    k = len(hs.layer_ids)
    if ids.dim() != 1 or t == 0 or aux.dim() != 3 or final.dim() != 2:
        raise InputError(
            f"expected input_ids [T], aux [T, K, H] and final [T, H], found {tuple(ids.shape)}, "
            f"{tuple(aux.shape)} and {tuple(final.shape)}",
            sample_id=hs.sample_id,
        )
    h = int(final.shape[1])
    if tuple(aux.shape) != (t, k, h) or int(final.shape[0]) != t:
        raise InputError(
            f"shapes do not fit: input_ids has T={t}, layer_ids K={k}, final H={h}, so aux must "
            f"be {(t, k, h)} and final {(t, h)}; found {tuple(aux.shape)} and {tuple(final.shape)}",
            sample_id=hs.sample_id,
        )
    if hs.loss_mask is not None and tuple(hs.loss_mask.shape) != (t,):
        raise InputError(
            f"loss_mask must be [{t}], found {tuple(hs.loss_mask.shape)}", sample_id=hs.sample_id
        )
    dtype = torch_dtype_name(aux)
    if final.dtype != aux.dtype:
        raise InputError(
            f"aux is {aux.dtype} but final is {final.dtype}: they must match",
            sample_id=hs.sample_id,
        )
    return dtype


def moments_of(hs: HiddenStates, layers: int) -> np.ndarray | None:
    """``hs.row_moments`` as a float32 array ``[T, layers, 2]``, or None when not given."""
    given = hs.row_moments
    if given is None:
        return None
    shape = (hs.num_tokens, layers, 2)
    if tuple(given.shape) != shape:
        raise InputError(
            f"row_moments must be {shape} (a sum and a sum of squares per vector), found "
            f"{tuple(given.shape)}",
            sample_id=hs.sample_id,
        )
    return np.ascontiguousarray(given.detach().cpu().numpy(), dtype=np.float32)


def ids_int32(hs: HiddenStates) -> np.ndarray:
    ids = hs.input_ids.detach().cpu().numpy()
    if ids.size and (ids.min() < 0 or ids.max() > np.iinfo(np.int32).max):
        raise InputError(
            "input_ids must be in [0, 2**31): token ids are stored as int32", sample_id=hs.sample_id
        )
    return np.ascontiguousarray(ids, dtype=np.int32)
