"""Training batches from a hidden-state store: padding collation and a length-bucketed sampler.

Samples differ in length, so ``DataLoader(dataset, batch_size=4)`` cannot stack them. The pieces
here make batches that pad little::

    ds = hsdump.HiddenStateDataset("out.zarr")
    sampler = hsdump.LengthBucketSampler(ds, max_tokens=16_384, rank=rank, world_size=world)
    loader = DataLoader(ds, batch_sampler=sampler, collate_fn=hsdump.pad_collate, num_workers=4)
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        for batch in loader: ...
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING

import numpy as np
from torch.utils.data import Sampler

from hsdump._exceptions import ConfigError, InputError
from hsdump._training.dataset import HiddenStateDataset

if TYPE_CHECKING:
    import torch

__all__ = ["LengthBucketSampler", "pad_collate"]

# Samples sorted together, in batches: a window this many batches long pads almost as little as
# a global sort, and still mixes lengths across epochs (Hugging Face's "megabatch" uses 50).
_WINDOW_BATCHES = 50


def pad_collate(batch: Sequence[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Pad `HiddenStateDataset` items to the longest one and stack them.

    Returns a dict of ``B``-row tensors, ``T`` being the longest item's length:

    - ``input_ids``: int64 ``[B, T]`` (0 in padding)
    - ``loss_mask``: the items' dtype (uint8), ``[B, T]``, 0 in padding
    - ``attention_mask``: int64 ``[B, T]``, 1 on real tokens, 0 in padding
    - ``aux_hidden_states``: ``[B, T, K, H]`` and ``final_hidden_state``: ``[B, T, H]`` in the
      stored dtype, zero in padding
    - ``lengths``: int64 ``[B]``, each item's token count

    Raises:
        InputError: The batch is empty, or its items disagree on K, H or dtype.
    """
    import torch

    if not batch:
        raise InputError("pad_collate got an empty batch: the sampler yielded no indices")
    first = batch[0]
    aux0 = first["aux_hidden_states"]
    lengths = [int(item["input_ids"].shape[0]) for item in batch]
    b, t = len(batch), max(lengths)
    out = {
        "input_ids": torch.zeros(b, t, dtype=torch.int64),
        "loss_mask": torch.zeros(b, t, dtype=first["loss_mask"].dtype),
        "attention_mask": torch.zeros(b, t, dtype=torch.int64),
        "aux_hidden_states": torch.zeros(b, t, *aux0.shape[1:], dtype=aux0.dtype),
        "final_hidden_state": torch.zeros(b, t, aux0.shape[-1], dtype=aux0.dtype),
    }
    for row, (item, n) in enumerate(zip(batch, lengths, strict=True)):
        aux = item["aux_hidden_states"]
        if aux.shape[1:] != aux0.shape[1:] or aux.dtype != aux0.dtype:
            raise InputError(
                f"batch item {row} has aux states [T, K, H] = {tuple(aux.shape)} {aux.dtype}, "
                f"item 0 has {tuple(aux0.shape)} {aux0.dtype}: batch samples of one store only"
            )
        out["input_ids"][row, :n] = item["input_ids"]
        out["loss_mask"][row, :n] = item["loss_mask"]
        out["attention_mask"][row, :n] = 1
        out["aux_hidden_states"][row, :n] = aux
        out["final_hidden_state"][row, :n] = item["final_hidden_state"]
    out["lengths"] = torch.tensor(lengths, dtype=torch.int64)
    return out


class LengthBucketSampler(Sampler[list[int]]):
    """Batches of dataset indices of similar length, split across distributed ranks.

    Each epoch the indices are shuffled (seeded by ``seed`` and the epoch), cut into windows of
    about 50 batches, sorted by length within each window and cut into batches; the batches are
    shuffled again and dealt to the ranks in turn. Every rank computes the same plan, so ranks
    get disjoint batches and the same number of them. When the batch count does not divide by
    ``world_size``, the last batches are halved until it does (with ``drop_last``, they are left
    out); the few samples that still do not fit (fewer than ``world_size``) are left out of that
    epoch.

    Pass it as ``DataLoader(dataset, batch_sampler=sampler, collate_fn=pad_collate)`` and call
    `set_epoch` before each epoch.

    Args:
        lengths: Token count of each dataset index: a `HiddenStateDataset` (its
            ``lengths``, read from ``store.lengths()``) or a sequence of ints.
        batch_size: Samples per batch (a cap when ``max_tokens`` is set too).
        max_tokens: Token budget per batch: samples times the longest sample's length, that is
            the padded ``[B, T]`` size, stays at or under it.
        shuffle: Shuffle per epoch; without it, batches come in order of length.
        seed: Seed of the shuffle; the same seed and epoch give the same batches.
        drop_last: Leave out a short final batch (with a fixed ``batch_size``), and the batches
            that do not divide among the ranks.
        rank: This process's rank (default: torch.distributed's, or 0).
        world_size: The number of ranks (default: torch.distributed's, or 1).

    Raises:
        ConfigError: Neither ``batch_size`` nor ``max_tokens`` is given, a value is out of range,
            a sample is longer than ``max_tokens``, or there are fewer samples than ranks.
    """

    def __init__(
        self,
        lengths: HiddenStateDataset | Sequence[int],
        *,
        batch_size: int | None = None,
        max_tokens: int | None = None,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
        rank: int | None = None,
        world_size: int | None = None,
    ) -> None:
        values = lengths.lengths if isinstance(lengths, HiddenStateDataset) else lengths
        self._lengths = np.asarray(list(values), dtype=np.int64)
        self.batch_size, self.max_tokens = batch_size, max_tokens
        self.shuffle, self.seed, self.drop_last = shuffle, seed, drop_last
        self.rank, self.world_size = _rank_and_world(rank, world_size)
        self.epoch = 0
        self._check()
        self._plan: tuple[int, list[list[int]]] | None = None

    def _check(self) -> None:
        if self.batch_size is None and self.max_tokens is None:
            raise ConfigError("LengthBucketSampler needs batch_size, max_tokens, or both")
        for name in ("batch_size", "max_tokens"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ConfigError(f"{name} must be a positive int, got {value}")
        if not 0 <= self.rank < self.world_size:
            raise ConfigError(f"rank must be in [0, {self.world_size}), got {self.rank}")
        if len(self._lengths) < self.world_size:
            raise ConfigError(
                f"{len(self._lengths)} samples cannot give each of {self.world_size} ranks a "
                "batch: use fewer ranks or more samples"
            )
        if self.max_tokens is not None and len(self._lengths):
            longest = int(self._lengths.argmax())
            if self._lengths[longest] > self.max_tokens:
                raise ConfigError(
                    f"sample at index {longest} has {self._lengths[longest]} tokens, more than "
                    f"max_tokens={self.max_tokens}: raise max_tokens, or build the dataset "
                    "without the longest samples (HiddenStateDataset(..., sample_ids=...))"
                )

    def set_epoch(self, epoch: int) -> None:
        """Use the shuffle of ``epoch`` (call it before each epoch, on every rank)."""
        self.epoch = epoch

    def __iter__(self) -> Iterator[list[int]]:
        return iter([list(batch) for batch in self._rank_batches()])

    def __len__(self) -> int:
        return len(self._rank_batches())

    def padding_fraction(self) -> float:
        """The share of padding in this rank's ``[B, T]`` batches for the current epoch."""
        real = padded = 0
        for batch in self._rank_batches():
            lens = self._lengths[batch]
            real += int(lens.sum())
            padded += len(batch) * int(lens.max())
        return 1.0 - real / padded if padded else 0.0

    def _rank_batches(self) -> list[list[int]]:
        if self._plan is None or self._plan[0] != self.epoch:
            self._plan = (self.epoch, self._all_batches()[self.rank :: self.world_size])
        return self._plan[1]

    def _all_batches(self) -> list[list[int]]:
        rng = np.random.default_rng([self.seed, self.epoch])
        n = len(self._lengths)
        order = rng.permutation(n) if self.shuffle else np.arange(n)
        window = n if not self.shuffle else _WINDOW_BATCHES * self._samples_per_batch()
        batches: list[list[int]] = []
        for start in range(0, n, window):
            chunk = order[start : start + window]
            # A stable sort keeps the shuffled order among equal lengths.
            chunk = chunk[np.argsort(self._lengths[chunk], kind="stable")]
            batches += self._cut(chunk)
        if self.shuffle:
            batches = [batches[i] for i in rng.permutation(len(batches))]
        if self.drop_last:
            return batches[: len(batches) - len(batches) % self.world_size]
        return _deal_evenly(batches, self.world_size)

    def _samples_per_batch(self) -> int:
        if self.max_tokens is None:
            assert self.batch_size is not None
            return self.batch_size
        mean = max(1.0, float(self._lengths.mean())) if len(self._lengths) else 1.0
        fit = max(1, int(self.max_tokens // mean))
        return fit if self.batch_size is None else min(fit, self.batch_size)

    def _cut(self, chunk: np.ndarray) -> list[list[int]]:
        if self.max_tokens is None:
            assert self.batch_size is not None
            size = self.batch_size
            fixed = [chunk[i : i + size].tolist() for i in range(0, len(chunk), size)]
            return fixed[:-1] if self.drop_last and fixed and len(fixed[-1]) < size else fixed
        out: list[list[int]] = []
        current: list[int] = []
        longest, cap = 0, self.batch_size or len(chunk)
        for index in chunk.tolist():
            length = int(self._lengths[index])
            padded = max(longest, length) * (len(current) + 1)
            if current and (padded > self.max_tokens or len(current) == cap):
                out.append(current)
                current, longest = [], 0
            current.append(index)
            longest = max(longest, length)
        if current:
            out.append(current)
        return out


def _deal_evenly(batches: list[list[int]], world: int) -> list[list[int]]:
    """Make the batch count a multiple of ``world`` by halving the last batches (a half never
    pads more than the whole), leaving out what still does not fit."""
    keep = len(batches) - len(batches) % world
    tail = batches[keep:]
    while tail and len(tail) < world:
        largest = max(range(len(tail)), key=lambda i: len(tail[i]))
        if len(tail[largest]) < 2:
            break
        batch = tail.pop(largest)
        tail += [batch[: len(batch) // 2], batch[len(batch) // 2 :]]
    return batches[:keep] + (tail if len(tail) == world else [])


def _rank_and_world(rank: int | None, world_size: int | None) -> tuple[int, int]:
    if rank is None or world_size is None:
        import torch.distributed as dist

        ready = dist.is_available() and dist.is_initialized()
        if rank is None:
            rank = dist.get_rank() if ready else 0
        if world_size is None:
            world_size = dist.get_world_size() if ready else 1
    return rank, world_size
