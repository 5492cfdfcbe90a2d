"""Writing dumps, error markers and manifests: the producer's side of the protocol."""

from __future__ import annotations

import contextlib
import ctypes
import mmap
import os
import shutil
import uuid
from pathlib import Path
from typing import Any

from hsdump._protocol._dtypes import dtype_itemsize, dtype_spec
from hsdump._protocol._models import DumpErrorInfo, DumpMeta, ProducerInfo, ProducerManifest
from hsdump._protocol._moments import MOMENTS_FILE, row_moments
from hsdump._protocol._names import (
    AUX_FILE,
    DONE_MARKER,
    ERROR_MARKER,
    FINAL_FILE,
    META_FILE,
    PRODUCERS_DIR,
    REQ_PREFIX,
    TMP_PREFIX,
    request_dir,
    validate_rid,
)


def _temp_dir(root: Path, rid: str) -> Path:
    """Where a dump of ``rid`` is written before it is renamed into place (unique per writer)."""
    return root / f"{TMP_PREFIX}{REQ_PREFIX}{rid}-{os.getpid()}-{uuid.uuid4().hex[:8]}"


def _write_json_atomic(path: Path, data: str) -> None:
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


class _MappedFile:
    """A dump file mapped for writing: rows are copied in with ``memmove``, which releases the GIL
    and, unlike ``pwrite``, takes no per-file lock, so threads fill one file in parallel."""

    def __init__(self, fd: int, size: int):
        self.map = mmap.mmap(fd, size)
        # 2 MB pages where the tmpfs allows them on request (huge=advise); elsewhere a no-op.
        with contextlib.suppress(OSError):
            self.map.madvise(mmap.MADV_HUGEPAGE)
        self._view: Any = (ctypes.c_char * size).from_buffer(self.map)
        self.address = ctypes.addressof(self._view)

    def copy_in(self, offset: int, data: memoryview) -> None:
        if data.readonly:
            ctypes.memmove(self.address + offset, data.tobytes(), len(data))
            return
        source = (ctypes.c_char * len(data)).from_buffer(data)
        ctypes.memmove(self.address + offset, ctypes.addressof(source), len(data))

    def close(self) -> None:
        self._view = None
        self.map.close()


class DumpWriter:
    """Writes one request's dump under a temporary name, then publishes it atomically.

    Rows may arrive in any order and in pieces (chunked prefill); `publish` refuses unless the
    rows written cover exactly ``[0, num_tokens)``. Rows are copied into memory maps of the
    files, so several threads can fill one file at once (the producer's writer pool does). Use
    as a context manager: leaving it without publishing removes the temporary directory.

    Args:
        root: The dump root.
        rid: The request id (validated).
        num_tokens: T, the number of prompt tokens.
        num_layers: K, the number of aux layers.
        hidden_size: H.
        dtype: The protocol dtype name of the data.
        moments: Also write ``moments.bin``, each vector's sum and sum of squares (for a
            producer that announces ``capabilities.row_moments``): given with the rows, or
            computed from them on the CPU.
    """

    def __init__(
        self,
        root: str | os.PathLike[str],
        rid: str,
        *,
        num_tokens: int,
        num_layers: int,
        hidden_size: int,
        dtype: str,
        moments: bool = False,
    ):
        self.root = Path(root)
        self.rid = validate_rid(rid)
        self.num_tokens = num_tokens
        self._dtype, self._shape = dtype, (num_layers, hidden_size)
        self._aux_row = num_layers * hidden_size * dtype_itemsize(dtype)
        self._final_row = hidden_size * dtype_itemsize(dtype)
        self._covered: list[tuple[int, int]] = []
        self._moments_covered: list[tuple[int, int]] = []
        self.tmp = _temp_dir(self.root, rid)
        self.tmp.mkdir(parents=True)
        self._fds = [self._open(AUX_FILE, self._aux_row), self._open(FINAL_FILE, self._final_row)]
        sizes = (self._aux_row * num_tokens, self._final_row * num_tokens)
        self._maps = [
            _MappedFile(fd, size) if size else None
            for fd, size in zip(self._fds, sizes, strict=True)
        ]
        self._moments_row = (num_layers + 1) * 2 * 4  # float32 sum and sum of squares per vector
        self._moments_fd = self._open(MOMENTS_FILE, self._moments_row) if moments else None

    def _open(self, name: str, row_bytes: int) -> int:
        fd = os.open(self.tmp / name, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
        os.ftruncate(fd, row_bytes * self.num_tokens)
        return fd

    def write_rows(
        self, start: int, aux: Any, final: Any, moments: Any = None, *, moments_later: bool = False
    ) -> None:
        """Write rows ``[start, start + n)`` from two C-contiguous buffers (bytes-like or arrays).

        ``aux`` holds ``n * K * H`` elements in row order ``[n, K, H]``; ``final`` holds ``n * H``.
        ``moments``, the rows' float32 ``[n, K + 1, 2]`` (`row_moments`), is written when this
        writer writes ``moments.bin``; without it they are computed here, unless
        ``moments_later``: then the caller writes them with `write_moments` before publishing.
        """
        aux_view, final_view = memoryview(aux).cast("B"), memoryview(final).cast("B")
        n = len(final_view) // self._final_row
        if n * self._final_row != len(final_view) or len(aux_view) != n * self._aux_row:
            raise ValueError(f"rows of {len(aux_view)}/{len(final_view)} bytes are not whole rows")
        if start < 0 or start + n > self.num_tokens:
            raise ValueError(f"rows [{start}, {start + n}) fall outside [0, {self.num_tokens})")
        parts = ((aux_view, self._aux_row), (final_view, self._final_row))
        for mapped, (view, row) in zip(self._maps, parts, strict=True):
            if mapped is not None:  # None: a file of no bytes
                mapped.copy_in(start * row, view)
        if self._moments_fd is not None and not moments_later:
            if moments is None:
                moments = self._computed_moments(n, aux_view, final_view)
            if memoryview(moments).nbytes != n * self._moments_row:
                raise ValueError(f"moments of {memoryview(moments).nbytes} bytes are not those "
                                 f"of {n} rows")  # fmt: skip
            self.write_moments(start, moments)
        self._covered.append((start, start + n))

    def write_moments(self, start: int, moments: Any) -> None:
        """Write the float32 ``[n, K + 1, 2]`` moments of rows ``[start, start + n)`` into
        ``moments.bin`` (a writer made with ``moments``)."""
        if self._moments_fd is None:
            raise ValueError("this dump writer was made without moments")
        view = memoryview(moments).cast("B")
        n = len(view) // self._moments_row
        if n * self._moments_row != len(view) or start < 0 or start + n > self.num_tokens:
            raise ValueError(
                f"moments of {len(view)} bytes at row {start} are not whole rows of "
                f"[0, {self.num_tokens})"
            )
        os.pwrite(self._moments_fd, view, start * self._moments_row)
        self._moments_covered.append((start, start + n))

    def _computed_moments(self, n: int, aux: memoryview, final: memoryview) -> Any:
        import numpy as np

        bits, (k, h) = dtype_spec(self._dtype).bits_dtype, self._shape
        return row_moments(
            np.frombuffer(aux, bits).reshape(n, k, h),
            np.frombuffer(final, bits).reshape(n, h),
            self._dtype,
        )

    def coverage_complete(self) -> bool:
        """Whether the rows written (and their moments, for a writer with moments) tile
        ``[0, num_tokens)`` exactly once."""
        ranges = [self._covered]
        if self._moments_fd is not None:
            ranges.append(self._moments_covered)
        return all(_tiles(r, self.num_tokens) for r in ranges)

    def publish(self, meta: DumpMeta) -> Path:
        """Flush, write ``meta.json`` and ``done``, and rename the dump into place."""
        if meta.rid != self.rid or meta.num_tokens != self.num_tokens:
            raise ValueError(f"meta for {meta.rid!r}/{meta.num_tokens} does not match this writer")
        if not self.coverage_complete():
            covered = sorted(self._moments_covered)
            moments = "" if self._moments_fd is None else f", moments {covered}"
            raise ValueError(
                f"rows written {sorted(self._covered)}{moments} do not cover [0, {self.num_tokens})"
            )
        for fd in self._all_fds():
            os.fsync(fd)  # also writes back pages dirtied through the maps
        _write_json_atomic(self.tmp / META_FILE, meta.model_dump_json())
        (self.tmp / DONE_MARKER).touch()
        final = request_dir(self.root, self.rid)
        os.rename(self.tmp, final)
        # Unmapping 117 MB takes ~15 ms: after the rename, so a reader need not wait for it (it
        # reads the same pages; a file it deletes stays allocated until it is unmapped here).
        self._close_fds(sync=False)
        return final

    def abort(self) -> None:
        """Drop everything written so far."""
        self._close_fds(sync=False)
        shutil.rmtree(self.tmp, ignore_errors=True)

    def _close_fds(self, *, sync: bool) -> None:
        for mapped in self._maps:
            if mapped is not None:
                mapped.close()
        self._maps = []
        for fd in self._all_fds():
            if sync:
                os.fsync(fd)
            os.close(fd)
        self._fds, self._moments_fd = [], None

    def _all_fds(self) -> list[int]:
        return self._fds if self._moments_fd is None else [*self._fds, self._moments_fd]

    def __enter__(self) -> DumpWriter:
        return self

    def __exit__(self, *exc_info: object) -> None:
        if self.tmp.exists():
            self.abort()


def _tiles(ranges: list[tuple[int, int]], total: int) -> bool:
    """Whether ``ranges`` tile ``[0, total)`` exactly once."""
    end = 0
    for lo, hi in sorted(ranges):
        if lo != end:
            return False
        end = hi
    return end == total


def write_dump(
    root: str | os.PathLike[str],
    meta: DumpMeta,
    aux: Any,
    final: Any,
    *,
    moments: bool = False,
) -> Path:
    """Write and publish a whole dump in one call (with ``moments.bin`` when ``moments``);
    returns the published directory."""
    k, h = len(meta.layer_ids), meta.hidden_size
    with DumpWriter(
        root,
        meta.rid,
        num_tokens=meta.num_tokens,
        num_layers=k,
        hidden_size=h,
        dtype=meta.dtype,
        moments=moments,
    ) as writer:
        writer.write_rows(0, aux, final)
        return writer.publish(meta)


def write_error(
    root: str | os.PathLike[str], rid: str, reason: str, producer: ProducerInfo
) -> Path:
    """Publish an ``error`` marker for ``rid``, so the client fails fast instead of timing out."""
    info = DumpErrorInfo(rid=validate_rid(rid), reason=reason, producer=producer)
    tmp = _temp_dir(Path(root), rid)
    tmp.mkdir(parents=True)
    _write_json_atomic(tmp / ERROR_MARKER, info.model_dump_json())
    final = request_dir(root, rid)
    os.rename(tmp, final)
    return final


def write_manifest(root: str | os.PathLike[str], manifest: ProducerManifest) -> Path:
    """Announce a producer in ``root``; returns the manifest's path (remove it on shutdown)."""
    directory = Path(root) / PRODUCERS_DIR
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{manifest.host}-{manifest.pid}-{manifest.rank}.json"
    _write_json_atomic(path, manifest.model_dump_json())
    return path
