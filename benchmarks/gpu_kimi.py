"""GPU benchmark at Kimi-K2.5's hidden size (57,344 bytes a token), all rows in one run.

On one server with the plugin, on the same 2048-token prompts: the server alone (rids without the
opt-in prefix, so nothing is dumped), dump-only (opted in; the client waits for ``done`` and
deletes), the store alone (the same bytes, already in memory, written into a fresh store on the disk
and on /dev/shm by as many processes as ``hsdump extract`` uses), and ``hsdump extract`` at 1, 8
and 32 in flight with the store on the disk and on /dev/shm. It prints the machine's ceilings (disk
write, codec rate on its cores) and the ratios of the performance issue, and appends JSON lines to
``$OUT/kimi.jsonl``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).parent))
from gpu_bench import append_record, dataset, disk_write_rate, plain

TOKENS, ROW_BYTES = 2048, 4 * 7168 * 2


def random_samples(
    n: int, seed: int, scale: tuple[float, float]
) -> list[tuple[np.ndarray, np.ndarray]]:
    """``n`` random samples' aux and final bits, made on the GPU (std ``scale`` each)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    out = []
    for _ in range(n):
        aux = torch.randn(TOKENS, 3, 7168, generator=g, device="cuda") * scale[0]
        final = torch.randn(TOKENS, 7168, generator=g, device="cuda") * scale[1]
        aux, final = aux.to(torch.bfloat16).cpu(), final.to(torch.bfloat16).cpu()
        out.append((aux.view(torch.uint16).numpy(), final.view(torch.uint16).numpy()))
    return out


def as_states(data: list[tuple[np.ndarray, np.ndarray]], prefix: str) -> list:
    """The samples' bits as bf16 `HiddenStates` (sample ids ``<prefix><i>``), without copying."""
    from hsdump import HiddenStates

    bf16 = torch.bfloat16
    return [
        HiddenStates(
            sample_id=f"{prefix}{i}",
            input_ids=torch.arange(TOKENS),
            aux_hidden_states=torch.from_numpy(a).view(bf16),
            final_hidden_state=torch.from_numpy(f).view(bf16),
            layer_ids=[2, 4, 5],
        )
        for i, (a, f) in enumerate(data)
    ]


def log(out: Path, **record: object) -> None:
    append_record(out, "kimi.jsonl", **record)


def codec_rate(rows: np.ndarray, threads: int) -> tuple[float, float]:
    """GB/s of the store's codec on ``threads``, and the cores it kept busy: Blosc zstd-1, byte
    shuffle over the 2-byte bf16 bits, 1 MiB blocks, on chunks of the store's size cut from
    ``rows`` (uint16 ``[T, L, H]``).

    Earlier runs fed Blosc a uint8 view, so it shuffled 1-byte items (a no-op): 1.6x faster than
    what the store runs, and a ratio of 0.78 instead of the store's 0.70.
    """
    from concurrent.futures import ThreadPoolExecutor

    import numcodecs.blosc
    from numcodecs import Blosc

    from hsdump._store.codecs import chunk_tokens_for

    numcodecs.blosc.use_threads = False  # each call on its own context, without a global lock
    codec = Blosc(cname="zstd", clevel=1, shuffle=Blosc.SHUFFLE, blocksize=1 << 20)
    ct = chunk_tokens_for(rows[0].nbytes, 4096)
    chunks = [np.ascontiguousarray(rows[i : i + ct]) for i in range(0, len(rows), ct)]
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(codec.encode, chunks[:threads]))
        t0, cpu = time.perf_counter(), time.process_time()
        for _ in range(3):
            list(pool.map(codec.encode, chunks))
        seconds, cpu = time.perf_counter() - t0, time.process_time() - cpu
    return 3 * rows.nbytes / seconds / 1e9, cpu / seconds


def extract(
    args: argparse.Namespace,
    rows: list[dict],
    where: Path,
    conc: int,
    extra_env: dict[str, str] | None = None,
) -> dict:
    extra_env = extra_env or {}
    work = where / f"kimi-{conc}"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    data = Path("/tmp/kimi-data.jsonl")
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cmd = [
        "hsdump", "extract", str(data), "--out", str(work / "store.zarr"), "--server-url",
        args.url, "--dump-dir", args.dump_dir, "--concurrency", str(conc), "--retries", "0",
        "--workers", str(args.workers), "--json",
    ]  # fmt: skip
    t0, host0, server0 = time.perf_counter(), host_cpu_s(), server_cpu_s()
    vm0 = vmstat()
    env = {**os.environ, "COLUMNS": "250", **extra_env}
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
    )
    spy = None
    if args.spy and args.spy_extract:
        spy = record_extract(args, proc.pid, f"extract-{where.name}-{conc}", work / "store.zarr")
    with CpuTrace() as trace:
        lines = []
        assert proc.stdout is not None
        for line in proc.stdout:  # the summary's time ends the run's window
            lines.append(line)
            if line.startswith(_SUMMARY):
                trace.mark()
        proc.wait(timeout=400)
    text = "".join(lines)
    wall = time.perf_counter() - t0
    vm = {k: v - vm0.get(k, 0) for k, v in vmstat().items()}
    host_busy = (host_cpu_s() - host0) / wall
    server_busy = (server_cpu_s() - server0) / wall
    summary = next((json.loads(x) for x in reversed(lines) if x.startswith(_SUMMARY)), {})
    window = trace.window(summary["wall_s"]) if summary else {}
    print_spy(args, spy, f"extract-{where.name}-{conc}", "hsdump extract and its workers")
    (args.out / "kimi_extract.log").open("a").write(f"## {where} {conc}\n{text[-3000:]}\n")
    return {
        "rc": proc.returncode,
        "tok_per_s": int(summary.get("tokens_per_s", 0)),
        "process_wall_s": round(wall, 2),
        "cores_busy": summary.get("cores_busy"),
        "peak_rss_gb": round(summary["peak_rss_bytes"] / 1e9, 2) if summary else None,
        "host_cores_busy": round(host_busy, 1),
        "server_cores_busy": round(server_busy, 1),
        **window,
        "vmstat": vm,
        "store": str(work / "store.zarr"),
    }


_SUMMARY = '{"state"'  # the line of hsdump extract --json's summary

VMSTAT = ("pgfault", "numa_hint_faults", "numa_pages_migrated", "thp_fault_fallback",
          "compact_stall", "pgmigrate_success", "thp_fault_alloc")  # fmt: skip


def host_memory() -> dict[str, object]:
    """The host's NUMA nodes, whether the kernel balances pages between them, and its THP mode."""
    balancing = Path("/proc/sys/kernel/numa_balancing")
    return {
        "numa_nodes": len(list(Path("/sys/devices/system/node").glob("node[0-9]*"))),
        "numa_balancing": balancing.read_text().strip() if balancing.exists() else None,
        "thp": Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text().strip(),
    }


def vmstat() -> dict[str, int]:
    """The host's counters of faults, NUMA hinting and huge-page fallbacks (/proc/vmstat)."""
    found = {}
    for line in Path("/proc/vmstat").read_text().splitlines():
        name, _, value = line.partition(" ")
        if name in VMSTAT:
            found[name] = int(value)
    return found


class CpuTrace:
    """The host's and the server's CPU seconds every 0.1 s on a thread, so that the cores busy
    during a run (not its process's start-up) can be read off: the extraction's own summary
    gives the run's seconds, and its "done:" line the run's end."""

    def __init__(self) -> None:
        import threading

        self.samples: list[tuple[float, float, float]] = []
        self.done_at = 0.0
        self._stop = threading.Event()
        self._pids = _server_pids()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> CpuTrace:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def mark(self) -> None:
        self.done_at = time.perf_counter()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.samples.append((time.perf_counter(), host_cpu_s(), server_cpu_s(self._pids)))
            self._stop.wait(0.1)

    def window(self, seconds: float) -> dict[str, float]:
        """Cores busy on the host and in the server's processes over the run's last ``seconds``."""
        inside = [s for s in self.samples if self.done_at - seconds <= s[0] <= self.done_at]
        if not self.done_at or len(inside) < 2:
            return {}
        (t0, h0, s0), (t1, h1, s1) = inside[0], inside[-1]
        return {
            "run_host_cores_busy": round((h1 - h0) / (t1 - t0), 1),
            "run_server_cores_busy": round((s1 - s0) / (t1 - t0), 1),
        }


def record_server(args: argparse.Namespace, tag: str) -> subprocess.Popen[bytes] | None:
    """py-spy on the scheduler process for a few seconds (collapsed stacks, all threads)."""
    found = subprocess.run(["pgrep", "-f", "sglang::scheduler"], capture_output=True, text=True)
    pids = found.stdout.split()
    if not pids:
        return None
    out = args.out / f"spy-{tag}.txt"
    cmd = [args.spy, "record", "--pid", pids[0], "--duration", "4", "--rate", "200",
           "--format", "raw", "--threads", "--idle", "--nonblocking", "-o", str(out)]  # fmt: skip
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def record_extract(
    args: argparse.Namespace, pid: int, tag: str, store: Path
) -> subprocess.Popen[bytes]:
    """py-spy on ``hsdump extract`` and its worker processes (with ``--spy-native``: on one
    worker, with native frames and idle threads), for 4 s from 1 s after the store appears (the
    workers' start-up, seconds of imports, is not recorded)."""
    out = args.out / f"spy-{tag}.txt"
    wait = f"until [ -e {store} ]; do sleep 0.05; done; sleep 1; "
    if args.spy_native:
        # py-spy takes no native stacks without pausing the process (it refuses --native with
        # --nonblocking), so one worker is recorded, at a rate low enough to disturb it little.
        worker = (f"w=$(for c in $(cat /proc/{pid}/task/*/children); do grep -qa spawn_main "
                  f"/proc/$c/cmdline && ! grep -qa resource_tracker /proc/$c/cmdline && echo $c; "
                  "done | head -1); ")  # fmt: skip
        cmd = ["bash", "-c", wait + worker + f"exec {args.spy} record --pid $w --native --idle "
               f"--duration 4 --rate 25 --format raw --threads -o {out}"]  # fmt: skip
    else:
        cmd = ["bash", "-c", wait + f"exec {args.spy} record --pid {pid} --subprocesses --duration "
               f"4 --rate 200 --format raw --threads --nonblocking -o {out}"]  # fmt: skip
    log = (args.out / f"spy-{tag}.log").open("wb")  # py-spy's own messages, when it fails
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)


def host_cpu_s() -> float:
    """CPU seconds the whole host has been busy (not idle, not waiting for I/O)."""
    fields = [int(f) for f in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    return (sum(fields[:8]) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")


def print_spy(
    args: argparse.Namespace,
    spy: subprocess.Popen[bytes] | None,
    tag: str,
    what: str = "the scheduler process",
) -> None:
    """Wait for a record_server() or record_extract() recording and print its busiest stacks."""
    if spy is None:
        return
    spy.wait()
    raw = args.out / f"spy-{tag}.txt"
    if raw.exists():
        print(f"py-spy of {what}, {tag}:", flush=True)
        print("\n".join(spy_summary(raw, top=18)), flush=True)
        if args.spy_native:
            print("\n".join(wait_summary(raw)), flush=True)


def _store_part(
    source: str,
    dest: str,
    index: int,
    workers: int,
    barrier,
    results,
    moments: bool = False,
) -> None:
    """One writer of the store-alone row: load its share (untimed), then write it (timed).

    Each process sizes its pools by its share of the cores, as a worker of `hsdump extract` does.
    ``source`` "random:N" writes N random samples instead of a store's. With ``moments`` each
    sample carries its row moments, taken while loading, as the plugin's dumps do.
    """
    import resource

    os.environ["HSDUMP_CORES"] = str(max(1, (os.cpu_count() or 1) // workers))
    from hsdump import open_store

    if source.startswith("random:"):
        data = random_samples(int(source.split(":")[1]) // workers, index, scale=(0.6, 0.3))
        states = as_states(data, prefix=f"r{index}-")
    else:
        with open_store(source, "r") as src:
            states = [src[sid] for sid in sorted(src)[index::workers]]
    if moments:
        from hsdump._protocol import row_moments

        for hs in states:
            aux, final = (t.contiguous().view(torch.uint16).numpy() for t in
                          (hs.aux_hidden_states, hs.final_hidden_state))  # fmt: skip
            hs.row_moments = torch.from_numpy(row_moments(aux, final, "bfloat16"))
    barrier.wait()
    t0, r0 = time.monotonic(), resource.getrusage(resource.RUSAGE_SELF)
    sys.setswitchinterval(0.0005)  # the switch interval hsdump extract's workers run at
    with open_store(dest, "a", writer_id=f"w{index}") as store:
        for hs in states:
            store.write(hs)
    r1 = resource.getrusage(resource.RUSAGE_SELF)
    results.put((t0, time.monotonic(), sum(hs.num_tokens for hs in states),
                 r1.ru_utime - r0.ru_utime, r1.ru_stime - r0.ru_stime,
                 r1.ru_minflt - r0.ru_minflt))  # fmt: skip


_LOADING = ("__getitem__", "ShardIO.read", "_decode", "open_store (")


# Native frames of a thread that is not running. In the H200 host's Python 3.12 `take_gil` is
# inlined: a thread waiting for the interpreter lock shows `pthread_cond_timedwait` right under a
# Python frame, one waiting on a Python lock (a queue, a future) under
# `PyThread_acquire_lock_timed`.
_LOCK_WAIT = "PyThread_acquire_lock_timed"
_OTHER_WAIT = ("epoll_wait", "select", "poll", "sem_wait", "nanosleep", "recv", "accept")


def _thread_state(frames: list[str]) -> str:
    if "take_gil" in frames:
        return "gil"
    if "pthread_cond_timedwait" in frames:
        at = frames.index("pthread_cond_timedwait")
        return "waiting" if frames[at - 1] == _LOCK_WAIT else "gil"
    if _LOCK_WAIT in frames or any(w in f for f in frames[-2:] for w in _OTHER_WAIT):
        return "waiting"
    return "running"


def wait_summary(raw: Path) -> list[str]:
    """From a ``--native --idle`` record: per thread kind, the shares of its samples running,
    waiting for the interpreter lock, and waiting for anything else."""
    import collections

    counts: collections.defaultdict[str, collections.Counter[str]] = collections.defaultdict(
        collections.Counter
    )
    for line in raw.read_text().splitlines():
        stack, _, n = line.rpartition(" ")
        if any(part in stack for part in _LOADING):
            continue  # the untimed load of a store-alone process's share
        frames = stack.split(";")
        thread = frames[0].split(": ", 1)[-1].rstrip("_0123456789")
        counts[thread][_thread_state([f.split(" (")[0] for f in frames[1:]])] += int(n)
    lines = ["threads: samples, running / waiting for the GIL / waiting for other things"]
    for thread, c in sorted(counts.items(), key=lambda kv: -sum(kv[1].values())):
        total = sum(c.values())
        shares = " / ".join(f"{100 * c[k] / total:.0f}%" for k in ("running", "gil", "waiting"))
        lines.append(f"{thread}: {total}, {shares}")
    return lines


def spy_summary(raw: Path, top: int = 25) -> list[str]:
    """The busiest (thread, leaf function) pairs of a py-spy raw record, as lines."""
    import collections

    counts: collections.Counter[tuple[str, str]] = collections.Counter()
    for line in raw.read_text().splitlines():
        stack, _, n = line.rpartition(" ")
        if any(part in stack for part in _LOADING):
            continue  # the untimed load of the process's share
        frames = stack.split(";")
        thread = frames[0].split(": ", 1)[-1].rstrip("_0123456789")
        leaf = ";".join(f.split(" (")[0] for f in frames[-2:])
        counts[(thread, leaf)] += int(n)
    total = sum(counts.values()) or 1
    return [f"{100 * n / total:5.1f}% {t} {leaf}" for (t, leaf), n in counts.most_common(top)]


def store_alone(
    source: str,
    where: Path,
    workers: int,
    spy: str = "",
    out: Path | None = None,
    native: bool = False,
    moments: bool = False,
) -> dict[str, float]:
    """The store-alone row of ``workers`` processes: its rate (``tok_per_s``), the cores they
    kept busy, and their user and system core-seconds and minor faults per GB."""
    dest = where / "kimi-store-alone.zarr"
    writers = _start_writers(_store_part, source, dest, workers, moments)
    recorder = None
    if spy and out is not None:
        raw = out / f"spy-store-{workers}.txt"
        cmd = [spy, "record", "--pid", str(writers.procs[0].pid), "--rate", "100",
               "--format", "raw", "--threads", "--idle", "-o", str(raw)]  # fmt: skip
        cmd += ["--native"] if native else []
        recorder = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    row = _finish_writers(writers, dest)
    if recorder is not None and out is not None:
        recorder.wait()
        if raw.exists():
            print(f"py-spy of one store-alone process ({workers} processes):", flush=True)
            print("\n".join(spy_summary(raw)), flush=True)
            if native:
                print("\n".join(wait_summary(raw)), flush=True)
    return row


class _Writers(NamedTuple):
    procs: list
    results: Any  # the queue of their figures
    barrier: Any  # held here until they are done: they start the clock on it


def _start_writers(target, source: str, dest: Path, workers: int, *extra: object) -> _Writers:
    """``workers`` spawned processes running ``target(source, dest, index, workers, barrier,
    results, *extra)`` into a fresh store at ``dest``."""
    shutil.rmtree(dest, ignore_errors=True)
    ctx = multiprocessing.get_context("spawn")
    barrier, results = ctx.Barrier(workers), ctx.Queue()
    procs = [ctx.Process(target=target,
                         args=(source, str(dest), i, workers, barrier, results, *extra))
             for i in range(workers)]  # fmt: skip
    for p in procs:
        p.start()
    return _Writers(procs, results, barrier)


def _finish_writers(writers: _Writers, dest: Path) -> dict[str, float]:
    """The row of the processes `_start_writers` started, once they are done (`_row_figures`)."""
    got = [writers.results.get(timeout=600) for _ in writers.procs]
    for p in writers.procs:
        p.join()
    shutil.rmtree(dest, ignore_errors=True)
    return _row_figures(got)


def _server_pids() -> list[int]:
    found = subprocess.run(["pgrep", "-f", "sglang"], capture_output=True, text=True)
    return [int(p) for p in found.stdout.split() if int(p) != os.getpid()]


def server_cpu_s(pids: list[int] | None = None) -> float:
    """CPU seconds (user + system) the server's processes have used so far."""
    total = 0
    for pid in _server_pids() if pids is None else pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += int(fields[11]) + int(fields[12])  # utime, stime (after pid and comm)
    return total / os.sysconf("SC_CLK_TCK")


def idle_server_cores(seconds: float = 5.0) -> float:
    """Cores the server keeps busy while no request is in flight."""
    cpu, t0 = server_cpu_s(), time.monotonic()
    time.sleep(seconds)
    return (server_cpu_s() - cpu) / (time.monotonic() - t0)


def store_diag(args: argparse.Namespace, rows: list[dict], shm: Path) -> None:
    """Store-alone rows in memory on the run's states and on random ones of the same shape,
    with the server up and with its processes stopped (SIGSTOP): what the store-alone row's cost
    per GB depends on."""
    import signal

    got = extract(args, rows, args.disk, 8)
    source = got["store"]
    for server in ("up", "stopped"):
        pids = _server_pids() if server == "stopped" else []
        for pid in pids:
            os.kill(pid, signal.SIGSTOP)
        try:
            for states in (source, f"random:{args.prompts}"):
                row = store_alone(states, shm, args.workers)
                log(
                    args.out, row="store alone diag", server=server,
                    states="run" if states == source else "random", workers=args.workers,
                    **{**row, "tok_per_s": round(row["tok_per_s"])},
                )  # fmt: skip
        finally:
            for pid in pids:
                os.kill(pid, signal.SIGCONT)
    shutil.rmtree(source, ignore_errors=True)


def _load(url: str, rows: list[dict], conc: int, root: str, hold: bool, stop, served) -> None:
    """Requests to the server until ``stop`` is set; ``served`` sums tokens and seconds."""
    while not stop.is_set():
        served[1] += asyncio.run(plain(url, rows, conc, root, hold))
        served[0] += len(rows) * TOKENS


def store_beside_load(args: argparse.Namespace, rows: list[dict], shm: Path) -> None:
    """The store alone in memory (fed with moments, as the extraction's store is) with the server
    idle, serving without dumps, and dumping: what the server's work beside the store, and its
    dump writes into the tmpfs in particular, cost the store's rate."""
    import threading

    got = extract(args, rows, args.disk, 8)
    source = got["store"]
    loads = {"idle": None, "serving 8": (8, "", False), "dumping 1 held": (1, args.dump_dir, True),
             "dumping 8": (8, args.dump_dir, False)}  # fmt: skip
    for label, load in loads.items():
        stop, served = threading.Event(), [0.0, 0.0]
        thread = None if load is None else threading.Thread(
            target=_load, args=(args.url, rows[:32], *load, stop, served), daemon=True
        )  # fmt: skip
        if thread is not None:
            thread.start()
        cpu = server_cpu_s()
        t0 = time.monotonic()
        row = store_alone(source, shm, args.workers, moments=True)
        busy = (server_cpu_s() - cpu) / (time.monotonic() - t0)
        stop.set()
        if thread is not None:
            thread.join()
        log(
            args.out, row="store alone beside the server", server=label, workers=args.workers,
            **{**row, "tok_per_s": round(row["tok_per_s"])}, server_cores_busy=round(busy, 2),
            load_tok_per_s=round(served[0] / served[1]) if served[1] else 0,
        )  # fmt: skip
    shutil.rmtree(source, ignore_errors=True)


def _row_figures(parts: list[tuple]) -> dict[str, float]:
    """A row's rate and cost from its processes' (start, end, tokens, user s, sys s, faults)."""
    start, end = min(g[0] for g in parts), max(g[1] for g in parts)
    gb = sum(g[2] for g in parts) * ROW_BYTES / 1e9
    return {
        "tok_per_s": sum(g[2] for g in parts) / (end - start),
        "cores_busy": round(sum(g[3] + g[4] for g in parts) / (end - start), 1),
        "user_core_s_per_gb": round(sum(g[3] for g in parts) / gb, 2),
        "sys_core_s_per_gb": round(sum(g[4] for g in parts) / gb, 2),
        "minor_faults_per_gb": round(sum(g[5] for g in parts) / gb),
    }


def sweep(args: argparse.Namespace, rows: list[dict], shm: Path, concs, results) -> None:
    """``hsdump extract`` on /dev/shm with each worker count: how the client's share of the cores
    moves the end-to-end rate."""
    variants = [dict(v.split("=", 1) for v in e.split(",") if v) for e in args.sweep_env.split(";")]
    for workers in (int(w) for w in args.sweep_workers.split(",")):
        args.workers = workers
        for env in variants:
            for conc in concs:
                got = extract(args, rows, shm, conc, env)
                shutil.rmtree(got["store"], ignore_errors=True)
                log(
                    args.out, row="extract sweep", conc=conc, workers=workers, env=env, **got,
                    of_dump_only=_share(got["tok_per_s"], results.get(f"dump-{conc}")),
                )  # fmt: skip


def _share(rate: float, of: float | None) -> float | None:
    return round(rate / of, 3) if of else None


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--url", default="http://127.0.0.1:30000")
    p.add_argument("--dump-dir", required=True)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--disk", type=Path, default=Path("/tmp/kimi-disk"))
    p.add_argument("--shm", type=Path, default=Path("/dev/shm/kimi-store"), help="the memory store")
    p.add_argument("--prompts", type=int, default=96)
    p.add_argument("--workers", type=int, default=0, help="0: hsdump's default")
    p.add_argument("--concs", default="1,8,32")
    p.add_argument("--spy", default="", help="py-spy binary: record the server during dump-only")
    p.add_argument("--sweep-workers", default="", help="e.g. 2,4,8: more extract rows on /dev/shm")
    p.add_argument("--sweep-concs", default="8", help="in flight for the --sweep-workers rows")
    p.add_argument(
        "--spy-extract",
        action="store_true",
        help="with --spy, also record hsdump extract and its workers (py-spy slows them)",
    )
    p.add_argument(
        "--spy-native", action="store_true",
        help="with --spy-extract, record native frames and idle threads: who waits for the GIL",
    )  # fmt: skip
    p.add_argument("--sweep-env", default="", help='e.g. ";HSDUMP_CORES=32": a row per setting')
    p.add_argument("--sweep-first", action="store_true",
                   help="the --sweep-workers rows first, before the stage's own rows")  # fmt: skip
    p.add_argument("--only-dump", action="store_true", help="server-alone and dump-only rows only")
    p.add_argument("--store-diag", action="store_true",
                   help="after the dump-only rows: store alone in memory on the run's and on "
                   "random states, server up and stopped")  # fmt: skip
    p.add_argument("--store-beside-load", action="store_true",
                   help="after the dump-only rows: store alone in memory with the server idle, "
                   "serving and dumping")  # fmt: skip
    p.add_argument("--store-workers", default="", help="e.g. 1,2,4,8: store-alone rows in memory")
    args = p.parse_args()
    concs = [int(c) for c in args.concs.split(",")]
    args.disk.mkdir(parents=True, exist_ok=True)
    shm = args.shm
    shm.mkdir(parents=True, exist_ok=True)
    if not args.workers:
        from hsdump._cli import default_workers

        args.workers = default_workers()
    rows = dataset(TOKENS, args.prompts, 7)
    tokens = TOKENS * args.prompts
    asyncio.run(plain(args.url, dataset(512, 16, 99), 4))  # warm-up (JIT)
    results: dict[str, float] = {}
    cores = os.cpu_count() or 1
    disk = 0.0 if args.only_dump else disk_write_rate(args.disk)
    if disk:
        log(args.out, row="ceiling", what="disk write GB/s", value=round(disk, 3))
    log(args.out, row="server idle", cores_busy=round(idle_server_cores(), 2))
    log(args.out, row="host", **host_memory())
    if args.sweep_first and args.sweep_workers:  # the A/B rows before anything else
        sweep(args, rows, shm, [int(c) for c in args.sweep_concs.split(",")], results)
        args.sweep_workers = ""
    for conc in concs:
        spy = record_server(args, f"server-{conc}") if args.spy else None
        cpu = server_cpu_s()
        seconds = asyncio.run(plain(args.url, rows, conc))
        busy = (server_cpu_s() - cpu) / seconds
        print_spy(args, spy, f"server-{conc}")
        results[f"server-{conc}"] = tokens / seconds
        log(args.out, row="server alone", conc=conc, tok_per_s=round(tokens / seconds),
            server_cores_busy=round(busy, 2))  # fmt: skip
    for conc in concs:
        spy = record_server(args, f"dump-{conc}") if args.spy else None
        cpu = server_cpu_s()
        seconds = asyncio.run(plain(args.url, rows, conc, args.dump_dir))
        busy = (server_cpu_s() - cpu) / seconds
        print_spy(args, spy, f"dump-{conc}")
        results[f"dump-{conc}"] = tokens / seconds
        log(
            args.out, row="dump-only", conc=conc, tok_per_s=round(tokens / seconds),
            ratio=round(tokens / seconds / results[f"server-{conc}"], 3),
            server_cores_busy=round(busy, 2),
        )  # fmt: skip
    for conc in concs:  # the slot handed on at the response, as hsdump's client does
        cpu = server_cpu_s()
        seconds = asyncio.run(plain(args.url, rows, conc, args.dump_dir, hold=False))
        busy = (server_cpu_s() - cpu) / seconds
        log(
            args.out, row="dump-only, slot freed at the response", conc=conc,
            tok_per_s=round(tokens / seconds),
            ratio=round(tokens / seconds / results[f"server-{conc}"], 3),
            server_cores_busy=round(busy, 2),
        )  # fmt: skip
    if args.only_dump:
        return
    if args.store_diag:
        store_diag(args, rows, shm)
        return
    if args.store_beside_load:
        store_beside_load(args, rows, shm)
        return
    source = None
    for where, label in ((args.disk, "disk"), (shm, "shm")):
        for conc in concs:
            got = extract(args, rows, where, conc)
            results[f"extract-{label}-{conc}"] = got["tok_per_s"]
            log(args.out, row="extract", on=label, conc=conc, workers=args.workers, **got)
            if conc == 8 and label == "disk":
                source = got["store"]
            else:
                shutil.rmtree(got["store"], ignore_errors=True)
    assert source is not None
    verify = subprocess.run(["hsdump", "verify-store", source], capture_output=True, text=True)
    log(args.out, row="verify-store", rc=verify.returncode, said=verify.stdout.strip()[-300:])
    from hsdump import open_store

    with open_store(source, "r") as opened:
        stored_fraction = opened.bytes_stored / opened.bytes_raw
        first = opened[sorted(opened)[0]]
    bits = torch.cat([first.aux_hidden_states, first.final_hidden_state[:, None]], dim=1)
    sample = bits.contiguous().view(torch.uint16).numpy()
    rows_256mb = np.concatenate([sample] * max(1, (256 << 20) // sample.nbytes))
    codec, codec_busy = codec_rate(rows_256mb, cores)
    log(
        args.out, row="ceiling", what=f"codec GB/s on {cores} threads", value=round(codec, 3),
        cores_busy=round(codec_busy, 1),
    )  # fmt: skip
    log(args.out, row="ceiling", what="stored fraction", value=round(stored_fraction, 3))
    ceiling_disk = min(disk / stored_fraction, codec) * 1e9 / ROW_BYTES
    ceiling_shm = codec * 1e9 / ROW_BYTES
    for workers in (int(w) for w in args.store_workers.split(",") if w):
        row = store_alone(source, shm, workers, args.spy, args.out, args.spy_native)
        rate = row.pop("tok_per_s")
        log(
            args.out, row="store alone sweep", on="shm", workers=workers, tok_per_s=round(rate),
            ceiling_tok_per_s=round(ceiling_shm), ratio=round(rate / ceiling_shm, 3), **row,
        )  # fmt: skip
    for where, label, ceiling in ((args.disk, "disk", ceiling_disk), (shm, "shm", ceiling_shm)):
        for moments in (False, True):  # the store fed bytes only, and bytes with their moments
            row = store_alone(source, where, args.workers, moments=moments)
            key = f"store-{label}" + ("-moments" if moments else "")
            rate = results[key] = row.pop("tok_per_s")
            log(
                args.out, row="store alone", on=label, workers=args.workers, moments=moments,
                tok_per_s=round(rate), ceiling_tok_per_s=round(ceiling),
                ratio=round(rate / ceiling, 3), **row,
            )  # fmt: skip
    shutil.rmtree(source, ignore_errors=True)
    for label in ("disk", "shm"):
        for conc in concs:
            bound = min(results[f"server-{conc}"], results[f"store-{label}"])
            with_moments = min(results[f"server-{conc}"], results[f"store-{label}-moments"])
            log(
                args.out, row="ratio", what=f"extract/min(server, store) {label} {conc}",
                value=round(results[f"extract-{label}-{conc}"] / bound, 3),
                target=0.8 if conc == 1 else 0.9,
                against_store_with_moments=round(
                    results[f"extract-{label}-{conc}"] / with_moments, 3
                ),
            )  # fmt: skip
    if args.sweep_workers:
        sweep(args, rows, shm, [int(c) for c in args.sweep_concs.split(",")], results)


if __name__ == "__main__":
    main()
