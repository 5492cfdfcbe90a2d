"""Benchmark reading for training: a store through HiddenStateDataset against one safetensors file
per sample, both through the same torch DataLoader.

Both designs get the same synthetic bf16 samples (K=3 aux layers + final, H=1024, 1-2k tokens) in
one run. Every sample is read once per epoch, in the same shuffled order for both:

- one sample per step (``batch_size=None``), and batches of 8 from ``hsdump.LengthBucketSampler``
  padded by ``hsdump.pad_collate`` (the baseline's Dataset returns the same dict, so it gets the
  same sampler and collate);
- with ``num_workers`` 0, 2 and 4 (``persistent_workers``: each worker is started, has opened its
  handle and returned an item before the clock starts, as it has early in a long epoch);
- warm (every file of that design read into the page cache just before the epoch) and cold (the
  page cache dropped before each epoch, when it can be: root on Linux).

Each figure is the best of two epochs (one with ``--quick``); the two designs alternate, so noise
treats both alike. Rates count the hidden states delivered (aux + final, bf16, without padding);
the loop does nothing else with a batch. The baseline's Dataset copies each file's tensors out of
``load_file``'s lazy mapping only where nothing else reads them (one sample, no workers): a
worker's transfer to the main process, or ``pad_collate``, is that copy.

Run ``python benchmarks/bench_read.py`` (``--quick`` for a smaller run).
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
import warnings
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from bench_store import drop_caches, machine, samples, token_pool
from torch.utils.data import DataLoader, Dataset, get_worker_info

from hsdump import HiddenStateDataset, HiddenStates, LengthBucketSampler, open_store, pad_collate

CMD = "python benchmarks/bench_read.py"
WORKERS = (0, 2, 4)
BATCH = 8
SEED = 0
HEADER = (
    "\n| page cache | items | num_workers | store samples/s | store GB/s | safetensors samples/s "
    "| safetensors GB/s | store / safetensors |\n|---|---|---|---|---|---|---|---|"
)


class SafetensorsPerSample(Dataset[dict[str, torch.Tensor]]):
    """The baseline: one ``<sample id>.safetensors`` file per sample, read by ``load_file``."""

    def __init__(self, root: Path, sample_ids: list[str], *, copy: bool) -> None:
        self.root, self.sample_ids, self.copy = root, sample_ids, copy

    def __len__(self) -> int:
        return len(self.sample_ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        from safetensors.torch import load_file

        tensors = load_file(str(self.root / f"{self.sample_ids[i]}.safetensors"))
        # load_file maps the file lazily. A worker's transfer to the main process, or pad_collate,
        # reads the mapping; otherwise the item is copied here, or nothing would be read at all.
        if self.copy and get_worker_info() is None:
            return {k: v.clone() for k, v in tensors.items()}
        return tensors


def write_designs(root: Path, data: list[HiddenStates]) -> None:
    from safetensors.torch import save_file

    with open_store(root / "store", "w") as store:
        for hs in data:
            store.write(hs)
    (root / "st").mkdir()
    for hs in data:
        fields = {
            "input_ids": hs.input_ids,
            "loss_mask": hs.loss_mask,
            "aux_hidden_states": hs.aux_hidden_states,
            "final_hidden_state": hs.final_hidden_state,
        }
        save_file(fields, str(root / "st" / f"{hs.sample_id}.safetensors"))  # type: ignore[arg-type]
    os.sync()


def prime(path: Path) -> None:
    """Read every file under path, so the epoch starts with it in the page cache."""
    for file in path.rglob("*"):
        if file.is_file():
            with file.open("rb", buffering=0) as f:
                while f.read(8 << 20):
                    pass


def loader(ds: Dataset[Any], lengths: list[int], workers: int, batched: bool) -> DataLoader[Any]:
    """A loader whose workers stay up between epochs, started and warmed up outside the clock."""
    keep = workers > 0
    if batched:
        sampler = LengthBucketSampler(lengths, batch_size=BATCH, seed=SEED)
        out = DataLoader(
            ds,
            batch_sampler=sampler,
            collate_fn=pad_collate,
            num_workers=workers,
            persistent_workers=keep,
        )
    else:
        order = torch.Generator().manual_seed(SEED)
        out = DataLoader(
            ds,
            batch_size=None,
            shuffle=True,
            generator=order,
            num_workers=workers,
            persistent_workers=keep,
        )
    # Every worker forks, opens its handle and returns an item (2 prefetched per worker) before
    # the first timed epoch: an epoch of 37,000 samples amortises that start, these cannot.
    for i, _ in enumerate(out):
        if i + 1 >= max(1, 2 * workers):
            break
    return out


def epoch(batches: Iterable[dict[str, torch.Tensor]], batched: bool) -> tuple[float, int, int]:
    """(seconds, samples, hidden-state bytes without padding) for one pass over the loader."""
    t0 = time.perf_counter()
    n = nbytes = 0
    for b in batches:
        aux, final = b["aux_hidden_states"], b["final_hidden_state"]
        if batched:
            per_token = (aux[0, 0].numel() + final[0, 0].numel()) * aux.element_size()
            n, nbytes = n + len(b["lengths"]), nbytes + int(b["lengths"].sum()) * per_token
        else:
            n, nbytes = n + 1, nbytes + aux.nbytes + final.nbytes
    return time.perf_counter() - t0, n, nbytes


def measure(
    root: Path, ids: list[str], lengths: list[int], raw: int, cold: bool, repeats: int
) -> None:
    for batched in (False, True):
        for workers in WORKERS:
            datasets: dict[str, Dataset[Any]] = {
                "store": HiddenStateDataset(root / "store", sample_ids=ids),
                "st": SafetensorsPerSample(root / "st", ids, copy=not batched),
            }
            loaders = {k: loader(ds, lengths, workers, batched) for k, ds in datasets.items()}
            best = {"store": np.inf, "st": np.inf}
            for rep in range(repeats):
                for design in ("store", "st") if rep % 2 == 0 else ("st", "store"):
                    if cold:
                        drop_caches()
                    else:
                        prime(root / design)
                    dt, n, nbytes = epoch(loaders[design], batched)
                    assert (n, nbytes) == (len(ids), raw), f"{design} read {n} samples"
                    best[design] = min(best[design], dt)
            del loaders  # stops the workers
            mode = f"batches of {BATCH}" if batched else "one sample"
            report("cold" if cold else "warm", mode, workers, len(ids), raw, best)


def report(cache: str, mode: str, workers: int, n: int, raw: int, best: dict[str, float]) -> None:
    s, b = best["store"], best["st"]
    print(
        f"| {cache} | {mode} | {workers} | {n / s:,.0f} | {raw / s / 1e9:.2f} | {n / b:,.0f} | "
        f"{raw / b / 1e9:.2f} | {b / s:.2f} |",
        flush=True,
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer samples, one epoch per figure")
    ap.add_argument("--samples", type=int, help="samples in the run (default 96, quick 32)")
    ap.add_argument("--hidden", type=int, default=1024, help="hidden size H of the samples")
    ap.add_argument(
        "--dir", type=Path, help="where to write (default: a temp dir on the same disk as /tmp)"
    )
    args = ap.parse_args(argv)
    # Four workers on two cores is one of the settings measured, not a mistake.
    warnings.filterwarnings("ignore", message="This DataLoader will create")
    n = args.samples or (32 if args.quick else 96)
    lens = np.random.default_rng(SEED).integers(1024, 2049, n)
    data = list(samples(lens, token_pool(int(lens.max()) * 4, args.hidden)))
    tokens, raw = int(lens.sum()), sum(hs.nbytes for hs in data)
    print(f"{n} samples, {tokens} tokens (1,024-2,048), H={args.hidden}, K=3+final, ", end="")
    print(f"{raw / 1e6:.0f} MB of bf16 hidden states; load average {os.getloadavg()[0]:.1f}")
    root = Path(tempfile.mkdtemp(prefix="hsdump-bench-read-", dir=args.dir))
    t0 = time.perf_counter()
    ids, lengths = [hs.sample_id for hs in data], [hs.num_tokens for hs in data]
    try:
        write_designs(root, data)
        del data  # a training process holds none of the samples
        for name, sub in (("store", "store"), ("safetensors", "st")):
            size = sum(f.stat().st_size for f in (root / sub).rglob("*") if f.is_file())
            print(f"{name}: {size / 1e6:,.0f} MB on disk ({size / raw:.3f} of raw)")
        print(HEADER)
        for cold in (False, True):
            if cold and not drop_caches():
                print("| cold | (skipped: the page cache cannot be dropped here) |")
                continue
            measure(root, ids, lengths, raw, cold, 1 if args.quick else 2)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(f"\n{time.perf_counter() - t0:.0f} s, load average {os.getloadavg()[0]:.1f}")
    import safetensors

    print(f"machine: {machine()}, safetensors {safetensors.__version__}")
    print(f"reproduce: {CMD}" + (" --quick" if args.quick else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
