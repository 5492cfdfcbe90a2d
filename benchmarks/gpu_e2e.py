"""GPU benchmark: `hsdump extract` as a user times it, from launch until its data is on disk.

On one SGLang server with the plugin (a Kimi-shaped stream: 57,344 bytes a token), in one run:

- the disk's rate (``dd`` with ``oflag=direct`` on the store's file system);
- the server alone (the same prompts, rids without the opt-in prefix: nothing is dumped);
- ``hsdump extract`` into a fresh store on that disk, for each build named by ``--build``
  (``NAME=PYTHONPATH``: this checkout, and a baseline, run alternately), timed from launch until
  a ``sync`` after it exits returns.

Each extract row prints the rate the summary reported, the rate from launch to exit, the rate
from launch to data on disk, and that over ``min(server alone, disk-bound rate)``, where the
disk-bound rate is the run's tokens over the stored bytes' time at the disk's rate. Results are
appended as JSON lines to ``$OUT/e2e.jsonl``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from gpu_bench import append_record, dataset, disk_write_rate, plain

TOKENS = 2048


def log(out: Path, **record: object) -> None:
    append_record(out, "e2e.jsonl", **record)


def stored_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def extract(args: argparse.Namespace, name: str, pythonpath: str, data: Path) -> dict:
    store = args.disk / f"e2e-{name}.zarr"
    shutil.rmtree(store, ignore_errors=True)
    for leftover in args.disk.glob(f"e2e-{name}.zarr*"):
        shutil.rmtree(leftover, ignore_errors=True) if leftover.is_dir() else leftover.unlink()
    subprocess.run(["sync"], check=True)
    env = {**os.environ, "PYTHONPATH": pythonpath, "COLUMNS": "200"}
    cmd = [sys.executable, "-m", "hsdump", "extract", str(data), "--out", str(store),
           "--server-url", args.url, "--dump-dir", args.dump_dir, "--concurrency",
           str(args.conc), "--retries", "0"]  # fmt: skip
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    exited = time.perf_counter() - t0
    subprocess.run(["sync"], check=True)
    synced = time.perf_counter() - t0
    text = proc.stdout + proc.stderr
    (args.out / f"e2e_{name}.log").open("a").write(text[-4000:] + "\n")
    found = re.search(r"done: .*?([\d,]+) tokens/s", text)
    return {
        "rc": proc.returncode,
        "summary_tok_per_s": int(found.group(1).replace(",", "")) if found else 0,
        "launch_to_exit_s": round(exited, 2),
        "launch_to_sync_s": round(synced, 2),
        "stored_gb": round(stored_bytes(store) / 1e9, 3),
    }


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--url", default="http://127.0.0.1:30000")
    p.add_argument("--dump-dir", required=True)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--disk", type=Path, default=Path("/tmp/e2e-disk"))
    p.add_argument("--prompts", type=int, default=288)
    p.add_argument("--conc", type=int, default=8)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--build", action="append", default=[], help="NAME=PYTHONPATH, repeatable")
    args = p.parse_args()
    args.disk.mkdir(parents=True, exist_ok=True)
    builds = [b.split("=", 1) for b in args.build] or [["this", os.environ.get("PYTHONPATH", "")]]
    rows = dataset(TOKENS, args.prompts, 7)
    tokens = TOKENS * args.prompts
    data = args.disk / "e2e.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    asyncio.run(plain(args.url, dataset(512, 16, 99), 4))  # warm-up (JIT)
    disk = disk_write_rate(args.disk)
    log(args.out, row="disk", gb_per_s=round(disk, 3))
    alone = tokens / asyncio.run(plain(args.url, rows, args.conc))
    log(args.out, row="server alone", conc=args.conc, tok_per_s=round(alone))
    for round_ in range(args.rounds):
        for name, pythonpath in builds:
            got = extract(args, name, pythonpath, data)
            disk_bound = tokens / (got["stored_gb"] / disk) if got["stored_gb"] else 0.0
            on_disk = tokens / got["launch_to_sync_s"]
            log(
                args.out, row="extract", build=name, round=round_, conc=args.conc, **got,
                launch_to_exit_tok_per_s=round(tokens / got["launch_to_exit_s"]),
                launch_to_sync_tok_per_s=round(on_disk),
                disk_bound_tok_per_s=round(disk_bound),
                of_bound=round(on_disk / min(alone, disk_bound), 3) if disk_bound else None,
            )  # fmt: skip


if __name__ == "__main__":
    main()
