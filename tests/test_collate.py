"""The trainers' batches straight from a store: shapes, values and refusals.

That these are each trainer's own batches, bit for bit, is checked against the real packages in
tests/interop (`nox -s interop`); here the layout is checked against the stored samples.
"""

from __future__ import annotations

import pickle
from pathlib import Path

import pytest
import torch
from store_crash_writer import make_sample

from hsdump import (
    ConfigError,
    DumpMeta,
    ExportError,
    HiddenStateDataset,
    HiddenStates,
    InputError,
    ProducerInfo,
    SpecForgeCollate,
    SpeculatorsCollate,
    open_store,
)

SAMPLES = [1, 2, 3, 0]  # 98, 195, 292 and 1 tokens; s0 has no loss mask


def _store(path: Path, final_norm: str | None, layers: list[int] | None = None) -> Path:
    with open_store(path, "a") as store:
        for i in SAMPLES:
            hs = make_sample(i, layers=layers)
            store.write(_with_norm(hs, final_norm) if final_norm else hs)
    return path


def _with_norm(hs: HiddenStates, final_norm: str) -> HiddenStates:
    t, k, h = hs.aux_hidden_states.shape
    hs.meta = DumpMeta(
        rid=f"r-{hs.sample_id}", input_ids=hs.input_ids.tolist(), num_tokens=t,
        layer_ids=hs.layer_ids, final_norm=final_norm,  # type: ignore[arg-type]
        hidden_size=h, dtype="bfloat16", aux_shape=(t, k, h), final_shape=(t, h),
        producer=ProducerInfo(name="test", version="1"),
    )  # fmt: skip
    return hs


@pytest.fixture(scope="module")
def post_norm(tmp_path_factory: pytest.TempPathFactory) -> HiddenStateDataset:
    path = _store(tmp_path_factory.mktemp("post") / "s.zarr", "post_norm")
    return HiddenStateDataset(path, sample_ids=[f"s{i}" for i in SAMPLES])


@pytest.fixture(scope="module")
def pre_norm(tmp_path_factory: pytest.TempPathFactory) -> HiddenStateDataset:
    path = _store(tmp_path_factory.mktemp("pre") / "s.zarr", "pre_norm")
    return HiddenStateDataset(path, sample_ids=[f"s{i}" for i in SAMPLES])


def _mask(hs: HiddenStates) -> torch.Tensor:
    return hs.loss_mask.long() if hs.loss_mask is not None else torch.ones(hs.num_tokens).long()


def test_specforge_batches_are_padded_truncated_and_end_each_loss_mask_with_zero(
    post_norm: HiddenStateDataset,
) -> None:
    collate = SpecForgeCollate(post_norm, max_len=200)
    batch = collate([post_norm[i] for i in range(4)])
    assert collate.layer_ids == [1, 4, 6]  # SGLang's ids
    assert batch["hidden_state"].shape == (4, 200, 3 * 32) and batch["target"].shape == (4, 200, 32)
    for row, i in enumerate(SAMPLES):
        hs, n = make_sample(i), min(make_sample(i).num_tokens, 200)
        want_mask = _mask(hs)[:n].clone()
        want_mask[-1] = 0
        assert torch.equal(batch["input_ids"][row, :n], hs.input_ids[:n])
        assert torch.equal(batch["loss_mask"][row, :n], want_mask)
        assert torch.equal(batch["attention_mask"][row], (torch.arange(200) < n).long())
        assert torch.equal(batch["hidden_state"][row, :n], hs.aux_hidden_states[:n].flatten(1))
        assert torch.equal(batch["target"][row, :n], hs.final_hidden_state[:n])
        assert not batch["hidden_state"][row, n:].any() and not batch["loss_mask"][row, n:].any()
    assert all(v.dtype == torch.int64 for k, v in batch.items() if k.endswith(("ids", "mask")))


def test_speculators_batches_pack_shifted_items_and_cut_the_one_at_the_end(
    pre_norm: HiddenStateDataset,
) -> None:
    collate = SpeculatorsCollate(pre_norm, total_seq_len=400)
    batch = collate([pre_norm[i] for i in range(4)])  # 97 + 194 rows, then 109 of 291: full
    assert collate.layer_ids == [2, 5, 7] and batch["error_records"] == 0
    assert batch["hidden_states"].shape == (1, 400, 3 * 32)
    offset = 0
    for doc, (i, rows) in enumerate(zip(SAMPLES[:3], [97, 194, 109], strict=True)):
        hs, at = make_sample(i), slice(offset, offset + rows)
        assert torch.equal(batch["input_ids"][0, at], hs.input_ids[1 : 1 + rows])
        assert torch.equal(batch["hidden_states"][0, at], hs.aux_hidden_states[:rows].flatten(1))
        assert torch.equal(
            batch["verifier_last_hidden_states"][0, at], hs.final_hidden_state[1 : 1 + rows]
        )
        assert torch.equal(batch["loss_mask"][0, at], _mask(hs)[1 : 1 + rows])
        assert torch.equal(batch["position_ids"][0, at], torch.arange(1, 1 + rows))
        assert (batch["document_ids"][0, at] == doc).all()
        offset += rows
    assert offset == 400


def test_speculators_padding_has_document_id_minus_one(pre_norm: HiddenStateDataset) -> None:
    batch = SpeculatorsCollate(pre_norm, total_seq_len=120)([pre_norm[0], pre_norm[3]])
    assert torch.equal(batch["document_ids"][0], torch.tensor([0] * 97 + [-1] * 23))
    assert not batch["hidden_states"][0, 97:].any() and not batch["input_ids"][0, 97:].any()


def test_specforge_refuses_a_pre_norm_store_naming_the_setting(
    pre_norm: HiddenStateDataset,
) -> None:
    with pytest.raises(ExportError, match=r"only lm_head.*pre-norm.*HSDUMP_FINAL_NORM=post_norm"):
        SpecForgeCollate(pre_norm)


def test_speculators_refuses_a_post_norm_store_naming_the_setting(
    post_norm: HiddenStateDataset,
) -> None:
    with pytest.raises(ExportError, match=r"verifier's norm.*HSDUMP_FINAL_NORM=pre_norm"):
        SpeculatorsCollate(post_norm, total_seq_len=8)


def test_a_store_without_a_record_needs_final_norm(tmp_path: Path) -> None:
    dataset = HiddenStateDataset(_store(tmp_path / "s.zarr", None))
    with pytest.raises(ExportError, match=r"does not record whether its final state"):
        SpeculatorsCollate(dataset, total_seq_len=64)
    assert SpeculatorsCollate(dataset, total_seq_len=64, final_norm="pre_norm").layer_ids
    with pytest.raises(ExportError, match=r"only lm_head"):
        SpecForgeCollate(dataset, final_norm="pre_norm")


def test_specforge_needs_three_aux_layers(tmp_path: Path) -> None:
    dataset = HiddenStateDataset(_store(tmp_path / "s.zarr", "post_norm", layers=[2, 5]))
    with pytest.raises(ExportError, match=r"three aux layers.*holds 2"):
        SpecForgeCollate(dataset)


def test_bad_sizes_empty_batches_and_empty_stores_are_refused(
    post_norm: HiddenStateDataset, pre_norm: HiddenStateDataset, tmp_path: Path
) -> None:
    with pytest.raises(ConfigError, match="max_len must be a positive int, got 0"):
        SpecForgeCollate(post_norm, max_len=0)
    with pytest.raises(ConfigError, match="total_seq_len must be a positive int, got 0"):
        SpeculatorsCollate(pre_norm, total_seq_len=0)
    with pytest.raises(InputError, match="SpeculatorsCollate got an empty batch"):
        SpeculatorsCollate(pre_norm, total_seq_len=8)([])
    open_store(tmp_path / "empty.zarr", "a").close()
    with pytest.raises(InputError, match="holds no committed sample"):
        SpecForgeCollate(HiddenStateDataset(tmp_path / "empty.zarr"))


def test_collates_pickle_for_spawned_workers(pre_norm: HiddenStateDataset) -> None:
    collate = pickle.loads(pickle.dumps(SpeculatorsCollate(pre_norm, total_seq_len=64)))
    assert collate([pre_norm[0]])["input_ids"].shape == (1, 64)
