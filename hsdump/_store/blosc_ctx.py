"""Blosc compression through c-blosc's own context call, with the interpreter lock released
for all of it.

numcodecs' ``Blosc.encode`` compresses with the lock released, but then cuts its output to size
(``dest[:cbytes]``): a copy of every compressed byte with the lock held. A store writing a
57 KB-a-token stream runs eight compressing threads per process beside the process's event loop,
and those copies are a share of the lock's time that every other thread waits for. The same
c-blosc function numcodecs calls (``blosc_compress_ctx``, exported by numcodecs' own extension)
is called here through ctypes, which releases the lock for the call, into a buffer of the
worst-case size that the caller keeps as it is (no cut, no copy). The bytes are those numcodecs
writes: same function, same arguments.
"""

from __future__ import annotations

import ctypes
import functools
import logging
from typing import Any

import numpy as np

__all__ = ["ContextBlosc", "context_blosc"]

logger = logging.getLogger(__name__)

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
        logger.debug("blosc_compress_ctx is not exported by %s", numcodecs.blosc.__file__)
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
