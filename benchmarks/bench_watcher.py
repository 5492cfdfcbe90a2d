"""Wake-up latency and idle cost of each DumpWatcher (inotify, poll, watchfiles).

For each watcher: a task waits for a request; a thread publishes its dump (renamed into place, as
the server's plugin does) a few milliseconds later, at a random point of a poll's back-off; the
latency is from the rename to the waiting task resuming. Then the CPU the process uses while one
wait blocks with nothing published (the watcher's idle cost).

    python benchmarks/bench_watcher.py [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import random
import shutil
import tempfile
import threading
import time
import uuid
from pathlib import Path

import numpy as np

from hsdump import DumpTimeout
from hsdump._client.watcher import default_watcher
from hsdump._protocol import request_dir
from hsdump.testing import publish

CMD = "python benchmarks/bench_watcher.py"
KINDS = ("inotify", "poll", "watchfiles")


async def wake_latency(kind: str, root: Path, n: int) -> list[float]:
    """Milliseconds from a dump's rename into place to the waiting task resuming."""
    watcher = default_watcher(root, kind)
    rng = random.Random(0)
    lat = []
    for _ in range(n):
        rid = f"hsdump-wake-{uuid.uuid4().hex[:12]}"
        published: list[float] = []

        def producer(
            rid: str = rid, delay: float = rng.uniform(0.001, 0.03), out: list[float] = published
        ) -> None:
            time.sleep(delay)
            publish(root, rid)
            out.append(time.perf_counter())

        thread = threading.Thread(target=producer)
        thread.start()
        await watcher.wait(rid, 5)
        woke = time.perf_counter()
        thread.join()
        lat.append((woke - published[0]) * 1e3)
        shutil.rmtree(request_dir(root, rid))
    await watcher.aclose()
    return lat


async def idle_cpu(kind: str, root: Path, seconds: float) -> float:
    """Percent of one core the process uses while a wait blocks and nothing is published."""
    watcher = default_watcher(root, kind)
    rid = f"hsdump-warm-{uuid.uuid4().hex[:12]}"
    publish(root, rid)
    await watcher.wait(rid, 5)  # started
    cpu, wall = time.process_time(), time.perf_counter()
    with contextlib.suppress(DumpTimeout):
        await watcher.wait(f"hsdump-idle-{uuid.uuid4().hex[:12]}", seconds)
    used = (time.process_time() - cpu) / (time.perf_counter() - wall)
    await watcher.aclose()
    return used * 100


async def main(quick: bool) -> None:
    n, idle_s = (100, 1.0) if quick else (400, 3.0)
    print(f"# watcher wake-up latency: {n} dumps each, renamed into place in /dev/shm")
    print(f"# reproduce: {CMD}{' --quick' if quick else ''}\n")
    print("| watcher | wake-up p50 ms | p99 ms | idle CPU % of a core |")
    print("|---|---|---|---|")
    root = Path(tempfile.mkdtemp(prefix="hsdump-wake-", dir="/dev/shm"))
    try:
        for kind in KINDS:
            lat = await wake_latency(kind, root, n)
            p50, p99 = np.percentile(lat, 50), np.percentile(lat, 99)
            cpu = await idle_cpu(kind, root, idle_s)
            print(f"| {kind} | {p50:.3f} | {p99:.3f} | {cpu:.1f} |")
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="100 dumps per watcher, not 400")
    asyncio.run(main(parser.parse_args().quick))
