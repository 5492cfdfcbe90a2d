"""HiddenStateDataset: random access to committed samples, in DataLoader workers too."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from store_crash_writer import make_sample
from torch.utils.data import DataLoader

from hsdump import HiddenStateDataset, SampleNotFoundError, open_store


@pytest.fixture
def store_path(tmp_path: Path) -> Path:
    path = tmp_path / "s.zarr"
    with open_store(path, "a", shard_tokens=128, chunk_tokens=16) as store:
        for i in range(10):
            store.write(make_sample(i))
    return path


def _assert_item(item: dict[str, torch.Tensor], i: int) -> None:
    want = make_sample(i)
    assert torch.equal(
        item["aux_hidden_states"].view(torch.int16), want.aux_hidden_states.view(torch.int16)
    )
    assert torch.equal(
        item["final_hidden_state"].view(torch.int16), want.final_hidden_state.view(torch.int16)
    )
    assert torch.equal(item["input_ids"], want.input_ids)
    mask = (
        want.loss_mask
        if want.loss_mask is not None
        else torch.ones(want.num_tokens, dtype=torch.uint8)
    )
    assert torch.equal(item["loss_mask"], mask)


def test_items_hold_the_stored_tensors_and_lengths_match(store_path: Path) -> None:
    ds = HiddenStateDataset(store_path)
    assert len(ds) == 10 and sorted(ds.sample_ids) == sorted(f"s{i}" for i in range(10))
    for k, sid in enumerate(ds.sample_ids):
        item = ds[k]
        _assert_item(item, int(sid[1:]))
        assert ds.lengths[k] == item["input_ids"].shape[0]


def test_dataloader_with_two_forked_workers_returns_every_sample_once(store_path: Path) -> None:
    ds = HiddenStateDataset(store_path, sample_ids=[f"s{i}" for i in range(10)])
    loader = DataLoader(
        ds, batch_size=None, shuffle=True, num_workers=2, multiprocessing_context="fork"
    )
    by_ids = {tuple(make_sample(k).input_ids.tolist()): k for k in range(10)}
    seen = []
    for item in loader:
        i = by_ids[tuple(item["input_ids"].tolist())]
        _assert_item(item, i)
        seen.append(i)
    assert sorted(seen) == list(range(10))


def test_requesting_uncommitted_ids_is_refused(store_path: Path) -> None:
    with pytest.raises(SampleNotFoundError, match="'s99'"):
        HiddenStateDataset(store_path, sample_ids=["s1", "s99"])
