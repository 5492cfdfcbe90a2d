"""Where the store-alone row's CPU goes on the GPU host: user and kernel time, page faults, and
the busiest native functions, for the same process layout as `tests/gpu/kimi.py`'s store-alone row.

``python3 tests/gpu/store_profile.py DEST [PROCESSES] [SAMPLES]`` writes SAMPLES random 2048-token
H=7168 samples (made on the GPU, untimed) into a fresh store under DEST from PROCESSES processes,
each sizing its pools by its share of the cores. It prints JSON lines: the host's CPU topology,
the codec's rate and core-seconds per GB by thread count (does a core's rate fall as more are
busy?), and per process the store's user and system core-seconds per GB, minor faults per GB and
context switches. With ``perf`` on the PATH it records every CPU during the writes and prints
the busiest functions; otherwise ``HSDUMP_PY_SPY`` (a py-spy binary) samples one process's
native frames.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import resource
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import store_probe

T, H, K = store_probe.T, store_probe.H, store_probe.K


def emit(**row: object) -> None:
    print(json.dumps(row), flush=True)


def topology() -> None:
    out = subprocess.run(["lscpu"], capture_output=True, text=True, check=False).stdout
    keep = ("Model name", "Thread(s) per core", "Core(s) per socket", "Socket(s)", "NUMA node(s)",
            "L2 cache", "L3 cache", "CPU(s)")  # fmt: skip
    info = {k.strip(): v.strip() for k, _, v in (ln.partition(":") for ln in out.splitlines())}
    emit(what="cpu", **{k: info.get(k) for k in keep}, perf=shutil.which("perf"))
    for f in ("enabled", "shmem_enabled"):
        p = Path("/sys/kernel/mm/transparent_hugepage") / f
        emit(what=f"thp {f}", value=p.read_text().strip() if p.exists() else None)


SCALE = (0.6, 0.3)  # the standard deviations of the aux and the final states


def codec_sweep(data: list[tuple[np.ndarray, np.ndarray]]) -> None:
    import numcodecs.blosc
    from numcodecs import Blosc

    numcodecs.blosc.use_threads = False
    codec = Blosc(cname="zstd", clevel=1, shuffle=Blosc.SHUFFLE, blocksize=1 << 20)
    chunks = [
        np.ascontiguousarray(np.concatenate([a, f[:, None]], axis=1)[i : i + 64])
        for a, f in data
        for i in range(0, T, 64)
    ]
    gb = sum(c.nbytes for c in chunks) / 1e9
    for threads in sorted({1, 4, 8, 12, os.cpu_count() or 1}):
        with ThreadPoolExecutor(threads) as pool:
            list(pool.map(codec.encode, chunks[:threads]))
            wall, cpu = time.perf_counter(), time.process_time()
            list(pool.map(codec.encode, chunks))
            wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
        emit(what="codec", threads=threads, gb_s=round(gb / wall, 3),
             core_s_per_gb=round(cpu / gb, 2), cores_busy=round(cpu / wall, 1))  # fmt: skip


def writer(dest: str, index: int, procs: int, n: int, barrier, results) -> None:
    os.environ["HSDUMP_CORES"] = str(max(1, (os.cpu_count() or 1) // procs))
    from hsdump import open_store

    states = store_probe.as_states(store_probe.samples(n, index, SCALE), prefix=f"p{index}s")
    barrier.wait()
    r0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.monotonic()
    with open_store(dest, "a", writer_id=f"w{index}") as store:
        for hs in states:
            store.write(hs)
    t1, r1 = time.monotonic(), resource.getrusage(resource.RUSAGE_SELF)
    gb = n * T * (K + 1) * H * 2 / 1e9
    results.put(dict(
        index=index, t0=t0, t1=t1, gb=gb,
        user_per_gb=round((r1.ru_utime - r0.ru_utime) / gb, 2),
        sys_per_gb=round((r1.ru_stime - r0.ru_stime) / gb, 2),
        minflt_per_gb=round((r1.ru_minflt - r0.ru_minflt) / gb),
        vol_switches=r1.ru_nvcsw - r0.ru_nvcsw, invol_switches=r1.ru_nivcsw - r0.ru_nivcsw,
    ))  # fmt: skip


def record(pid: int, out: Path) -> subprocess.Popen[bytes] | None:
    if shutil.which("perf"):
        cmd = ["perf", "record", "-a", "-g", "-F", "499", "-o", "/tmp/perf.data"]
    elif spy := os.environ.get("HSDUMP_PY_SPY"):
        cmd = [spy, "record", "--pid", str(pid), "--native", "--threads", "--rate", "97",
               "--format", "raw", "-o", str(out / "spy-native.txt")]  # fmt: skip
    else:
        return None
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def report(out: Path) -> None:
    if Path("/tmp/perf.data").exists():
        rep = subprocess.run(
            ["perf", "report", "-i", "/tmp/perf.data", "--no-children", "--sort", "comm,dso,sym",
             "--stdio", "-g", "none"],
            capture_output=True, text=True, check=False,
        ).stdout  # fmt: skip
        print("\n".join([ln for ln in rep.splitlines() if "%" in ln][:45]), flush=True)
    elif (out / "spy-native.txt").exists():
        import collections

        counts: collections.Counter[str] = collections.Counter()
        for line in (out / "spy-native.txt").read_text().splitlines():
            stack, _, n = line.rpartition(" ")
            counts[stack.split(";")[-1].split(" (")[0]] += int(n)
        total = sum(counts.values()) or 1
        for leaf, n in counts.most_common(30):
            print(f"{100 * n / total:5.1f}% {leaf}", flush=True)


def main() -> None:
    where = Path(sys.argv[1])
    procs = int(sys.argv[2]) if len(sys.argv) > 2 else 2
    n = int(sys.argv[3]) if len(sys.argv) > 3 else 48
    out = Path(os.environ.get("OUT", "/tmp/out"))
    topology()
    codec_sweep(store_probe.samples(8, 99, SCALE))
    dest = where / "profile.zarr"
    shutil.rmtree(dest, ignore_errors=True)
    ctx = multiprocessing.get_context("spawn")
    barrier, results = ctx.Barrier(procs + 1), ctx.Queue()
    workers = [
        ctx.Process(target=writer, args=(str(dest), i, procs, n, barrier, results))
        for i in range(procs)
    ]
    for w in workers:
        w.start()
    barrier.wait()
    recorder = record(workers[0].pid or 0, out)
    got = [results.get(timeout=600) for _ in workers]
    if recorder is not None:
        recorder.send_signal(2)
        recorder.wait()
    for w in workers:
        w.join()
    start, end = min(g["t0"] for g in got), max(g["t1"] for g in got)
    seconds = end - start
    emit(what="store", where=str(where), processes=procs, tok_s=round(procs * n * T / seconds),
         gb_s=round(sum(g["gb"] for g in got) / seconds, 3), per_process=got)  # fmt: skip
    shutil.rmtree(dest, ignore_errors=True)
    report(out)


if __name__ == "__main__":
    main()
