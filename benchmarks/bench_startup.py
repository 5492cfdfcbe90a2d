"""Start-up and exit: the fixed cost of an ``hsdump extract`` run, as a user launches it.

Launches ``hsdump extract`` (the console script, in a process of its own) against a server that is
already up and times, from outside, what the user waits for:

- launch to first commit: from the launch until a part's ``zarr.json`` (the store's commit point)
  first says a sample is committed;
- last commit to exit: from the commit that makes the last sample visible until the process exits
  (summary, flush, teardown, worker processes);
- launch to exit;
- the CPU seconds of the run's processes (the figure that a busy host does not move), and the
  store parts it wrote (one per worker process, so what the default chose).

The store is only read, by polling its parts' ``zarr.json`` every few milliseconds (the figures are
good to that step); the run itself is not changed. Each worker count (``--workers 1``, the
default, and any others asked for) runs in turn, round after round, into a fresh store each time,
after one untimed launch that warms the page cache; the figures are medians.

The server is the fake server of hsdump.testing in a process of its own, answering at once, or a
given ``--server-url`` and ``--dump-dir`` (a real SGLang server). The dataset is generated: token
ids below the vocabulary size the server reports (else below 1000, which every vocabulary holds).

Targets: at most 1.5 s to the first commit against a ready server (judged against a given server,
the GPU host's), and a default worker count no slower than one worker (launch to exit, within 10%).

    python benchmarks/bench_startup.py [--quick] [--strict] [--workers 1,default,2]
        [--server-url URL --dump-dir DIR] [--samples N] [--tokens L] [--rounds R]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from bench_pipeline import fake_server_process

CMD = "python benchmarks/bench_startup.py"
FIRST_COMMIT_TARGET_S = 1.5
DEFAULT_MARGIN = 1.1  # the default may take 10% longer than one worker: run-to-run noise
POLL_S = 0.005
FALLBACK_VOCAB = 1000


@dataclass(frozen=True)
class Launch:
    """One timed run: seconds from the launch to the first and last commits and to the exit, and
    the CPU seconds of the run's processes (its workers too)."""

    first: float
    last: float
    exit: float
    cpu: float
    parts: tuple[str, ...]  # the store parts it wrote: one per worker process, else "default"

    @property
    def tail(self) -> float:
        return self.exit - self.last


def hsdump_command() -> list[str]:
    """The ``hsdump`` console script next to this interpreter, else ``python -m hsdump``."""
    script = Path(sys.executable).parent / "hsdump"
    return [str(script)] if script.exists() else [sys.executable, "-m", "hsdump"]


def committed(store: Path, seen: dict[Path, tuple[tuple[int, int], int]]) -> int:
    """Samples committed over all parts of ``store``, per their ``zarr.json`` (read if changed)."""
    total = 0
    for meta in store.glob("part-*/zarr.json"):
        try:
            stat = meta.stat()
            key = (stat.st_mtime_ns, stat.st_size)
            if meta not in seen or seen[meta][0] != key:
                attrs = json.loads(meta.read_bytes()).get("attributes", {})
                seen[meta] = (key, int(attrs.get("committed_samples", 0)))
        except (OSError, ValueError):
            continue  # replaced under us: the next poll reads it
        total += seen[meta][1]
    return total


def launch(args: list[str], store: Path, expected: int) -> Launch:
    """Run ``args`` once, polling ``store``; the times of its first and last commits and exit."""
    seen: dict[Path, tuple[tuple[int, int], int]] = {}
    first = last = None
    count = 0
    cpu = resource.getrusage(resource.RUSAGE_CHILDREN)
    with tempfile.TemporaryFile() as log:  # not a pipe: a full pipe would stall the run
        started = time.perf_counter()
        child = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=log)
        while True:
            code = child.poll()
            now = time.perf_counter() - started
            total = committed(store, seen)  # a commit seen now came before `now`
            if total > count:
                count, last = total, now
                first = now if first is None else first
            if code is not None:
                break
            time.sleep(POLL_S)
        after = resource.getrusage(resource.RUSAGE_CHILDREN)  # the run's tree: it reaps workers
        log.seek(0)
        stderr = log.read().decode(errors="replace")
    if code != 0 or count != expected or first is None or last is None:
        raise SystemExit(
            f"{' '.join(args)}\nexited {code} with {count} of {expected} samples committed:\n"
            f"{stderr}"
        )
    used = after.ru_utime + after.ru_stime - cpu.ru_utime - cpu.ru_stime
    parts = tuple(sorted(p.name for p in store.glob("part-*")))
    return Launch(first=first, last=last, exit=now, cpu=used, parts=parts)


def vocab_size(url: str) -> int:
    """The vocabulary size ``url`` reports in /server_info, else `FALLBACK_VOCAB`."""
    try:
        info = httpx.get(f"{url.rstrip('/')}/server_info", timeout=30).json()
        return int(info.get("vocab_size") or FALLBACK_VOCAB)
    except (httpx.HTTPError, ValueError, AttributeError):
        return FALLBACK_VOCAB


def write_dataset(path: Path, samples: int, tokens: int, vocab: int) -> None:
    rng = np.random.default_rng(0)
    with path.open("w") as out:
        for i in range(samples):
            ids = rng.integers(1, vocab, tokens).tolist()
            out.write(json.dumps({"id": f"s{i:05d}", "input_ids": ids}) + "\n")


@contextlib.contextmanager
def server(
    url: str | None, dump_dir: Path | None, hidden: int, tokens: int
) -> Iterator[tuple[str, Path, str]]:
    """The given server, or a fake one that answers at once; (url, dump root, its description)."""
    if url is not None:
        yield url, dump_dir, f"the server at {url}"
        return
    shm = "/dev/shm" if os.access("/dev/shm", os.W_OK) else None
    root = Path(tempfile.mkdtemp(prefix="hsdump-bench-startup-", dir=shm))
    try:
        with fake_server_process(root, hidden, 0.0, tokens) as fake:
            described = f"the fake server (H={hidden}) in its own process, answering at once"
            yield fake.url, root, described
    finally:
        shutil.rmtree(root, ignore_errors=True)


def row(name: str, runs: list[Launch]) -> str:
    med = {
        k: statistics.median(getattr(r, k) for r in runs) for k in ("first", "tail", "exit", "cpu")
    }
    spread = f"{min(r.exit for r in runs):.2f}-{max(r.exit for r in runs):.2f}"
    parts = "/".join(str(n) for n in sorted({len(r.parts) for r in runs}))
    return (
        f"| {name} | {parts} | {med['first']:.2f} | {med['tail']:.2f} | {med['exit']:.2f} "
        f"({spread}) | {med['cpu']:.2f} |"
    )


def main(options: argparse.Namespace) -> int:
    quick = options.quick
    samples = options.samples or (4 if quick else 16)
    tokens = options.tokens or (1024 if quick else 2048)
    rounds = options.rounds or (2 if quick else 5)
    variants = [w.strip() for w in options.workers.split(",") if w.strip()]
    work = Path(tempfile.mkdtemp(prefix="hsdump-bench-startup-", dir=options.work_dir))
    given = options.server_url is not None
    try:
        with server(options.server_url, options.dump_dir, options.hidden, tokens) as (
            url, dump_dir, described,
        ):  # fmt: skip
            vocab = vocab_size(url)
            dataset = work / "data.jsonl"
            write_dataset(dataset, samples, tokens, vocab)
            print(
                f"# hsdump start-up benchmark ({'quick' if quick else 'full'}): `hsdump extract` "
                f"launched as a user does, {samples} samples x {tokens} tokens (ids below "
                f"{vocab}), against {described}; store in {work}; {os.cpu_count()} CPUs; "
                f"{rounds} rounds, medians"
            )
            print(f"# reproduce: {CMD} {' '.join(sys.argv[1:])}".rstrip() + "\n")
            base = [*hsdump_command(), "extract", str(dataset), "--server-url", url,
                    "--dump-dir", str(dump_dir)]  # fmt: skip

            def once(variant: str, tag: str) -> Launch:
                store = work / f"{tag}.zarr"
                flags = [] if variant == "default" else ["--workers", variant]
                try:
                    return launch([*base, "--out", str(store), *flags], store, samples)
                finally:
                    shutil.rmtree(store, ignore_errors=True)
                    Path(f"{store}.failures.jsonl").unlink(missing_ok=True)

            once(variants[0], "warm-up")
            runs: dict[str, list[Launch]] = {v: [] for v in variants}
            for r in range(rounds):
                for v in variants:
                    runs[v].append(once(v, f"r{r}-w{v}"))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(
        "| --workers | store parts | launch to first commit s | last commit to exit s | launch to "
        "exit s (range) | CPU s |"
    )
    print("|---|---|---|---|---|---|")
    for v in variants:
        print(row(v, runs[v]))
    return verdicts(runs, judge_first=given)


def verdicts(runs: dict[str, list[Launch]], *, judge_first: bool) -> int:
    missed = 0
    first = min(statistics.median(r.first for r in rs) for rs in runs.values())
    ok = first <= FIRST_COMMIT_TARGET_S
    judged = "met" if ok else "MISSED"
    missed += judge_first and not ok
    print(
        f"\nlaunch to first commit (best median) {first:.2f} s; target <= "
        f"{FIRST_COMMIT_TARGET_S} s against a ready server: "
        f"{judged if judge_first else 'judged on the GPU host (--server-url)'}"
    )
    if "1" in runs and "default" in runs:
        one = statistics.median(r.exit for r in runs["1"])
        default = statistics.median(r.exit for r in runs["default"])
        same = {r.parts for r in runs["default"]} == {r.parts for r in runs["1"]}
        ok = same or default <= one * DEFAULT_MARGIN
        missed += not ok
        verdict = "met (the default is one worker here)" if same else "met" if ok else "MISSED"
        print(
            f"default workers {default:.2f} s against one worker {one:.2f} s, launch to exit; "
            f"target: no slower (within {DEFAULT_MARGIN - 1:.0%}): {verdict}"
        )
    return missed


if __name__ == "__main__":
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="fewer, smaller runs (under a minute)")
    parser.add_argument("--strict", action="store_true", help="exit 1 when a target is missed")
    parser.add_argument(
        "--workers", default="1,default", help="worker counts to compare, 'default' for none given"
    )
    parser.add_argument("--server-url", help="a running server (default: a fake one)")
    parser.add_argument("--dump-dir", type=Path, help="that server's dump root")
    parser.add_argument("--samples", type=int, help="samples in the dataset (16; quick 4)")
    parser.add_argument("--tokens", type=int, help="tokens per sample (2048; quick 1024)")
    parser.add_argument("--rounds", type=int, help="timed launches per worker count (5; quick 2)")
    parser.add_argument("--hidden", type=int, default=1024, help="the fake server's hidden size")
    parser.add_argument("--work-dir", help="where the stores go (default: the temp directory)")
    options = parser.parse_args()
    if (options.server_url is None) != (options.dump_dir is None):
        parser.error("--server-url and --dump-dir go together")
    missed = main(options)
    sys.exit(1 if missed and options.strict else 0)
