"""What bounds one store process at H=7168 on the GPU host, measured rather than guessed.

Prints JSON lines: the store's real codec (Blosc zstd-1, byte shuffle over 2-byte bf16 bits,
1 MiB blocks, chunks of 64 tokens) on 1 and all threads, the other per-byte work of a write
(statistics, placement) in core-seconds per GB, and one process's store-alone rate into /dev/shm
for several shard-writer and core settings (each in a fresh process, with cores busy).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

T, H, K = 2048, 7168, 3


def emit(**row: object) -> None:
    print(json.dumps(row), flush=True)


def samples(
    n: int, seed: int = 0, scale: tuple[float, float] = (1.0, 1.0)
) -> list[tuple[np.ndarray, np.ndarray]]:
    """``n`` random samples' aux and final bits, made on the GPU (std ``scale`` each)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    out = []
    for _ in range(n):
        aux = torch.randn(T, K, H, generator=g, device="cuda") * scale[0]
        final = torch.randn(T, H, generator=g, device="cuda") * scale[1]
        aux, final = aux.to(torch.bfloat16).cpu(), final.to(torch.bfloat16).cpu()
        out.append((aux.view(torch.uint16).numpy(), final.view(torch.uint16).numpy()))
    return out


def as_states(data: list[tuple[np.ndarray, np.ndarray]], prefix: str = "s") -> list:
    """The samples' bits as bf16 `HiddenStates` (sample ids ``<prefix><i>``), without copying."""
    from hsdump import HiddenStates

    bf16 = torch.bfloat16
    return [
        HiddenStates(
            sample_id=f"{prefix}{i}",
            input_ids=torch.arange(T),
            aux_hidden_states=torch.from_numpy(a).view(bf16),
            final_hidden_state=torch.from_numpy(f).view(bf16),
            layer_ids=[2, 4, 5],
        )
        for i, (a, f) in enumerate(data)
    ]


def per_byte(data: list[tuple[np.ndarray, np.ndarray]]) -> None:
    import numcodecs.blosc
    from numcodecs import Blosc

    from hsdump._store.stats import RowStats

    numcodecs.blosc.use_threads = False
    codec = Blosc(cname="zstd", clevel=1, shuffle=Blosc.SHUFFLE, blocksize=1 << 20)
    chunks = [
        np.ascontiguousarray(np.concatenate([a, f[:, None]], axis=1)[i : i + 64])
        for a, f in data[:8]
        for i in range(0, T, 64)
    ]
    gb = sum(c.nbytes for c in chunks) / 1e9
    for threads in (1, os.cpu_count() or 1):
        with ThreadPoolExecutor(threads) as pool:
            list(pool.map(codec.encode, chunks[:threads]))
            wall, cpu = time.perf_counter(), time.process_time()
            sizes = list(pool.map(lambda c: len(codec.encode(c)), chunks))
            wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
        emit(
            what="codec",
            threads=threads,
            gb_s=round(gb / wall, 3),
            core_s_per_gb=round(cpu / gb, 2),
            stored_fraction=round(sum(sizes) / (gb * 1e9), 3),
        )
    stored = [np.concatenate([a, f[:, None]], axis=1) for a, f in data[:8]]
    cpu = time.process_time()
    for rows in stored:
        RowStats("bfloat16", [2, 4, 5, "final"]).add(rows)
    print(
        json.dumps({"what": "stats", "core_s_per_gb": round((time.process_time() - cpu) / gb, 2)})
    )
    buf = np.empty(T * (K + 1) * H, np.uint16)
    cpu = time.process_time()
    for a, f in data[:8]:
        buf[: a.size] = a.reshape(-1)
        buf[a.size :] = f.reshape(-1)
    print(
        json.dumps({"what": "place", "core_s_per_gb": round((time.process_time() - cpu) / gb, 2)})
    )


def store_run(writers: int, cores: int, n: int) -> None:
    """In a fresh process: write n samples into a fresh store on /dev/shm."""
    os.environ["HSDUMP_CORES"] = str(cores)
    os.environ["HSDUMP_SHARD_WRITERS"] = str(writers)

    from hsdump import open_store

    states = as_states(samples(n))
    dest = "/dev/shm/store-probe.zarr"
    shutil.rmtree(dest, ignore_errors=True)
    wall, cpu = time.perf_counter(), time.process_time()
    with open_store(dest, "w") as store:
        for hs in states:
            store.write(hs)
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    shutil.rmtree(dest, ignore_errors=True)
    gb = n * T * (K + 1) * H * 2 / 1e9
    emit(
        what="store alone, one process",
        shard_writers=writers,
        cores=cores,
        tok_s=round(n * T / wall),
        gb_s=round(gb / wall, 3),
        cores_busy=round(cpu / wall, 2),
        core_s_per_gb=round(cpu / gb, 2),
    )


def main() -> None:
    if len(sys.argv) > 1:
        store_run(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]))
        return
    per_byte(samples(8))
    cores = os.cpu_count() or 1
    for writers, share in ((4, cores), (8, cores), (16, cores), (4, cores // 2), (8, cores // 2)):
        subprocess.run([sys.executable, __file__, str(writers), str(share), "32"], check=False)


if __name__ == "__main__":
    main()
