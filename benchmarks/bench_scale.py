"""Scale-out: does the rate grow with the servers when each server has its own worker?

Runs, one after the other in one run, ``run_parallel_extraction(servers=...)`` over 1, 2 and 3
fake servers (hsdump.testing's FakeServer, each in a process of its own as a real server is, each
with its own dump root and a fixed time per request), one worker process per server, with the
same number of samples per server (so each row takes about the same wall time). Per row: tokens/s,
scaling efficiency (rate_n / (n * rate_1); 1.0 is linear), the cores the client side kept busy
(workers and parent: ``ExtractionSummary.cores_busy``) and those the servers used.

Each fake server alone can serve ``concurrency * tokens / latency`` tokens/s, so a row falls short
of linear only when the client side (or the host) runs out of cores. The target (efficiency at
least 0.8) is judged only on hosts with 4 cores per server; a smaller host prints its figures.

    python benchmarks/bench_scale.py [--quick] [--strict]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from hsdump import ExtractionSummary, RunOptions, Sample, run_parallel_extraction

sys.path.insert(0, str(Path(__file__).parent))
from bench_pipeline import LAYERS, Server, fake_server_process, process_cpu_s, samples

CMD = "python benchmarks/bench_scale.py"
TARGET = 0.8
CORES_PER_SERVER = 4


@contextlib.contextmanager
def fake_servers(
    root: Path, count: int, hidden: int, latency: float, tokens: int
) -> Iterator[list[Server]]:
    """``count`` FakeServers, each in a child process with its own dump root."""
    with contextlib.ExitStack() as stack:
        yield [
            stack.enter_context(fake_server_process(root / f"dumps{i}", hidden, latency, tokens))
            for i in range(count)
        ]


def run_row(servers: list[Server], batch: list[Sample], store: Path, concurrency: int) -> tuple[
    ExtractionSummary, float
]:  # fmt: skip
    """One extraction over ``servers``; its summary and the servers' CPU seconds per second."""
    before = [process_cpu_s(s.pid) for s in servers]
    started = time.perf_counter()
    summary = run_parallel_extraction(
        batch, servers=[(s.url, s.dump_dir) for s in servers], store=store, workers=1,
        options=RunOptions(concurrency=concurrency),
    )  # fmt: skip
    wall = time.perf_counter() - started
    server_cpu = sum(process_cpu_s(s.pid) - b for s, b in zip(servers, before, strict=True))
    assert summary.ok and summary.samples_done == len(batch), summary
    return summary, server_cpu / wall


def main(quick: bool) -> int:
    per_server, tokens, hidden = (16, 512, 1024) if quick else (48, 1024, 1024)
    latency, concurrency, counts = 0.1, 2, (1, 2, 3)
    row = (len(LAYERS) + 1) * hidden * 2
    cores = os.cpu_count() or 1
    print(
        f"# hsdump scale-out benchmark ({'quick' if quick else 'full'}): {per_server} samples x "
        f"{tokens} tokens per server, K={len(LAYERS)}, H={hidden}, bf16 "
        f"({per_server * tokens * row / 1e6:.0f} MB raw per server); fake servers in their own "
        f"processes, {latency * 1e3:.0f} ms per request, {concurrency} in flight each, one "
        f"worker per server; {cores} CPUs"
    )
    print(f"# reproduce: {CMD}{' --quick' if quick else ''}\n")
    print(f"one server alone can serve {concurrency * tokens / latency:,.0f} tok/s\n")
    print(
        "| servers | tok/s | MB/s | efficiency | client cores busy | server cores busy | target |"
    )
    print("|---|---|---|---|---|---|---|")
    root = Path(tempfile.mkdtemp(prefix="hsdump-bench-scale-", dir=_shm()))
    work = Path(tempfile.mkdtemp(prefix="hsdump-bench-scale-"))
    missed, rate_1 = 0, 0.0
    try:
        with fake_servers(root, max(counts), hidden, latency, tokens) as servers:
            for n in counts:
                store = work / f"n{n}.zarr"
                summary, server_busy = run_row(
                    servers[:n], samples(per_server * n, tokens), store, concurrency
                )
                shutil.rmtree(store, ignore_errors=True)
                rate = summary.tokens_per_s
                rate_1 = rate_1 or rate
                efficiency = rate / (n * rate_1)
                judged = cores >= CORES_PER_SERVER * n
                verdict = ("met" if efficiency >= TARGET else "MISSED") if judged else "not judged"
                missed += judged and efficiency < TARGET
                print(
                    f"| {n} | {rate:,.0f} | {summary.bytes_per_s / 1e6:,.0f} | {efficiency:.2f} "
                    f"| {summary.cores_busy:.2f} | {server_busy:.2f} | >= {TARGET}: {verdict} |"
                )
    finally:
        for d in (root, work):
            shutil.rmtree(d, ignore_errors=True)
    return 1 if missed else 0


def _shm() -> str | None:
    return "/dev/shm" if os.access("/dev/shm", os.W_OK) else None


if __name__ == "__main__":
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="smaller run (about a minute)")
    parser.add_argument("--strict", action="store_true", help="exit 1 when a target is missed")
    options = parser.parse_args()
    failed = main(options.quick)
    sys.exit(failed if options.strict else 0)
