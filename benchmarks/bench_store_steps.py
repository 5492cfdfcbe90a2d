"""Where a store write's CPU goes at Kimi-K2.5's hidden size, per GB of bf16 rows.

Each step of a write runs alone on one thread, on the same samples (2048 tokens, K=3 aux layers
plus the final state, H=7168): the codec (Blosc zstd-1, byte shuffle over the 2-byte bits, as the
store configures it), copying rows into a shard buffer, their CRC-32, their statistics, and the
three fused as the store runs them. Beside the store's CRC-32 (zlib-ng's), row sums (einsum) and
peak magnitudes (two maxima of views), the ways they were computed before run on the same rows:
zlib's CRC-32, numpy's pairwise ``add.reduce``, and a maximum of a masked copy. Then one store
process writes the same samples into a fresh store on /dev/shm and reports its total core-seconds
per GB. The difference between the total and the steps alone is what they cost each other
through memory and the GIL.

Run ``python benchmarks/bench_store_steps.py`` (``--samples N``; ~1 minute on 2 cores).
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time
import zlib
from collections.abc import Callable
from pathlib import Path

import numcodecs.blosc
import numpy as np
import torch
from numcodecs import Blosc

from hsdump import HiddenStates, open_store
from hsdump._protocol import dtype_spec
from hsdump._store.integrity import crc32
from hsdump._store.shardbuf import Piece, ShardBuffer, place_sample
from hsdump._store.stats import RowStats

T, K, H = 2048, 3, 7168
LAYERS: list[int | str] = [2, 4, 5, "final"]


def samples(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [
        (
            (torch.randn(T, K, H, generator=g) * 0.6).to(torch.bfloat16),
            (torch.randn(T, H, generator=g) * 0.3).to(torch.bfloat16),
        )
        for _ in range(n)
    ]


def per_gb(step: Callable[[], object], gb: float) -> float:
    """Thread CPU seconds of ``step`` per GB, after one warm-up call."""
    step()
    started = time.thread_time()
    step()
    return (time.thread_time() - started) / gb


def steps(data: list[tuple[np.ndarray, np.ndarray]]) -> dict[str, float]:
    numcodecs.blosc.use_threads = False
    codec = Blosc(cname="zstd", clevel=1, shuffle=Blosc.SHUFFLE, blocksize=1 << 20)
    shard = ShardBuffer.allocate(T, K + 1, H, np.dtype(np.uint16))
    shard.rows[:, :K], shard.rows[:, K] = data[0]  # real rows, and the buffer faulted in
    ids = np.arange(T, dtype=np.int32)
    gb = len(data) * shard.rows.nbytes / 1e9

    def copy() -> None:
        for aux, final in data:
            shard.rows[:, :K] = aux
            shard.rows[:, K] = final

    def each_chunk(fn: Callable[[np.ndarray], object]) -> Callable[[], None]:
        """``fn`` over the shard's 64-token chunks, once per sample (the codec's chunk size)."""
        return lambda: [fn(shard.rows[i : i + 64]) for _ in data for i in range(0, T, 64)]

    def fused() -> None:
        for aux, final in data:
            place_sample(
                [Piece(shard, 0, 0, T)], aux, final, ids, None, RowStats("bfloat16", LAYERS)
            )

    bf16 = dtype_spec("bfloat16")
    wide = np.empty((64, K + 1, H), np.float32)

    def widened(fn: Callable[[np.ndarray], object]) -> Callable[[np.ndarray], object]:
        return lambda rows: fn(bf16.to_float32(rows, out=wide[: len(rows)]))

    return {
        "codec": per_gb(each_chunk(codec.encode), gb),
        "copy into the shard buffer": per_gb(copy, gb),
        "crc32 (the store's, zlib-ng)": per_gb(each_chunk(lambda rows: crc32(rows.data)), gb),
        "crc32 (zlib)": per_gb(each_chunk(lambda rows: zlib.crc32(rows.data)), gb),
        "statistics": per_gb(each_chunk(RowStats("bfloat16", LAYERS).add), gb),
        "  widening to float32": per_gb(each_chunk(widened(lambda v: None)), gb),
        "  widening + row sums, einsum (the store's)": per_gb(
            each_chunk(widened(lambda v: np.einsum("tlh->tl", v))), gb
        ),
        "  widening + row sums, add.reduce": per_gb(
            each_chunk(widened(lambda v: np.add.reduce(v, -1))), gb
        ),
        "  peak magnitudes, two maxima (the store's)": per_gb(
            each_chunk(lambda rows: bf16.peak_magnitude(rows, axis=(0, 2))), gb
        ),
        "  peak magnitudes, masked copy": per_gb(
            each_chunk(lambda rows: np.bitwise_and(rows, 0x7FFF).max(axis=(0, 2))), gb
        ),
        "copy + crc32 + statistics, fused": per_gb(fused, gb),
    }


def store_write(states: list[HiddenStates]) -> tuple[float, float]:
    """Core-seconds per GB and GB/s of one store process writing ``states`` into /dev/shm."""
    root = Path(tempfile.mkdtemp(dir="/dev/shm" if Path("/dev/shm").is_dir() else None))
    try:
        gb = sum(s.num_tokens for s in states) * (K + 1) * H * 2 / 1e9
        wall, cpu = time.perf_counter(), time.process_time()
        with open_store(root / "s.zarr", "w") as store:
            for hs in states:
                store.write(hs)
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
        return cpu / gb, gb / wall
    finally:
        shutil.rmtree(root, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--samples", type=int, default=16)
    args = parser.parse_args()
    data = samples(args.samples)
    bits = [(a.view(torch.uint16).numpy(), f.view(torch.uint16).numpy()) for a, f in data]
    for name, value in steps(bits[:4]).items():
        print(f"{name:<46}: {value:.2f} core-s per GB (one thread, alone)")
    states = [
        HiddenStates(
            sample_id=f"s{i}",
            input_ids=torch.arange(T),
            aux_hidden_states=aux,
            final_hidden_state=final,
            layer_ids=[2, 4, 5],
        )
        for i, (aux, final) in enumerate(data)
    ]
    core_s, rate = store_write(states)
    print(
        f"{'one store process, all of a write':<46}: {core_s:.2f} core-s per GB ({rate:.2f} GB/s)"
    )


if __name__ == "__main__":
    main()
