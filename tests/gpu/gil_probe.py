"""Placement of Kimi-sized samples from a thread pool, beside a thread running Python.

Measures the interpreter lock's toll on the store's placement jobs (copy, CRC-32, statistics,
`hsdump._store.shardbuf.place_sample`): each numpy call releases the lock, and taking it back
waits while another thread runs Python, up to the switch interval. Three rows per setting: the
pool alone, beside a thread that only runs Python, and beside one that runs Python half the time
(as an event loop that also waits). ``ROWS`` sets ``BLOCK_ROWS``, ``SWITCH`` the switch interval
in seconds. Usage: ``python3 tests/gpu/gil_probe.py THREADS SAMPLES [TOKENS]``.
"""

import json
import os
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from hsdump._store import shardbuf, stats

H, K, LAYERS = 7168, 3, [2, 4, 5, "final"]


def python_thread(stop: threading.Event, duty: float) -> None:
    """Run Python for ``duty`` of each 2 ms, and sleep (lock released) for the rest."""
    while not stop.is_set():
        end = time.perf_counter() + 0.002 * duty
        x = 0
        while time.perf_counter() < end:
            for j in range(200):
                x += j
        if duty < 1:
            time.sleep(0.002 * (1 - duty))


def main() -> None:
    threads, samples = int(sys.argv[1]), int(sys.argv[2])
    tokens = int(sys.argv[3]) if len(sys.argv) > 3 else 2048
    rows = int(os.environ.get("ROWS", stats.BLOCK_ROWS))
    stats.BLOCK_ROWS = shardbuf.BLOCK_ROWS = rows
    if os.environ.get("SWITCH"):
        sys.setswitchinterval(float(os.environ["SWITCH"]))
    values = np.random.default_rng(0).standard_normal((tokens, K + 1, H), dtype=np.float32)
    bits = (values.view(np.uint32) >> 16).astype(np.uint16)
    ids = np.arange(tokens, dtype=np.int32)
    shards = [shardbuf.ShardBuffer.allocate(tokens, K + 1, H, bits.dtype) for _ in range(threads)]

    def place(i: int) -> None:
        piece = shardbuf.Piece(shards[i % threads], 0, 0, tokens)
        rs = stats.RowStats("bfloat16", LAYERS)
        shardbuf.place_sample([piece], bits[:, :K], bits[:, K], ids, None, rs)

    for mode, duty in (("alone", 0.0), ("python", 1.0), ("half", 0.5)):
        stop = threading.Event()
        beside = threading.Thread(target=python_thread, args=(stop, duty)) if duty else None
        if beside:
            beside.start()
        with ThreadPoolExecutor(threads) as pool:
            list(pool.map(place, range(threads)))
            c0, w0 = time.process_time(), time.perf_counter()
            list(pool.map(place, range(samples)))
            wall, cpu = time.perf_counter() - w0, time.process_time() - c0
        stop.set()
        if beside:
            beside.join()
        gb = samples * bits.nbytes / 1e9
        row = {"code": os.environ.get("CODE", "."), "rows": rows,
               "switch_s": sys.getswitchinterval(), "threads": threads, "beside": mode,
               "gb_s": round(gb / wall, 2), "cores": round(cpu / wall, 2)}  # fmt: skip
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
