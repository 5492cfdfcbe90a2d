"""The store's codec from a thread pool, through numcodecs' ``Blosc`` and through the same
c-blosc call made with ctypes, alone and beside a thread that runs Python half of each 2 ms (as
a worker's event loop does).

numcodecs' ``Blosc.encode`` compresses with the interpreter lock released, then cuts its output
to size (``dest[:cbytes]``), a copy of the compressed bytes with the lock held. ``ContextBlosc``
calls ``blosc_compress_ctx`` (exported by numcodecs' extension) through ctypes, which releases the
lock for the whole call, into a buffer it keeps as it is; its bytes are numcodecs' bytes. On the
H200 host it changed the pool's rate by -5% to +15% (docs/performance.md), so the store keeps
numcodecs.

Prints GB/s of the pool and how many 2 ms rounds the Python thread got through, one JSON line a
row, each setting measured twice in turn. Usage: ``python3 tests/gpu/codec_probe.py [THREADS...]``.
"""

import ctypes
import functools
import json
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numcodecs.blosc
import numpy as np
from numcodecs import Blosc

_MAX_OVERHEAD = 16  # BLOSC_MAX_OVERHEAD: what compression may add to incompressible input
_AUTOSHUFFLE, _SHUFFLE, _BITSHUFFLE = -1, 1, 2


@functools.cache
def _compress_ctx() -> Any:
    """c-blosc's ``blosc_compress_ctx`` from numcodecs' extension, or None where it is not
    exported (another build of numcodecs)."""
    import numcodecs.blosc

    try:
        fn = ctypes.CDLL(numcodecs.blosc.__file__).blosc_compress_ctx
    except (OSError, AttributeError):
        return None
    fn.restype = ctypes.c_int
    fn.argtypes = [
        ctypes.c_int, ctypes.c_int, ctypes.c_size_t, ctypes.c_size_t, ctypes.c_void_p,
        ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p, ctypes.c_size_t, ctypes.c_int,
    ]  # fmt: skip
    return fn


class ContextBlosc:
    """``encode`` as numcodecs' ``Blosc(cname, clevel, shuffle, blocksize).encode`` on one thread,
    returning a view of the compressed bytes."""

    def __init__(self, fn: Any, *, cname: str, clevel: int, shuffle: int, blocksize: int):
        self._fn, self._cname = fn, cname.encode("ascii")
        self._clevel, self._shuffle, self._blocksize = clevel, shuffle, blocksize

    def encode(self, data: np.ndarray) -> memoryview:
        """The Blosc frame of C-contiguous ``data``."""
        shuffle = self._shuffle
        if shuffle == _AUTOSHUFFLE:
            shuffle = _BITSHUFFLE if data.itemsize == 1 else _SHUFFLE
        out = np.empty(data.nbytes + _MAX_OVERHEAD, np.uint8)
        size = self._fn(
            self._clevel, shuffle, data.itemsize, data.nbytes, data.ctypes.data,
            out.ctypes.data, out.nbytes, self._cname, self._blocksize, 1,
        )  # fmt: skip
        if size <= 0:
            raise RuntimeError(f"error during blosc compression: {size}")
        return memoryview(out)[:size]


def context_blosc(cname: str, clevel: int, shuffle: int, blocksize: int) -> ContextBlosc | None:
    """A `ContextBlosc` with these settings, or None where numcodecs' extension does not export
    the function (callers then use numcodecs' ``Blosc``)."""
    fn = _compress_ctx()
    if fn is None:
        return None
    return ContextBlosc(fn, cname=cname, clevel=clevel, shuffle=shuffle, blocksize=blocksize)


H, LAYERS = 7168, 4


def chunks(n: int) -> list[np.ndarray]:
    """Chunks of the store's size of bf16 bits with the spread of hidden states."""
    rng = np.random.default_rng(0)
    ct = 64  # the store's chunk for 57,344-byte rows (`chunk_tokens_for`): 3.7 MB
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
