"""Benchmark `hsdump export`: hidden-state GB/s written for each trainer's format.

Builds a store of synthetic bf16 samples (three aux layers), once post-norm (for SpecForge) and
once pre-norm (for speculators), then times `export_store` into a fresh directory, and the store
read alone for comparison. The page cache is not dropped: the figures are for a hot store.

Run ``python benchmarks/bench_export.py`` (``--samples 64 --tokens 1024 --hidden 2048`` by
default; ``--out /dev/shm`` to keep the disk out of the figure).
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time
from pathlib import Path

import torch

from hsdump import export_store, open_store
from hsdump._protocol import DumpMeta, ProducerInfo
from hsdump._types import HiddenStates

LAYERS = [2, 16, 29]


def sample(i: int, tokens: int, hidden: int, final_norm: str) -> HiddenStates:
    g = torch.Generator().manual_seed(i)
    rows = (torch.randn(tokens, len(LAYERS) + 1, hidden, generator=g) * 0.6).to(torch.bfloat16)
    ids = torch.randint(0, 150_000, (tokens,), generator=g)
    k = len(LAYERS)
    hs = HiddenStates(f"s{i}", ids, rows[:, :k], rows[:, k], list(LAYERS))
    hs.meta = DumpMeta(
        rid=f"r{i}",
        input_ids=ids.tolist(),
        num_tokens=tokens,
        layer_ids=list(LAYERS),
        final_norm=final_norm,  # type: ignore[arg-type]
        hidden_size=hidden,
        dtype="bfloat16",
        aux_shape=(tokens, k, hidden),
        final_shape=(tokens, hidden),
        producer=ProducerInfo(name="bench", version="1"),
        model_path="bench",
    )
    return hs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--out", type=Path, default=None, help="where exports go (default: tmp)")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="hsdump-bench-export-"))
    out_root = args.out or work
    try:
        for final_norm, fmt in (("post_norm", "specforge"), ("pre_norm", "speculators")):
            store = work / f"{final_norm}.zarr"
            with open_store(store, "w") as s:
                for i in range(args.samples):
                    s.write(sample(i, args.tokens, args.hidden, final_norm))
            out = out_root / f"hsdump-bench-{fmt}"
            shutil.rmtree(out, ignore_errors=True)
            r = export_store(store, out, format=fmt)  # type: ignore[arg-type]
            print(
                f"export --format {fmt}: {r.written} samples, {r.bytes_written / 1e9:.2f} GB in "
                f"{r.wall_s:.2f} s = {r.bytes_per_s / 1e9:.2f} GB/s (to {out_root})"
            )
            shutil.rmtree(out, ignore_errors=True)
            with open_store(store, "r") as s:
                start = time.perf_counter()
                nbytes = sum(s.get(sid).nbytes for sid in s)
                seconds = time.perf_counter() - start
            print(f"  store read alone: {nbytes / seconds / 1e9:.2f} GB/s")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
