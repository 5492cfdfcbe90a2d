"""Padded batches and the length-bucketed sampler, on a real store through DataLoader."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from store_crash_writer import make_sample
from torch.utils.data import DataLoader

from hsdump import (
    ConfigError,
    HiddenStateDataset,
    LengthBucketSampler,
    open_store,
    pad_collate,
)

N = 40


@pytest.fixture(scope="module")
def store_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("batching") / "s.zarr"
    with open_store(path, "a", shard_tokens=512, chunk_tokens=16) as store:
        for i in range(N):
            store.write(make_sample(i))
    return path


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16)


def _check_batch(batch: dict[str, torch.Tensor]) -> list[int]:
    """Assert a padded batch holds its samples then zeros; return the samples' numbers."""
    by_ids = {tuple(make_sample(i).input_ids.tolist()): i for i in range(N)}
    t = batch["input_ids"].shape[1]
    assert int(batch["lengths"].max()) == t
    found = []
    for row, n in enumerate(batch["lengths"].tolist()):
        i = by_ids[tuple(batch["input_ids"][row, :n].tolist())]
        want = make_sample(i)
        mask = want.loss_mask if want.loss_mask is not None else torch.ones(n, dtype=torch.uint8)
        assert torch.equal(batch["loss_mask"][row, :n], mask)
        assert torch.equal(
            _bits(batch["aux_hidden_states"][row, :n]), _bits(want.aux_hidden_states)
        )
        assert torch.equal(
            _bits(batch["final_hidden_state"][row, :n]), _bits(want.final_hidden_state)
        )
        assert batch["attention_mask"][row].tolist() == [1] * n + [0] * (t - n)
        for key in ("input_ids", "loss_mask", "aux_hidden_states", "final_hidden_state"):
            assert not batch[key][row, n:].any(), f"{key} is not zero in padding"
        found.append(i)
    return found


@pytest.mark.parametrize("workers", [0, 2])
def test_batches_of_four_are_padded_to_their_longest_sample(store_path: Path, workers: int) -> None:
    ds = HiddenStateDataset(store_path)
    loader = DataLoader(
        ds,
        batch_size=4,
        collate_fn=pad_collate,
        num_workers=workers,
        multiprocessing_context="fork" if workers else None,
    )
    seen: list[int] = []
    for batch in loader:
        b, t = batch["input_ids"].shape
        assert batch["aux_hidden_states"].shape == (b, t, 3, 32)
        assert batch["final_hidden_state"].shape == (b, t, 32)
        assert batch["aux_hidden_states"].dtype == torch.bfloat16
        seen += _check_batch(batch)
    assert sorted(seen) == list(range(N))


@pytest.mark.parametrize("workers", [0, 2])
def test_bucketed_batches_cover_every_sample_once_and_pad_less_than_random_ones(
    store_path: Path, workers: int
) -> None:
    ds = HiddenStateDataset(store_path)
    sampler = LengthBucketSampler(ds, batch_size=4, seed=3)
    loader = DataLoader(
        ds,
        batch_sampler=sampler,
        collate_fn=pad_collate,
        num_workers=workers,
        multiprocessing_context="fork" if workers else None,
    )
    seen = [i for batch in loader for i in _check_batch(batch)]
    assert sorted(seen) == list(range(N)) and len(loader) == len(sampler) == N // 4

    lengths = np.array(ds.lengths)
    batches = list(sampler)
    real = sum(int(lengths[b].sum()) for b in batches)
    padded = sum(len(b) * int(lengths[b].max()) for b in batches)
    assert sampler.padding_fraction() == pytest.approx(1 - real / padded)
    shuffled = np.random.default_rng(0).permutation(N).reshape(-1, 4)
    random_padded = sum(4 * int(lengths[b].max()) for b in shuffled)
    assert sampler.padding_fraction() < (1 - real / random_padded) / 2


def test_ranks_get_disjoint_batches_of_equal_count_deterministic_per_seed_and_epoch(
    store_path: Path,
) -> None:
    ds = HiddenStateDataset(store_path)

    def plan(rank: int, epoch: int, seed: int = 7) -> list[list[int]]:
        sampler = LengthBucketSampler(ds, batch_size=3, seed=seed, rank=rank, world_size=3)
        sampler.set_epoch(epoch)
        return list(sampler)

    ranks = [plan(r, epoch=0) for r in range(3)]
    assert len({len(batches) for batches in ranks}) == 1
    flat = [i for batches in ranks for b in batches for i in b]
    assert len(flat) == len(set(flat))
    assert len(flat) > N - 3  # at most world_size - 1 samples are left out
    assert plan(1, epoch=0) == ranks[1]
    assert plan(1, epoch=1) != ranks[1]
    assert plan(1, epoch=0, seed=8) != ranks[1]


def test_a_token_budget_bounds_every_padded_batch(store_path: Path) -> None:
    ds = HiddenStateDataset(store_path)
    budget = 2 * max(ds.lengths)
    sampler = LengthBucketSampler(ds, max_tokens=budget, rank=0, world_size=2)
    loader = DataLoader(ds, batch_sampler=sampler, collate_fn=pad_collate)
    sizes = []
    for batch in loader:
        assert batch["input_ids"].numel() <= budget
        sizes.append(batch["input_ids"].shape[0])
    assert len(sizes) == len(sampler) and max(sizes) > 2  # short samples share a batch


def test_a_sample_longer_than_the_token_budget_is_refused_naming_it(store_path: Path) -> None:
    ds = HiddenStateDataset(store_path)
    longest = int(np.argmax(ds.lengths))
    with pytest.raises(ConfigError, match=rf"index {longest} has {max(ds.lengths)} tokens"):
        LengthBucketSampler(ds, max_tokens=max(ds.lengths) - 1)
