"""The store's codec from a thread pool, through numcodecs' ``Blosc`` and through
`hsdump._store.blosc_ctx` (the same c-blosc call with the interpreter lock released throughout),
alone and beside a thread that runs Python half of each 2 ms (as a worker's event loop does).

Prints GB/s of the pool and how many 2 ms rounds the Python thread got through, one JSON line a
row, each setting measured twice in turn. Usage: ``python3 tests/gpu/codec_probe.py [THREADS...]``.
"""

import json
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numcodecs.blosc
import numpy as np
from numcodecs import Blosc

from hsdump._store.blosc_ctx import context_blosc
from hsdump._store.codecs import chunk_tokens_for

H, LAYERS = 7168, 4


def chunks(n: int) -> list[np.ndarray]:
    """Chunks of the store's size of bf16 bits with the spread of hidden states."""
    rng = np.random.default_rng(0)
    ct = chunk_tokens_for(LAYERS * H * 2, 4096)
    values = rng.standard_normal((n * ct, LAYERS, H), dtype=np.float32) * 0.5
    bits = (values.view(np.uint32) >> 16).astype(np.uint16)
    return [bits[i * ct : (i + 1) * ct] for i in range(n)]


def row(encode, data: list[np.ndarray], threads: int, beside: bool) -> dict:
    stop, rounds = threading.Event(), [0]

    def python() -> None:
        while not stop.is_set():
            python_thread_once()
            rounds[0] += 1

    def python_thread_once() -> None:
        end = time.perf_counter() + 0.001
        x = 0
        while time.perf_counter() < end:
            for j in range(200):
                x += j
        time.sleep(0.001)

    helper = threading.Thread(target=python) if beside else None
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(encode, data[:threads]))
        if helper:
            helper.start()
        t0 = time.perf_counter()
        for _ in range(3):
            list(pool.map(encode, data))
        seconds = time.perf_counter() - t0
    stop.set()
    if helper:
        helper.join()
    gb = 3 * sum(c.nbytes for c in data) / 1e9
    return {"gb_per_s": round(gb / seconds, 3), "python_rounds_per_s": round(rounds[0] / seconds)}


def main() -> None:
    numcodecs.blosc.use_threads = False
    counts = [int(t) for t in sys.argv[1:]] or [8, 16]
    data = chunks(96)
    ref = Blosc(cname="zstd", clevel=1, shuffle=Blosc.SHUFFLE, blocksize=1 << 20)
    ctx = context_blosc("zstd", 1, Blosc.SHUFFLE, 1 << 20)
    assert ctx is not None, "numcodecs' extension exports no blosc_compress_ctx here"
    assert bytes(ctx.encode(data[0])) == bytes(ref.encode(data[0]))
    for threads in counts:
        for beside in (False, True):
            for _ in range(2):
                for name, encode in (("numcodecs", ref.encode), ("context", ctx.encode)):
                    got = row(encode, data, threads, beside)
                    print(json.dumps({"codec": name, "threads": threads, "beside": beside, **got}),
                          flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
