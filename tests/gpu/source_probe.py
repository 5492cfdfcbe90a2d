"""Placement of Kimi-sized samples from dump pages against the same bytes in private memory.

Another process writes ``SAMPLES`` dump-sized files (aux then final, as the plugin lays them out)
into ``ROOT``; then a pool of ``THREADS`` places them (`hsdump._store.shardbuf.place_sample`:
copy, CRC-32, statistics), first mapped as ingest maps them (`map_private`), then copied into
private memory beforehand. Prints GB/s and core-s per GB of each. Usage:
``python3 tests/gpu/source_probe.py ROOT THREADS SAMPLES [TOKENS]``.
"""

import json
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from hsdump._client.validate import map_private
from hsdump._store import shardbuf, stats

H, K, LAYERS = 7168, 3, [2, 4, 5, "final"]

WRITER = """
import sys, numpy as np
root, n, tokens = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
v = np.random.default_rng(0).standard_normal((tokens, 4, 7168), dtype=np.float32)
bits = (v.view(np.uint32) >> 16).astype(np.uint16)
for i in range(n):
    with open(f"{root}/d{i}", "wb") as f:
        f.write(np.ascontiguousarray(bits[:, :3]).tobytes()); f.write(bits[:, 3].tobytes())
"""


def arrays(path: Path, tokens: int, private: bool) -> tuple[np.ndarray, np.ndarray, object]:
    nbytes = tokens * (K + 1) * H * 2
    with open(path, "rb") as fh:
        mapped = map_private(fh.fileno(), nbytes)
    flat = np.frombuffer(mapped, np.uint16)
    if private:
        flat = flat.copy()
    aux = flat[: tokens * K * H].reshape(tokens, K, H)
    return aux, flat[tokens * K * H :].reshape(tokens, H), mapped


def main() -> None:
    root, threads, samples = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    tokens = int(sys.argv[4]) if len(sys.argv) > 4 else 2048
    root.mkdir(parents=True, exist_ok=True)
    subprocess.run([sys.executable, "-c", WRITER, str(root), str(samples), str(tokens)], check=True)
    ids = np.arange(tokens, dtype=np.int32)
    shards = [
        shardbuf.ShardBuffer.allocate(tokens, K + 1, H, np.dtype(np.uint16)) for _ in range(threads)
    ]
    for source in ("dump pages", "private memory", "dump pages", "private memory"):
        srcs = [arrays(root / f"d{i}", tokens, source == "private memory") for i in range(samples)]
        wall, cpu = place_all(srcs, shards, ids, tokens)
        gb = samples * tokens * (K + 1) * H * 2 / 1e9
        print(json.dumps({"source": source, "threads": threads, "gb_s": round(gb / wall, 2),
                          "core_s_per_gb": round(cpu / gb, 3)}), flush=True)  # fmt: skip


def place_all(srcs: list, shards: list, ids: np.ndarray, tokens: int) -> tuple[float, float]:
    """Place every source on a pool of one thread per shard buffer: wall and CPU seconds."""

    def place(i: int) -> None:
        aux, final, _ = srcs[i]
        piece = shardbuf.Piece(shards[i % len(shards)], 0, 0, tokens)
        rs = stats.RowStats("bfloat16", LAYERS)
        shardbuf.place_sample([piece], aux, final, ids, None, rs)

    with ThreadPoolExecutor(len(shards)) as pool:
        c0, w0 = time.process_time(), time.perf_counter()
        list(pool.map(place, range(len(srcs))))
        return time.perf_counter() - w0, time.process_time() - c0


if __name__ == "__main__":
    main()
