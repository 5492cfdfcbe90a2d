"""Benchmark the hidden-state store against one file per sample (safetensors, torch.save).

All three designs get the same synthetic bf16 samples in one run, as torch tensors, and are timed
end to end. Figures are printed with PASS/FAIL against the targets of the store's design:

- bytes on disk per token <= 0.72 of raw bf16
- write throughput >= the faster per-file baseline (durable: including the final ``os.sync()``)
- random whole-sample read (cold page cache when it can be dropped) >= one safetensors file read
- open a store of 37,000 samples and know the committed IDs in < 100 ms
- files for 37,000 samples of ~2,350 tokens at H=7168: tens of thousands at most
- event-loop lag p99 < 20 ms while writing from asyncio

Run ``python benchmarks/bench_store.py`` (``--quick`` for a smaller run).
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import platform
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import torch

from hsdump._store.store import DEFAULT_SHARD_TOKENS, open_store
from hsdump._types import HiddenStates

K, LAYER_STD = 3, (0.6, 0.63, 0.56, 0.27)  # per-layer std of real activations (MiniLM, see notes)
REAL = {"samples": 37_000, "mean_tokens": 2_350, "hidden": 7168}
RESULTS: list[tuple[str, str, str, str]] = []


def lengths(n: int, divide: int, seed: int = 0) -> np.ndarray:
    """Sample lengths like the reference workload (50-8,000 tokens, mean ~2,350), divided."""
    rng = np.random.default_rng(seed)
    raw = np.clip(rng.lognormal(7.357, 0.9, n), 50, 8000).astype(int)
    return np.maximum(1, raw // divide)


def token_pool(tokens: int, hidden: int, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Random-normal bf16 states (a fair stand-in: 1.47x vs 1.44x on real activations)."""
    g = torch.Generator().manual_seed(seed)
    scale = torch.tensor(LAYER_STD).view(1, K + 1, 1)
    pool = (torch.randn(tokens, K + 1, hidden, generator=g) * scale).to(torch.bfloat16)
    return pool[:, :K].contiguous(), pool[:, K].contiguous()


def samples(lens: np.ndarray, pool: tuple[torch.Tensor, torch.Tensor]) -> Iterator[HiddenStates]:
    aux, final = pool
    rng = np.random.default_rng(2)
    for i, t in enumerate(lens):
        o = int(rng.integers(0, aux.shape[0] - t))
        # Each sample owns its memory, like tensors copied off a GPU (torch.save would otherwise
        # write the whole pool a view points into).
        a, f = aux[o : o + t].clone(), final[o : o + t].clone()
        yield HiddenStates(
            f"sample-{i:06d}",
            torch.arange(o, o + t),
            a,
            f,
            [1, 2, 3],
            torch.ones(t, dtype=torch.uint8),
        )


def dir_usage(path: Path) -> tuple[int, int]:
    """(bytes, files) under path."""
    sizes = [
        p.stat().st_size for p in path.rglob("*") if p.is_file() and not p.name.startswith(".")
    ]
    return sum(sizes), len(sizes)


def drop_caches() -> bool:
    try:
        os.sync()
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return True
    except OSError:
        return False


# -- writers --------------------------------------------------------------------------------------


async def write_store(
    path: Path, data: list[HiddenStates], compression: str = "zstd"
) -> tuple[float, list[float]]:
    lags: list[float] = []
    stop = asyncio.Event()

    async def heartbeat() -> None:
        while not stop.is_set():
            t = time.perf_counter()
            await asyncio.sleep(0.001)
            lags.append(time.perf_counter() - t - 0.001)

    beat = asyncio.create_task(heartbeat())
    t0 = time.perf_counter()
    async with open_store(path, "w", compression=compression) as store:  # type: ignore[arg-type]
        for hs in data:
            await store.awrite(hs)
    elapsed = time.perf_counter() - t0
    stop.set()
    await beat
    return elapsed, lags


def _fields(hs: HiddenStates) -> dict[str, torch.Tensor]:
    return {
        "input_ids": hs.input_ids,
        "loss_mask": hs.loss_mask,
        "aux_hidden_states": hs.aux_hidden_states,
        "hidden_state": hs.final_hidden_state,
    }  # type: ignore[dict-item]


def write_safetensors(path: Path, data: list[HiddenStates]) -> float:
    from safetensors.torch import save_file

    path.mkdir()
    t0 = time.perf_counter()
    for hs in data:
        save_file(_fields(hs), str(path / f"{hs.sample_id}.safetensors"))
    return time.perf_counter() - t0


def write_torch(path: Path, data: list[HiddenStates]) -> float:
    path.mkdir()
    t0 = time.perf_counter()
    for hs in data:
        torch.save(_fields(hs), path / f"{hs.sample_id}.ckpt")
    return time.perf_counter() - t0


def timed_sync() -> float:
    t0 = time.perf_counter()
    os.sync()
    return time.perf_counter() - t0


# -- readers --------------------------------------------------------------------------------------


def read_times(read: Callable[[str], object], ids: list[str]) -> list[float]:
    out = []
    for sid in ids:
        t0 = time.perf_counter()
        read(sid)
        out.append(time.perf_counter() - t0)
    return out


def load_safetensors(path: Path) -> dict[str, torch.Tensor]:
    """Load and copy into process memory: load_file maps the file lazily, a training step cannot."""
    from safetensors.torch import load_file

    return {k: v.clone() for k, v in load_file(str(path)).items()}


def readers(root: Path) -> dict[str, Callable[[str], object]]:
    store = open_store(root / "store", "r")
    plain = open_store(root / "plain", "r")
    return {
        "hsdump store": lambda sid: store[sid],
        "hsdump store, uncompressed": lambda sid: plain[sid],
        "safetensors/sample": lambda sid: load_safetensors(root / "st" / f"{sid}.safetensors"),
        "torch.save/sample": lambda sid: torch.load(root / "pt" / f"{sid}.ckpt"),
    }


# -- the 37,000-sample index ----------------------------------------------------------------------


def open_time_at_scale(root: Path, n: int) -> tuple[float, float]:
    """Build a store of n tiny samples and time opening it (the cost is the index, not H)."""
    aux, final, ids = torch.randn(8, K, 8).bfloat16(), torch.randn(8, 8).bfloat16(), torch.arange(8)
    path = root / "index37k"
    with open_store(path, "w", chunk_tokens=64, shard_tokens=DEFAULT_SHARD_TOKENS) as store:
        for i in range(n):
            store.write(HiddenStates(f"sample-{i:06d}", ids, aux, final, [1, 2, 3]))
    times, cold = [], math.nan
    for attempt in range(6):
        dropped = attempt == 0 and drop_caches()
        t0 = time.perf_counter()
        assert len(open_store(path, "r").committed_ids()) == n
        dt = time.perf_counter() - t0
        if dropped:
            cold = dt
        else:
            times.append(dt)
    return float(np.median(times)), cold


def files_at_real_scale(shard_tokens: int, chunk_tokens: int) -> int:
    """Files the layout makes for the real workload (37,000 samples, H=7168), from its geometry."""
    lens = lengths(REAL["samples"], 1, seed=5)
    lens = lens * REAL["mean_tokens"] / lens.mean()
    tokens = int(np.sum(np.ceil(lens / chunk_tokens) * chunk_tokens))
    return layout_files(tokens, REAL["samples"], shard_tokens)


def layout_files(tokens: int, n: int, shard_tokens: int) -> int:
    from hsdump._store.part import _IDS_CHUNK_SHARDS, _INDEX_CHUNK

    shards = math.ceil(tokens / shard_tokens)
    id_chunks = math.ceil(tokens / (shard_tokens * _IDS_CHUNK_SHARDS))
    index_chunks = math.ceil(n / _INDEX_CHUNK)
    metadata = 8  # root, part, hidden, input_ids, loss_mask, index, index/rows, index/sample_id
    return shards + 2 * id_chunks + 2 * index_chunks + metadata


# -- report ---------------------------------------------------------------------------------------


def record(name: str, value: str, target: str, ok: bool | None) -> None:
    verdict = "INFO" if ok is None else ("PASS" if ok else "FAIL")
    RESULTS.append((name, value, target, verdict))
    print(f"| {name} | {value} | {target} | {verdict} |", flush=True)


def machine() -> str:
    cpu = next(
        (
            ln.split(":", 1)[1].strip()
            for ln in Path("/proc/cpuinfo").read_text().splitlines()
            if ln.startswith("model name")
        ),
        platform.processor(),
    )
    import zarr

    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return (
        f"{os.cpu_count()} CPU ({cpu}), {ram:.0f} GiB RAM, Python {platform.python_version()}, "
        f"torch {torch.__version__}, zarr {zarr.__version__}"
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer, smaller samples (about a minute)")
    ap.add_argument("--strict", action="store_true", help="exit 1 if any figure misses its target")
    ap.add_argument("--samples", type=int, help="samples in the side-by-side run")
    ap.add_argument(
        "--hidden", type=int, default=1024, help="hidden size H of the synthetic samples"
    )
    ap.add_argument(
        "--index-samples", type=int, default=37_000, help="samples in the open-time store"
    )
    ap.add_argument(
        "--dir", type=Path, help="where to write (default: a temp dir on the same disk as /tmp)"
    )
    args = ap.parse_args(argv)
    n = args.samples or (60 if args.quick else 240)
    command = "python benchmarks/bench_store.py" + (" --quick" if args.quick else "")
    root = Path(tempfile.mkdtemp(prefix="hsdump-bench-", dir=args.dir))
    try:
        run(root, n, args.hidden, args.index_samples, 4 if args.quick else 2)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(f"\nmachine: {machine()}\nreproduce: {command}")
    failed = [r[0] for r in RESULTS if r[3] == "FAIL"]
    return 1 if failed and args.strict else 0


def run(root: Path, n: int, hidden: int, index_samples: int, divide: int) -> None:
    lens = lengths(n, divide)
    data = list(samples(lens, token_pool(int(lens.max()) * 4, hidden)))
    raw = sum(hs.nbytes for hs in data)
    tokens = int(lens.sum())
    print(
        f"{n} samples, {tokens} tokens (mean {tokens / n:.0f}), H={hidden}, K={K}+final, ", end=""
    )
    print(
        f"{raw / 1e6:.0f} MB raw bf16\n\n| figure | value | target | verdict |\n|---|---|---|---|"
    )
    bench_writes(root, data, raw)
    bench_size(root, lens, raw)
    bench_reads(root, data)
    warm, cold = open_time_at_scale(root, index_samples)
    worst = max(warm, 0 if math.isnan(cold) else cold)
    label = f"open + committed ids, {index_samples:,} samples, ms (warm median / cold)"
    record(label, f"{warm * 1e3:.1f} / {cold * 1e3:.1f}", "< 100", worst < 0.1)


def bench_writes(root: Path, data: list[HiddenStates], raw: int) -> None:
    timed = {}
    # Warm-up, not timed: imports, thread pools and codecs start on a store's first write, once
    # per process (the per-file baselines' libraries are imported already).
    asyncio.run(write_store(root / "warm-up", data[:2]))
    shutil.rmtree(root / "warm-up")
    drop_caches()
    t, lags = asyncio.run(write_store(root / "store", data))
    timed["hsdump store"] = (t, t + timed_sync())
    drop_caches()
    t, _ = asyncio.run(write_store(root / "plain", data, "none"))
    timed["hsdump store, uncompressed"] = (t, t + timed_sync())
    for name, fn, sub in (
        ("safetensors/sample", write_safetensors, "st"),
        ("torch.save/sample", write_torch, "pt"),
    ):
        drop_caches()
        t = fn(root / sub, data)
        timed[name] = (t, t + timed_sync())
    for name, (t, td) in timed.items():
        label = f"write MB/s, {name} (page cache / durable incl. os.sync)"
        record(label, f"{raw / t / 1e6:.0f} / {raw / td / 1e6:.0f}", "", None)
    best = max(raw / td for name, (_, td) in timed.items() if "hsdump" not in name) / 1e6
    ours = raw / timed["hsdump store"][1] / 1e6
    record(
        "write MB/s durable: store vs faster baseline",
        f"{ours:.0f} vs {best:.0f}",
        ">= baseline",
        ours >= best,
    )
    lag = np.asarray(lags) * 1e3
    p50, p99 = np.percentile(lag, 50), np.percentile(lag, 99)
    value = f"{p50:.1f} / {p99:.1f} / {lag.max():.1f}"
    record("event-loop lag while writing p50 / p99 / max ms", value, "p99 < 20", bool(p99 < 20))


def bench_size(root: Path, lens: np.ndarray, raw: int) -> None:
    size, files = dir_usage(root / "store")
    st_size, st_files = dir_usage(root / "st")
    record(
        "bytes on disk / raw bf16 (whole store)",
        f"{size / raw:.3f} ({raw / size:.2f}x)",
        "<= 0.72",
        size / raw <= 0.72,
    )
    record("bytes on disk / raw bf16 (safetensors)", f"{st_size / raw:.3f}", "", None)
    with open_store(root / "store", "r") as store:
        layout = store._readers["part-default"].index.state.layout
    assert layout is not None
    ct = layout.chunk_tokens
    padded = int(sum(math.ceil(x / ct) * ct for x in lens))
    predicted = layout_files(padded, len(lens), layout.shard_tokens)
    record(
        "files here: store (layout formula) vs per-file",
        f"{files} ({predicted}) vs {st_files}",
        "",
        None,
    )
    real = files_at_real_scale(DEFAULT_SHARD_TOKENS, 64)  # chunk_tokens_for(4 x 7168 x 2 B) = 64
    label = "files for 37,000 samples x ~2,350 tokens, H=7168 (layout formula)"
    record(label, f"{real:,} (per-file: 37,000+)", "tens of thousands", real < 100_000)


def bench_reads(root: Path, data: list[HiddenStates]) -> None:
    rng = np.random.default_rng(3)
    picked = [data[i] for i in rng.permutation(len(data))[:80]]
    order, nbytes = [hs.sample_id for hs in picked], sum(hs.nbytes for hs in picked)
    fns = readers(root)
    for label, cold in (("cold", True), ("hot", False)):
        if cold and not drop_caches():
            continue
        per = {name: read_times(fn, order) for name, fn in fns.items()}
        for name, ts in per.items():
            value = f"{np.median(ts) * 1e3:.1f} / {nbytes / sum(ts) / 1e6:.0f}"
            record(f"random read {label}, {name}: p50 ms / MB/s", value, "", None)
        ours, theirs = (
            nbytes / sum(per["hsdump store"]) / 1e6,
            nbytes / sum(per["safetensors/sample"]) / 1e6,
        )
        record(
            f"random read {label}: store vs safetensors MB/s",
            f"{ours:.0f} vs {theirs:.0f}",
            ">= safetensors",
            ours >= theirs,
        )


if __name__ == "__main__":
    sys.exit(main())
