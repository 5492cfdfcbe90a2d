"""Batches in each drafter trainer's own format, straight from a store: no export.

`SpecForgeCollate` and `SpeculatorsCollate` are ``collate_fn``s for a ``DataLoader`` over a
`HiddenStateDataset`. Each gives, bit for bit, the batch that its trainer's own loader builds
from hsdump's export of the same samples (``tests/interop`` checks this with the real packages):

- SpecForge 0.2.0: ``normalize_offline_sample`` (``specforge/algorithms/eagle3/data.py``) and
  ``DataCollatorWithPadding`` (``specforge/data/utils.py``), without sequence parallelism.
- speculators 0.9.0: ``ArrowDataset`` and ``CollateFn`` (``speculators/train/data.py``) with the
  EAGLE-3 ``shift_batch`` (``speculators/models/eagle3/data.py``) as its ``preprocess``.

Each refuses, when built, a store whose final state or layers its trainer cannot use, as the
export does (`hsdump._training.trainers`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from hsdump._exceptions import ConfigError, InputError
from hsdump._training.trainers import SpecForge, Speculators, Target, resolve_final_norm

if TYPE_CHECKING:
    import torch

    from hsdump._training.dataset import HiddenStateDataset
    from hsdump._training.trainers import FinalNorm

__all__ = ["SpecForgeCollate", "SpeculatorsCollate"]

Batch = dict[str, Any]


class SpecForgeCollate:
    """Padded batches as SpecForge's EAGLE-3 offline loader makes them.

    ``collate(items)`` truncates each `HiddenStateDataset` item to ``max_len`` tokens, pads to
    the longest and returns (``B`` items, ``T`` tokens):

    - ``input_ids``, ``attention_mask``, ``loss_mask``: int64 ``[B, T]``, 0 in padding; the
      loss mask is also 0 on each item's last token, as SpecForge sets it
    - ``hidden_state``: ``[B, T, 3H]``, the three aux layers concatenated in order
    - ``target``: ``[B, T, H]``, the final state after the model's last norm

    Hidden states keep the stored dtype. Wrap a batch in SpecForge's
    ``TrainBatch(sample_ids, "eagle3", batch, {"target_repr": "hidden_state", ...})`` for its
    training strategy's ``forward_loss``.

    Args:
        dataset: The dataset the items come from; its store must hold the post-norm final state
            and three aux layers, all >= 1.
        max_len: Tokens kept of each item (SpecForge's ``data.max_length``).
        final_norm: For a store that does not record its final state's convention: say which.

    Attributes:
        layer_ids: The aux layer ids in SpecForge's (SGLang's) convention, for
            ``model.aux_hidden_state_layer_ids``.

    Raises:
        ExportError: The store holds the pre-norm final state, other than three aux layers, or
            does not record its final state's convention and ``final_norm`` is not given.
        ConfigError: ``max_len`` is below 1.
    """

    def __init__(
        self,
        dataset: HiddenStateDataset,
        *,
        max_len: int = 2048,
        final_norm: FinalNorm | None = None,
    ) -> None:
        self.layer_ids = _checked_layer_ids(SpecForge(), dataset, final_norm)
        self.max_len = _positive("max_len", max_len)

    def __call__(self, items: Sequence[dict[str, torch.Tensor]]) -> Batch:
        import torch

        aux0 = _first_aux(items, "SpecForgeCollate")
        lengths = [min(int(item["input_ids"].shape[0]), self.max_len) for item in items]
        b, t, (k, h) = len(items), max(lengths), aux0.shape[1:]
        out = {
            "input_ids": torch.zeros(b, t, dtype=torch.int64),
            "attention_mask": torch.zeros(b, t, dtype=torch.int64),
            "loss_mask": torch.zeros(b, t, dtype=torch.int64),
            "hidden_state": torch.zeros(b, t, k * h, dtype=aux0.dtype),
            "target": torch.zeros(b, t, h, dtype=aux0.dtype),
        }
        for row, (item, n) in enumerate(zip(items, lengths, strict=True)):
            out["input_ids"][row, :n] = item["input_ids"][:n]
            out["attention_mask"][row, :n] = 1
            out["loss_mask"][row, :n] = item["loss_mask"][:n]
            out["loss_mask"][row, n - 1 : n] = 0  # SpecForge never trains on the last token
            out["hidden_state"][row, :n] = item["aux_hidden_states"][:n].reshape(n, k * h)
            out["target"][row, :n] = item["final_hidden_state"][:n]
        return out


class SpeculatorsCollate:
    """Packed batches as speculators' EAGLE-3 training loader makes them.

    ``collate(items)`` shifts each `HiddenStateDataset` item by one token (the aux states of
    token ``i`` go with token ``i + 1`` and its final state), packs the items one after another
    into ``total_seq_len`` rows (the item that crosses the end is cut, the ones after it are
    left out) and returns, each ``[1, total_seq_len, ...]`` with zeros in padding:

    - ``input_ids``: int64, the tokens ``[1:]`` of each item
    - ``hidden_states``: ``[..., K * H]``, the aux layers ``[:-1]``, concatenated in order
    - ``verifier_last_hidden_states``: ``[..., H]``, the pre-norm final state ``[1:]``
    - ``loss_mask``: int64, ``[1:]``
    - ``position_ids``: int64, ``1 .. T-1`` for each item
    - ``document_ids``: int64, the item's index in the batch, -1 in padding

    and ``error_records``: 0, as speculators' ``Trainer`` expects. Hidden states keep the stored
    dtype (speculators casts to ``--hidden-states-dtype``, bf16 by default). Batch the indices
    with speculators' ``MultipackDistributedBatchSamplerV2(total_seq_len, dataset.lengths,
    ...)`` or ``LengthBucketSampler(dataset, max_tokens=total_seq_len)``.

    Args:
        dataset: The dataset the items come from; its store must hold the pre-norm final state.
        total_seq_len: Rows per batch (speculators' ``--total-seq-len``).
        final_norm: For a store that does not record its final state's convention: say which.

    Attributes:
        layer_ids: The aux layer ids in speculators' (vLLM's) convention, for
            ``--target-layer-ids`` (which leaves out the last layer).

    Raises:
        ExportError: The store holds the post-norm final state, or does not record its final
            state's convention and ``final_norm`` is not given.
        ConfigError: ``total_seq_len`` is below 1.
    """

    def __init__(
        self,
        dataset: HiddenStateDataset,
        *,
        total_seq_len: int,
        final_norm: FinalNorm | None = None,
    ) -> None:
        self.layer_ids = _checked_layer_ids(Speculators(), dataset, final_norm)
        self.total_seq_len = _positive("total_seq_len", total_seq_len)

    def __call__(self, items: Sequence[dict[str, torch.Tensor]]) -> Batch:
        import torch

        aux0 = _first_aux(items, "SpeculatorsCollate")
        n, (k, h) = self.total_seq_len, aux0.shape[1:]
        out = {
            "input_ids": torch.zeros(n, dtype=torch.int64),
            "hidden_states": torch.zeros(n, k * h, dtype=aux0.dtype),
            "verifier_last_hidden_states": torch.zeros(n, h, dtype=aux0.dtype),
            "loss_mask": torch.zeros(n, dtype=torch.int64),
            "position_ids": torch.zeros(n, dtype=torch.int64),
            "document_ids": torch.full((n,), -1, dtype=torch.int64),
        }
        offset = 0
        for doc, item in enumerate(items):
            rows = min(int(item["input_ids"].shape[0]) - 1, n - offset)
            at, shifted = slice(offset, offset + rows), slice(1, 1 + rows)
            out["input_ids"][at] = item["input_ids"][shifted]
            out["hidden_states"][at] = item["aux_hidden_states"][:rows].reshape(rows, k * h)
            out["verifier_last_hidden_states"][at] = item["final_hidden_state"][shifted]
            out["loss_mask"][at] = item["loss_mask"][shifted]
            out["position_ids"][at] = torch.arange(1, 1 + rows)
            out["document_ids"][at] = doc
            offset += rows
            if offset == n:
                break
        batch: Batch = {key: value.unsqueeze(0) for key, value in out.items()}
        batch["error_records"] = 0
        return batch


def _checked_layer_ids(
    target: Target, dataset: HiddenStateDataset, final_norm: FinalNorm | None
) -> list[int]:
    where = str(dataset.path)
    if dataset.provenance is None:
        raise InputError(f"the store at {where} holds no committed sample: nothing to train on")
    norm = resolve_final_norm(dataset.provenance, final_norm, where)
    return target.check(dataset.provenance, norm, where)


def _positive(name: str, value: int) -> int:
    if value < 1:
        raise ConfigError(f"{name} must be a positive int, got {value}")
    return value


def _first_aux(items: Sequence[dict[str, torch.Tensor]], who: str) -> torch.Tensor:
    if not items:
        raise InputError(f"{who} got an empty batch: the sampler yielded no indices")
    return items[0]["aux_hidden_states"]
