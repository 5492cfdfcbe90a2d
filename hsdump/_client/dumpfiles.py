"""Reading a dump's tensor files: mapped copy-on-write, checked block by block as they are read.

A tensor file is mapped, not copied (`MappedFile`): the array uses the dump's own pages, which
outlive the dump's removal, and writing to it touches only this process's copy. The value checks
read the floats' bits directly (no conversion, with the masks of `DTYPES`) in cache-sized blocks
while each is in cache, so they cost one pass.

A mapping keeps a descriptor of its file. Closing the last descriptor of a removed tmpfs file
frees its pages, which takes the kernel 13 ms for a 117 MB dump on a tmpfs with 4 KB pages
(2 cores): a mapping's descriptor is closed in a thread of this module's own (`released` waits for
it), not in whichever thread drops the last array on the dump, which is often the event loop or
one of the store's codec threads.
"""

from __future__ import annotations

import ctypes
import errno
import io
import math
import mmap
import os
import threading
import weakref
from pathlib import Path
from queue import SimpleQueue

import numpy as np

from hsdump._exceptions import DumpValidationError, ShapeMismatch
from hsdump._protocol import check_file_size, dtype_spec, open_dump_file, value_error

__all__ = ["MappedFile", "populate", "read_checked", "released"]

# 2 MiB blocks: scanned while still in cache, and few enough that reading and checking a dump
# takes ~30 GIL hand-offs (512 KiB blocks cost more CPU per dump here, and 4x the hand-offs,
# which slowed every other thread of a busy process on 16 cores; 8 MiB blocks cost 25% more
# CPU per dump on 2 cores).
_BLOCK_BYTES = 1 << 21
# Linux's madvise advice that faults a mapping's pages in for reading (not in Python 3.11's mmap).
_MADV_POPULATE_READ = getattr(mmap, "MADV_POPULATE_READ", 22)

_libc = ctypes.CDLL(None, use_errno=True)
_madvise = _libc.madvise
_madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_madvise.restype = ctypes.c_int

_lock = threading.Lock()
# The process the closing thread runs in, and the queue it takes descriptors from.
_closer: tuple[int, SimpleQueue[int | threading.Event]] | None = None
_close = os.close


class MappedFile(mmap.mmap):
    """A copy-on-write mapping of a file that keeps a descriptor of the file while it lives."""

    fd: int
    address: int

    @classmethod
    def of(cls, fd: int, nbytes: int) -> MappedFile:
        """Map the first ``nbytes`` of ``fd`` copy-on-write.

        Raises:
            OSError, ValueError: The file cannot be mapped.
        """
        _start_closer()  # here, not in the finalizer: starting a thread takes locks
        mapped = cls(fd, nbytes, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        mapped.address = _address_of(mapped)
        mapped.fd = os.dup(fd)
        weakref.finalize(mapped, _forget, mapped.fd)
        return mapped


def _address_of(mapped: mmap.mmap) -> int:
    pointer = ctypes.c_char.from_buffer(mapped)  # exports the buffer only for this call
    try:
        return ctypes.addressof(pointer)
    finally:
        del pointer


def populate(mapped: mmap.mmap, advice: int = _MADV_POPULATE_READ) -> None:
    """Fault every page of ``mapped`` in (``advice``, by default ``MADV_POPULATE_READ``) with the
    interpreter lock released: Python's own `mmap.mmap.madvise` holds it for the whole call, which
    on a tmpfs with 4 KB pages is 7-28 ms for a 117 MB dump, while the store's codec threads and
    the event loop wait.

    Raises:
        OSError: The kernel refused: ``EFAULT`` where the file no longer covers the mapping,
            ``EINVAL`` where it lacks the advice (Linux before 5.14).
    """
    address = mapped.address if isinstance(mapped, MappedFile) else _address_of(mapped)
    if _madvise(address, len(mapped), advice) != 0:
        code = ctypes.get_errno()
        raise OSError(code, os.strerror(code))


def _forget(fd: int) -> None:
    """A mapping's finalizer. The garbage collector runs it in whichever thread allocates, also
    while that thread holds a lock (`ThreadPoolExecutor.submit` holds one module-wide), so it
    takes none: it hands the descriptor to the closing thread through a queue whose ``put`` is
    safe there, or closes it here in a process that has no closing thread (a fork's child)."""
    closer = _closer
    if closer is None or closer[0] != os.getpid():
        _close(fd)
        return
    closer[1].put(fd)


def _start_closer() -> None:
    """Start this process's closing thread unless it runs (a fork's child starts its own)."""
    global _closer
    with _lock:
        if _closer is not None and _closer[0] == os.getpid():
            return
        queue: SimpleQueue[int | threading.Event] = SimpleQueue()
        threading.Thread(
            target=_close_released, args=(queue,), name="hsdump-release", daemon=True
        ).start()
        _closer = (os.getpid(), queue)


def _close_released(queue: SimpleQueue[int | threading.Event]) -> None:
    while True:
        item = queue.get()
        if isinstance(item, threading.Event):
            item.set()
        else:
            _close(item)


def released() -> None:
    """Wait until the descriptors of every mapping dropped so far are closed (their pages freed)."""
    closer = _closer
    if closer is None or closer[0] != os.getpid():
        return  # no closing thread here: each descriptor was closed where its mapping dropped
    done = threading.Event()
    closer[1].put(done)
    done.wait()


def read_checked(
    file: Path,
    shape: tuple[int, ...],
    dtype: str,
    name: str,
    *,
    sample_id: str | None = None,
    rid: str,
    dir_fd: int | None = None,
    check_values: bool = True,
) -> np.ndarray:
    """A dump's tensor file as an array, checked block by block while each block is in cache.

    ``file`` is opened without following a link, relative to ``dir_fd`` (the dump's directory
    from `open_dump_dir`) when given.

    The file is mapped copy-on-write (`map_private`), not copied: the array uses the dump's own
    pages, which outlive the dump's removal, and writing to it touches only this process's copy.
    Where a file cannot be mapped, it is read into fresh memory instead.

    Raises unless the file holds exactly ``shape`` and, with ``check_values``, every value is
    finite and no row (or layer of a row) is all zeros. The values arrive as their raw bits
    (``uint16`` for bf16 and fp16, ``uint32`` for fp32: `bits`).
    """
    if min(shape, default=0) < 0:
        raise ShapeMismatch(
            f"{name} has shape {list(shape)}: a negative size", sample_id=sample_id, rid=rid
        )
    # The file must hold the claimed bytes before any are mapped or allocated: a lying meta.json
    # could otherwise ask for terabytes.
    np_dtype = dtype_spec(dtype).bits_dtype
    nbytes = math.prod(shape) * np_dtype.itemsize
    check_file_size(file, nbytes, shape, sample_id=sample_id, rid=rid)
    if not nbytes:
        return np.empty(shape, np_dtype)
    rows = max(1, _BLOCK_BYTES // (nbytes // shape[0]))
    try:
        with open_dump_file(file, dir_fd=dir_fd, sample_id=sample_id, rid=rid) as fh:
            mapped = map_private(fh.fileno(), nbytes)
            # An array on the mapping holds it: it is unmapped when the last one on it is freed.
            flat = np.empty(nbytes, np.uint8) if mapped is None else np.frombuffer(mapped, np.uint8)
            out = flat.view(np_dtype).reshape(shape)
            for start in range(0, shape[0], rows):
                block = out[start : start + rows]
                if mapped is None:
                    _read_exact(fh, block, file, sample_id=sample_id, rid=rid)
                if check_values:
                    _check_block(block, start, dtype, name, sample_id=sample_id, rid=rid)
    except _Shrank as exc:
        raise DumpValidationError(
            f"{file} holds fewer than its {nbytes} bytes now: it shrank after its size was "
            "checked (did something else rewrite the dump?)",
            sample_id=sample_id,
            rid=rid,
        ) from exc
    except OSError as exc:
        raise DumpValidationError(
            f"{file} could not be read: {exc}", sample_id=sample_id, rid=rid
        ) from exc
    return out


class _Shrank(Exception):
    """A mapped file no longer covers the mapping."""


def map_private(fd: int, nbytes: int) -> MappedFile | None:
    """The first ``nbytes`` of ``fd`` mapped copy-on-write, every page present; None where the
    file system or kernel cannot (the caller then reads the file).

    The pages are faulted in up front (``MADV_POPULATE_READ``), which also proves the file still
    covers the mapping: a file cut short after its size was checked raises `_Shrank` here, instead
    of a SIGBUS at first touch. Without that call (Linux before 5.14) nothing is mapped.
    """
    try:
        mapped = MappedFile.of(fd, nbytes)
    except (OSError, ValueError):
        return None
    try:
        populate(mapped, _MADV_POPULATE_READ)
    except OSError as exc:
        mapped.close()
        if exc.errno == errno.EFAULT:
            raise _Shrank from exc
        return None
    return mapped


def _read_exact(
    fh: io.FileIO, block: np.ndarray, file: Path, *, sample_id: str | None, rid: str
) -> None:
    view = block.data.cast("B")
    done = 0
    while done < len(view):
        got = fh.readinto(view[done:])
        if not got:
            raise DumpValidationError(
                f"{file} ended after {done} of a block's {len(view)} bytes: it shrank while "
                "being read (did something else remove or rewrite the dump?)",
                sample_id=sample_id,
                rid=rid,
            )
        done += got


def _check_block(
    block: np.ndarray, start: int, dtype: str, name: str, *, sample_id: str | None, rid: str
) -> None:
    spec = dtype_spec(dtype)
    error = value_error(
        spec.peak_magnitude(block, axis=-1),
        spec,
        name=name,
        start=start,
        sample_id=sample_id,
        rid=rid,
    )
    if error is not None:
        raise error
