"""GPU benchmark: prefill tokens/s of ``hsdump extract`` against the same requests sent by a plain
client with dumping off (rids without the opt-in prefix), side by side on one server.

``--mode plain`` sends only the plain client's requests (for a server started without the plugin).
Results are appended as JSON lines to ``$OUT/bench.jsonl``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import subprocess
import time
import uuid
from pathlib import Path

import httpx

LENGTHS = {512: 128, 2048: 32}  # prompt length -> prompts (65,536 tokens each)


def dataset(length: int, count: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    return [
        {"id": f"L{length}-{i}", "input_ids": [rng.randrange(32000) for _ in range(length)]}
        for i in range(count)
    ]


def append_record(out: Path, name: str, **record: object) -> None:
    """Print ``record`` as a JSON line and append it to ``out/name``."""
    print(json.dumps(record), flush=True)
    with (out / name).open("a") as f:
        f.write(json.dumps(record) + "\n")


def disk_write_rate(where: Path, gib: int = 4) -> float:
    """GB/s of one sequential direct write with fdatasync (``dd``) into ``where``."""
    target = where / "dd.bin"
    t0 = time.perf_counter()
    subprocess.run(
        ["dd", "if=/dev/zero", f"of={target}", "bs=64M", f"count={gib * 16}", "oflag=direct",
         "conv=fdatasync"],
        check=True, capture_output=True,
    )  # fmt: skip
    seconds = time.perf_counter() - t0
    target.unlink()
    return gib * (1 << 30) / seconds / 1e9


async def plain(
    url: str, samples: list[dict], concurrency: int, dump_dir: str = "", hold: bool = True
) -> float:
    """Seconds to prefill ``samples`` (max_new_tokens 0). With ``dump_dir``, the rids opt in and
    each request also waits for its dump's ``done`` marker and then deletes the dump (the server
    side of the dump path alone, without the hsdump client's validation and store). ``hold``
    False hands the request's slot on at the response, as hsdump's client does, and waits for the
    dump after it: the server's rate while it dumps, at that many requests in flight."""
    sem = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(timeout=300) as client:

        async def one(s: dict) -> None:
            rid = f"{'hsdump' if dump_dir else 'plain'}-{uuid.uuid4().hex}"
            body = {
                "rid": rid,
                "input_ids": s["input_ids"],
                "sampling_params": {"max_new_tokens": 0, "temperature": 0},
                "extra_key": uuid.uuid4().hex,
            }
            async with sem:
                (await client.post(f"{url}/generate", json=body)).raise_for_status()
                if dump_dir and hold:
                    await consume(Path(dump_dir) / f"req_{rid}")
            if dump_dir and not hold:
                await consume(Path(dump_dir) / f"req_{rid}")

        t0 = time.perf_counter()
        await asyncio.gather(*(one(s) for s in samples))
        return time.perf_counter() - t0


async def consume(path: Path, keep: Path | None = None) -> None:
    """Wait for the dump at ``path`` to be published, then delete it, or move it into ``keep``
    (a rename on the same filesystem, so its pages stay as the server wrote them)."""
    while not (path / "done").exists():
        if (path / "error").exists():
            raise RuntimeError((path / "error").read_text())
        await asyncio.sleep(0.002)
    if keep is None:
        await asyncio.to_thread(shutil.rmtree, path)
    else:
        os.rename(path, keep / path.name)


def extract(
    url: str, dump_dir: str, samples: list[dict], concurrency: int, out: Path, tag: str
) -> float:
    work = Path(f"/tmp/bench_{tag}")
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    (work / "data.jsonl").write_text("".join(json.dumps(s) + "\n" for s in samples))
    cmd = [
        "hsdump", "extract", str(work / "data.jsonl"), "--out", str(work / "store"),
        "--server-url", url, "--dump-dir", dump_dir, "--concurrency", str(concurrency),
    ]  # fmt: skip
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    seconds = time.perf_counter() - t0
    (out / "bench_extract.log").open("a").write(
        f"## {tag}\n{proc.stdout[-2000:]}{proc.stderr[-2000:]}\n"
    )
    if proc.returncode != 0:
        raise RuntimeError(f"hsdump extract failed ({proc.returncode}): {proc.stderr[-1500:]}")
    shutil.rmtree(work, ignore_errors=True)
    return seconds


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--url", default="http://127.0.0.1:30000")
    p.add_argument("--dump-dir", default="")
    p.add_argument("--mode", choices=["extract", "dump", "plain"], default="extract")
    p.add_argument("--server", required=True, help="label of the server configuration")
    p.add_argument("--out", required=True)
    args = p.parse_args()
    out = Path(args.out)
    asyncio.run(plain(args.url, dataset(512, 16, 99), 4))  # warm-up (JIT)
    chosen = os.environ.get("HSDUMP_BENCH_LENGTHS")  # e.g. "2048": a shorter run
    for length, count in LENGTHS.items():
        if chosen and str(length) not in chosen.split(","):
            continue
        samples = dataset(length, count, length)
        tokens = length * count
        for conc in (1, 8):
            rows = [("plain", asyncio.run(plain(args.url, samples, conc)))]
            if args.mode == "dump":
                seconds = asyncio.run(plain(args.url, samples, conc, args.dump_dir))
                rows.append(("dump-only", seconds))
            if args.mode == "extract":
                rows.append(
                    (
                        "extract",
                        extract(args.url, args.dump_dir, samples, conc, out, f"{length}-{conc}"),
                    )
                )
            for client, seconds in rows:
                rec = {
                    "server": args.server, "client": client, "len": length, "concurrency": conc,
                    "tokens": tokens, "seconds": round(seconds, 3),
                    "tok_per_s": round(tokens / seconds),
                }  # fmt: skip
                print(json.dumps(rec), flush=True)
                with (out / "bench.jsonl").open("a") as f:
                    f.write(json.dumps(rec) + "\n")


if __name__ == "__main__":
    main()
