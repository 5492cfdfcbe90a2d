"""Two SGLang servers on one GPU behind one ``hsdump extract --servers``, against each alone.

Run by ``tests/gpu/run.sh two_servers`` once both servers are up (ports 30000 and 30001, dump
roots /dev/shm/hsdump-two0 and -two1). On the same 2048-token prompts and /dev/shm stores:
``hsdump extract`` into server A alone, into B alone, then into both with ``--servers``; it
prints each rate and both / (A + B) as JSON lines in ``$OUT/two_servers.jsonl``.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from bench import dataset

SERVERS = [
    {"url": "http://127.0.0.1:30000", "dump_dir": "/dev/shm/hsdump-two0"},
    {"url": "http://127.0.0.1:30001", "dump_dir": "/dev/shm/hsdump-two1"},
]


def extract(out: Path, data: Path, name: str, target: list[str], conc: int) -> dict[str, object]:
    store = Path("/dev/shm/two-servers") / name / "store.zarr"
    shutil.rmtree(store.parent, ignore_errors=True)
    store.parent.mkdir(parents=True)
    cmd = ["hsdump", "extract", str(data), "--out", str(store), "--concurrency", str(conc),
           "--retries", "0", *target]  # fmt: skip
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=500)
    text = proc.stdout + proc.stderr
    (out / "two_servers_extract.log").open("a").write(f"## {name}\n{text[-3000:]}\n")
    found = re.search(r"done: .*?([\d,]+) tokens/s", text)
    shutil.rmtree(store.parent, ignore_errors=True)
    return {
        "row": name, "rc": proc.returncode, "wall_s": round(time.perf_counter() - t0, 2),
        "tok_per_s": int(found.group(1).replace(",", "")) if found else 0,
    }  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--prompts", type=int, default=96)
    p.add_argument("--concurrency", type=int, default=8, help="per server")
    args = p.parse_args()
    data = Path("/tmp/two-servers.jsonl")
    data.write_text("".join(json.dumps(r) + "\n" for r in dataset(2048, args.prompts, 7)))
    servers = args.out / "servers.json"
    servers.write_text(json.dumps(SERVERS))
    rows = [
        extract(
            args.out,
            data,
            f"alone-{i}",
            ["--server-url", s["url"], "--dump-dir", s["dump_dir"]],
            args.concurrency,
        )
        for i, s in enumerate(SERVERS)
    ]
    rows.append(extract(args.out, data, "both", ["--servers", str(servers)], args.concurrency))
    rates = [int(str(r["tok_per_s"])) for r in rows]
    rows.append(
        {"row": "both / (A + B)", "value": round(rates[2] / max(rates[0] + rates[1], 1), 3)}
    )
    with (args.out / "two_servers.jsonl").open("a") as fh:
        for row in rows:
            print(json.dumps(row), flush=True)
            fh.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
