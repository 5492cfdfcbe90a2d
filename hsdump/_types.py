"""The values users pass in and get back: `Sample` and `HiddenStates`."""

from __future__ import annotations

import operator
import reprlib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from hsdump._exceptions import InputError

if TYPE_CHECKING:
    import torch

    from hsdump._protocol import DumpMeta

__all__ = ["HiddenStates", "Sample"]


@dataclass(frozen=True)
class Sample:
    """One training sample: an ID and the token ids to run through the target model.

    Args:
        id: A unique sample ID (the key in the store).
        input_ids: The token ids, as a non-empty sequence of non-negative ints.
        loss_mask: Optional per-token mask of 0/1 (or booleans), the same length as
            ``input_ids``; any other value is an `InputError`.
    """

    id: str
    input_ids: Sequence[int]
    loss_mask: Sequence[int] | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.id, str) or not self.id:
            raise InputError(f"sample id must be a non-empty string, got {self.id!r}")
        ids = list(self.input_ids)
        if not ids:
            raise InputError("input_ids is empty: nothing to extract", sample_id=self.id)
        if not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids):
            bad = next(
                t for t in ids if not (isinstance(t, int) and not isinstance(t, bool) and t >= 0)
            )
            raise InputError(
                f"input_ids must be non-negative ints, found {bad!r}", sample_id=self.id
            )
        object.__setattr__(self, "input_ids", ids)
        if self.loss_mask is not None:
            mask = _mask_values(self.loss_mask, self.id)
            if len(mask) != len(ids):
                raise InputError(
                    f"loss_mask has {len(mask)} entries, input_ids has {len(ids)}: they must match",
                    sample_id=self.id,
                )
            object.__setattr__(self, "loss_mask", mask)


def _mask_values(values: object, sample_id: str) -> list[int]:
    """``values`` as a list of 0/1 ints; booleans count as 0/1, anything else is refused."""
    # A string iterates as characters ("010" would pass as [0, 1, 0]): refuse it as a whole.
    if isinstance(values, str | bytes | Mapping) or not isinstance(values, Iterable):
        raise InputError(
            f"loss_mask must be a list of 0/1 (one per token), found {reprlib.repr(values)}",
            sample_id=sample_id,
        )
    mask = []
    for position, value in enumerate(values):
        try:
            flag = operator.index(value)  # ints and bools; refuses 0.5 and "1" rather than round
        except TypeError:
            flag = -1
        if flag not in (0, 1):
            raise InputError(
                f"loss_mask holds {reprlib.repr(value)} at position {position}: each entry must "
                "be 0 or 1 (booleans also work)",
                sample_id=sample_id,
            )
        mask.append(flag)
    return mask


@dataclass
class HiddenStates:
    """A sample's verified hidden states, as torch tensors.

    Attributes:
        sample_id: The sample's ID.
        input_ids: int64 tensor ``[T]``, the token ids the server processed.
        aux_hidden_states: ``[T, K, H]`` in the dtype the server produced (bf16 normally).
        final_hidden_state: ``[T, H]``, the final state (see ``meta.final_norm``).
        layer_ids: The K aux layer ids (transformers ``hidden_states[i]`` convention).
        loss_mask: Optional uint8/bool tensor ``[T]``.
        meta: The dump's metadata when it came from a server, else None.
        attrs: Free-form provenance (for example, what the store recorded).
        values_checked: False when the values have not been checked yet (finite, no vector of
            all zeros): an extraction run leaves that check to the `HiddenStateStore` that writes
            them, which refuses such a sample. `HiddenStateClient.extract` always checks them.
        row_moments: Optional float32 ``[T, K + 1, 2]``: the sum and the sum of squares of each
            aux vector and then the final one, as the producer declared them (``moments.bin``,
            checked against the values on a few rows). A `HiddenStateStore` takes its per-layer
            statistics from them instead of computing them; None: it computes them.
    """

    sample_id: str
    input_ids: torch.Tensor
    aux_hidden_states: torch.Tensor
    final_hidden_state: torch.Tensor
    layer_ids: list[int]
    loss_mask: torch.Tensor | None = None
    meta: DumpMeta | None = None
    attrs: dict[str, Any] = field(default_factory=dict)
    values_checked: bool = True
    row_moments: torch.Tensor | None = None

    @property
    def num_tokens(self) -> int:
        """T, the number of tokens."""
        return int(self.input_ids.shape[0])

    @property
    def nbytes(self) -> int:
        """Bytes held by the two hidden-state tensors."""
        return sum(
            t.element_size() * t.nelement()
            for t in (self.aux_hidden_states, self.final_hidden_state)
        )
