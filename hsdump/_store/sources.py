"""Where placement reads a sample's rows from: the array itself, or the dump file beneath it.

With ``HSDUMP_DUMP_READS=file``, a dump that ingest mapped (`hsdump._mapped.MappedFile`) and handed
over unchecked (its mapping left unpopulated) is read by placement with the kernel's scattered read
(``preadv``) from the mapping's own descriptor straight into the shard's rows, not through the
mapping: no page of the dump is mapped into this process for it, so none is faulted in, walked or
torn down, and the copy runs with the interpreter lock released. Every other array (loaded states,
a sample read back from a store, a strided view), and every array under the default ``mapping``, is
copied by numpy.

On a tmpfs with 4 KB pages the kernel's read costs more per byte than numpy's copy through a
mapping already faulted in (a page-cache lookup per page): it pays only where the mapping itself
costs the process more (see docs/performance.md).

The read is libc's ``preadv`` through ctypes with the scatter list built by numpy: Python's
`os.preadv` wants a memoryview per row, thousands of Python objects per dump made with the lock
held, where the list here is one array a block.
"""

from __future__ import annotations

import ctypes
import os
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from hsdump._mapped import file_span

__all__ = ["RowSource", "SourceShrank", "row_source"]

_libc = ctypes.CDLL(None, use_errno=True)
_preadv = _libc.preadv
_preadv.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_int, ctypes.c_long]
_preadv.restype = ctypes.c_ssize_t

#: Linux's bound on one call's scatter list (``IOV_MAX``).
IOV_MAX = 1024


class SourceShrank(OSError):
    """The file under a mapped source holds fewer bytes than the rows asked of it."""


class RowSource(Protocol):
    """Rows ``[lo, lo + n)`` of a sample's ``[T, ...]`` array, copied into ``dest``."""

    def copy(self, lo: int, dest: np.ndarray) -> None:
        """Fill ``dest`` (``[n, ...]``, each row contiguous) with rows ``lo`` to ``lo + n``."""
        ...


@dataclass(frozen=True)
class _ArraySource:
    bits: np.ndarray

    def copy(self, lo: int, dest: np.ndarray) -> None:
        dest[...] = self.bits[lo : lo + dest.shape[0]]


@dataclass(frozen=True)
class _FileSource:
    fd: int
    offset: int  # of the array's first byte in the file
    row_bytes: int
    keep: np.ndarray  # the array on the mapping: the mapping, and so ``fd``, live while it does

    def copy(self, lo: int, dest: np.ndarray) -> None:
        n = dest.shape[0]
        if n and (dest[0].nbytes != self.row_bytes or not dest[0].flags.c_contiguous):
            dest[...] = self.keep[lo : lo + n]  # rows that are no one span each: numpy's copy
            return
        for first in range(0, n, IOV_MAX):
            rows = dest[first : first + IOV_MAX]
            self._read(rows, self.offset + (lo + first) * self.row_bytes)

    def _read(self, rows: np.ndarray, at: int) -> None:
        n = rows.shape[0]
        iov = np.empty((n, 2), np.uint64)  # struct iovec {void *base; size_t len}
        iov[:, 0] = rows.__array_interface__["data"][0] + np.arange(n, dtype=np.uint64) * np.uint64(
            rows.strides[0]
        )
        iov[:, 1] = self.row_bytes
        want = n * self.row_bytes
        got = _preadv(self.fd, iov.ctypes.data, n, at)
        if got == want:
            return
        if got < 0:
            code = ctypes.get_errno()
            raise OSError(code, os.strerror(code))
        self._finish(rows, at, got)

    def _finish(self, rows: np.ndarray, at: int, done: int) -> None:
        """A short read (end of file, or the kernel stopped early): the rest row by row."""
        flat = [memoryview(row).cast("B") for row in rows]
        while done < len(flat) * self.row_bytes:
            row, skip = divmod(done, self.row_bytes)
            got = os.preadv(self.fd, [flat[row][skip:]], at + done)
            if not got:
                raise SourceShrank(
                    f"the dump file ends {at + done} bytes in, short of the "
                    f"{at + len(flat) * self.row_bytes} its rows need"
                )
            done += got


def row_source(bits: np.ndarray, *, from_file: bool) -> RowSource:
    """How to read ``bits`` (``[T, ...]``) row by row: with ``from_file``, from the file under it
    where it is a C-contiguous array on a dump's mapping that ingest left unpopulated (what
    ``HSDUMP_DUMP_READS=file`` does); else from the array."""
    contiguous = bits.ndim > 0 and bits.shape[0] > 0 and bits.flags.c_contiguous
    if not (from_file and contiguous):
        return _ArraySource(bits)
    span = file_span(bits)
    if span is None:
        return _ArraySource(bits)
    fd, offset = span
    return _FileSource(fd, offset, bits.strides[0], bits)
