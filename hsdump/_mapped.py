"""Tensors another process can map: the pages of a dump, handed over as a file descriptor.

A dump that ingest maps (`hsdump._client.validate.map_private`) is a `MappedFile`: the mapping
keeps a descriptor of its file, and this module knows it by address. `share` finds the mapping a
tensor lies in and describes the tensor by that descriptor, its offset and its strides, so a store
process maps the same pages (`attach`) instead of receiving a copy: the dump's bytes are read from
memory once more, never copied between processes. A tensor on no known mapping is copied into an
anonymous memory file first (a copy, but still no pickled bytes).

The descriptor outlives the dump's removal: a removed tmpfs file's pages stay until the last
descriptor and mapping on them are gone. Closing that last descriptor frees the pages, which takes
the kernel 13 ms for a 117 MB dump on a tmpfs with 4 KB pages (2 cores): a mapping's descriptor is
closed in a thread of this module's own (`released` waits for it), not in whichever thread drops
the last array on the dump, which is often the event loop or one of the store's codec threads.
"""

from __future__ import annotations

import ctypes
import math
import mmap
import os
import threading
import weakref
from collections.abc import Iterable
from dataclasses import dataclass
from queue import SimpleQueue
from typing import TYPE_CHECKING

import numpy as np

from hsdump._protocol import dtype_of_torch, dtype_spec

if TYPE_CHECKING:
    import torch

__all__ = [
    "MappedFile",
    "SharedTensor",
    "attach",
    "file_span",
    "populate",
    "populate_rows",
    "released",
    "share",
]

# Linux's madvise advice that faults a mapping's pages in for reading (not in Python 3.11's mmap).
MADV_POPULATE_READ = getattr(mmap, "MADV_POPULATE_READ", 22)

_libc = ctypes.CDLL(None, use_errno=True)
_madvise = _libc.madvise
_madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_madvise.restype = ctypes.c_int

_lock = threading.Lock()
_known: dict[int, weakref.ref[MappedFile]] = {}  # start address -> mapping
# The process the closing thread runs in, and the queue it takes descriptors from.
_closer: tuple[int, SimpleQueue[tuple[int, int] | threading.Event]] | None = None
_close = os.close


class MappedFile(mmap.mmap):
    """A copy-on-write mapping of a file that keeps a descriptor of the file while it lives."""

    fd: int
    address: int
    populated: bool  # False where its pages were left for the reader to fault in or read

    @classmethod
    def of(cls, fd: int, nbytes: int) -> MappedFile:
        """Map the first ``nbytes`` of ``fd`` copy-on-write and register the mapping.

        Raises:
            OSError, ValueError: The file cannot be mapped.
        """
        _start_closer()  # here, not in the finalizer: starting a thread takes locks
        mapped = cls(fd, nbytes, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        mapped.address = _address_of(mapped)
        mapped.fd = os.dup(fd)
        mapped.populated = True
        with _lock:
            _known[mapped.address] = weakref.ref(mapped)
        weakref.finalize(mapped, _forget, mapped.address, mapped.fd)
        return mapped


def _address_of(mapped: mmap.mmap) -> int:
    pointer = ctypes.c_char.from_buffer(mapped)  # exports the buffer only for this call
    try:
        return ctypes.addressof(pointer)
    finally:
        del pointer


def populate(mapped: mmap.mmap, advice: int = MADV_POPULATE_READ) -> None:
    """Fault every page of ``mapped`` in (``advice``, by default ``MADV_POPULATE_READ``) with the
    interpreter lock released: Python's own `mmap.mmap.madvise` holds it for the whole call, which
    on a tmpfs with 4 KB pages is 7-28 ms for a 117 MB dump, while the store's codec threads and
    the event loop wait.

    Raises:
        OSError: The kernel refused: ``EFAULT`` where the file no longer covers the mapping,
            ``EINVAL`` where it lacks the advice (Linux before 5.14).
    """
    address = mapped.address if isinstance(mapped, MappedFile) else _address_of(mapped)
    _advise(address, len(mapped), advice)


def _advise(address: int, length: int, advice: int) -> None:
    """libc's madvise, which ctypes calls with the interpreter lock released; raises its errno."""
    if _madvise(address, length, advice) != 0:
        code = ctypes.get_errno()
        raise OSError(code, os.strerror(code))


def populate_rows(bits: np.ndarray, rows: Iterable[int]) -> None:
    """Fault in the pages under ``rows`` of ``bits`` where it lies on a `MappedFile` left
    unpopulated, which also proves the file still covers them: touching a page past a file cut
    short would raise SIGBUS. Any other array is left as it is.

    Raises:
        OSError: ``EFAULT`` where the file no longer covers a row.
    """
    if _unpopulated_mapping_of(bits) is None:
        return
    base = bits.__array_interface__["data"][0]
    page = mmap.PAGESIZE
    for row in rows:
        start = base + int(row) * bits.strides[0]
        first = start - start % page
        end = start + (bits[row].nbytes if bits.ndim > 1 else bits.itemsize)
        _advise(first, end - first, MADV_POPULATE_READ)


def file_span(bits: np.ndarray) -> tuple[int, int] | None:
    """The descriptor of the file under ``bits`` where it lies on a `MappedFile` left
    unpopulated (its reader reads the file, not the mapping), and the offset of its first byte in
    that file; None for any other array. The descriptor is the mapping's own: it stays open while
    the mapping lives, which ``bits`` keeps alive."""
    found = _unpopulated_mapping_of(bits)
    if found is None:
        return None
    return found.fd, bits.__array_interface__["data"][0] - found.address


def _unpopulated_mapping_of(bits: np.ndarray) -> MappedFile | None:
    found = _mapping_of(bits)
    return found if found is not None and not found.populated else None


def _forget(address: int, fd: int) -> None:
    """A mapping's finalizer. The garbage collector runs it in whichever thread allocates, also
    while that thread holds a lock (`ThreadPoolExecutor.submit` holds one module-wide), so it
    takes none: it hands the descriptor to the closing thread through a queue whose ``put`` is
    safe there, or closes it here in a process that has no closing thread (a fork's child)."""
    closer = _closer
    if closer is None or closer[0] != os.getpid():
        _close(fd)
        return
    closer[1].put((address, fd))


def _start_closer() -> None:
    """Start this process's closing thread unless it runs (a fork's child starts its own)."""
    global _closer
    with _lock:
        if _closer is not None and _closer[0] == os.getpid():
            return
        queue: SimpleQueue[tuple[int, int] | threading.Event] = SimpleQueue()
        threading.Thread(
            target=_close_released, args=(queue,), name="hsdump-release", daemon=True
        ).start()
        _closer = (os.getpid(), queue)


def _close_released(queue: SimpleQueue[tuple[int, int] | threading.Event]) -> None:
    while True:
        item = queue.get()
        if isinstance(item, threading.Event):
            item.set()
            continue
        address, fd = item
        with _lock:  # unless a new mapping took the address since
            ref = _known.get(address)
            if ref is not None and ref() is None:
                del _known[address]
        _close(fd)


def released() -> None:
    """Wait until the descriptors of every mapping dropped so far are closed (their pages freed)."""
    closer = _closer
    if closer is None or closer[0] != os.getpid():
        return  # no closing thread here: each descriptor was closed where its mapping dropped
    done = threading.Event()
    closer[1].put(done)
    done.wait()


@dataclass(frozen=True)
class SharedTensor:
    """Where a tensor's values lie in the file passed beside it: enough to map them again."""

    length: int  # bytes of the file to map
    offset: int  # of the tensor's first element
    shape: tuple[int, ...]
    strides: tuple[int, ...]  # in bytes
    dtype: str  # the protocol's name, e.g. "bfloat16"


def share(tensor: torch.Tensor) -> tuple[int, bool, SharedTensor]:
    """A descriptor of a file holding ``tensor``'s values, whether the caller owns (and closes)
    it, and where in that file the values are.

    A tensor on a `MappedFile` is described on the mapping's own descriptor (not owned: it closes
    with the mapping); any other is copied into a fresh anonymous memory file (owned).

    Raises:
        InputError: The tensor's dtype is not one the protocol has.
    """
    from hsdump._store.codecs import tensor_to_bits

    dtype = dtype_of_torch(tensor.dtype).name
    bits = tensor_to_bits(tensor)
    found = _mapping_of(bits)
    if found is not None:
        return found.fd, False, _described(bits, found.address, len(found), dtype)
    return _copied(bits, dtype)


def attach(fd: int, where: SharedTensor) -> torch.Tensor:
    """The tensor `share` described, on a copy-on-write mapping of ``fd`` (which may be closed
    after this returns); every page is faulted in here, which also proves the file still covers
    the mapping (a file cut short would otherwise raise SIGBUS at first touch). On a tmpfs with
    huge pages that takes ~0.1 ms for 117 MB, on one with 4 KB pages 10-17 ms.

    Raises:
        OSError, ValueError: ``fd`` cannot be mapped or no longer covers the tensor.
    """
    prot = mmap.PROT_READ | mmap.PROT_WRITE
    mapped = mmap.mmap(fd, where.length, flags=mmap.MAP_PRIVATE, prot=prot)
    populate(mapped)
    spec = dtype_spec(where.dtype)
    bits = np.ndarray(
        where.shape, dtype=spec.bits, buffer=mapped, offset=where.offset, strides=where.strides
    )
    return spec.tensor_of(bits)


def _mapping_of(bits: np.ndarray) -> MappedFile | None:
    start = bits.__array_interface__["data"][0]
    if any(s < 0 for s in bits.strides):
        return None
    end = start + sum((n - 1) * s for n, s in zip(bits.shape, bits.strides, strict=True))
    end += bits.itemsize
    with _lock:
        candidates = [ref() for base, ref in _known.items() if base <= start]
    for mapped in candidates:
        if mapped is not None and not mapped.closed and end <= mapped.address + len(mapped):
            return mapped
    return None


def _described(bits: np.ndarray, base: int, length: int, dtype: str) -> SharedTensor:
    offset = bits.__array_interface__["data"][0] - base
    return SharedTensor(length, offset, bits.shape, bits.strides, dtype)


def _copied(bits: np.ndarray, dtype: str) -> tuple[int, bool, SharedTensor]:
    nbytes = max(1, math.prod(bits.shape) * bits.itemsize)
    fd = os.memfd_create("hsdump-sample", os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, nbytes)
        with mmap.mmap(fd, nbytes) as target:
            view = np.ndarray(bits.shape, dtype=bits.dtype, buffer=target)
            view[...] = bits
            strides = view.strides
            del view
    except BaseException:
        os.close(fd)
        raise
    return fd, True, SharedTensor(nbytes, 0, bits.shape, strides, dtype)
