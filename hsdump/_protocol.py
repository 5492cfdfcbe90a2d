"""Dump protocol v1: the on-disk contract between a producer (a server) and the client.

This module is the only implementation of the format; ``docs/protocol.md`` is its specification.
It imports nothing heavier than pydantic (numpy and torch only inside the functions that need
them), so the SGLang plugin, the reference server, the test fakes and the client all share it
without pulling in the client's dependencies. It also holds the one table of the float formats
(`DTYPES`): every part of hsdump that needs a dtype's size, bits or finite check asks it.

Layout of a dump root::

    <root>/
      _producers/<host>-<pid>-<rank>.json   producer manifests (who is dumping here)
      .tmp-req_<rid>-<pid>-<hex>/           a dump being written (never read by clients)
      req_<rid>/                            a published dump, renamed into place atomically
        meta.json  aux.bin  final.bin  done     on success
        error                                   on failure (JSON with a reason)

A dump is read and removed without following a symbolic link (``O_NOFOLLOW``, then every file
relative to the opened directory): whoever else can write into the root could otherwise point
``req_<rid>`` or one of its files anywhere, and make the client read or delete it.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import io
import mmap
import os
import re
import shutil
import socket
import stat
import time
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from hsdump._exceptions import (
    DtypeMismatch,
    DumpFailed,
    DumpValidationError,
    InputError,
    InvalidRequestId,
    ServerNotDumping,
)

if TYPE_CHECKING:
    import numpy as np
    import numpy.typing as npt
    import torch

__all__ = [
    "AUX_FILE",
    "DEFAULT_DUMP_DIR",
    "DEFAULT_RID_PREFIX",
    "DONE_MARKER",
    "DTYPES",
    "ENV_DUMP_DIR",
    "ERROR_MARKER",
    "FINAL_FILE",
    "META_FILE",
    "PROTOCOL_VERSION",
    "Capabilities",
    "DType",
    "DtypeSpec",
    "DumpErrorInfo",
    "DumpMeta",
    "DumpWriter",
    "ProducerInfo",
    "ProducerManifest",
    "check_file_size",
    "default_dump_dir",
    "dtype_itemsize",
    "dtype_of_torch",
    "dtype_spec",
    "is_opted_in",
    "open_dump_dir",
    "open_dump_file",
    "read_manifests",
    "read_meta",
    "remove_dump",
    "request_dir",
    "validate_rid",
    "write_dump",
    "write_error",
    "write_manifest",
]

PROTOCOL_VERSION = 1
ENV_DUMP_DIR = "HSDUMP_DUMP_DIR"
DEFAULT_DUMP_DIR = "/dev/shm/hsdump"
DEFAULT_RID_PREFIX = "hsdump-"
REQ_PREFIX = "req_"
TMP_PREFIX = ".tmp-"
PRODUCERS_DIR = "_producers"
META_FILE = "meta.json"
AUX_FILE = "aux.bin"
FINAL_FILE = "final.bin"
DONE_MARKER = "done"
ERROR_MARKER = "error"

DType = Literal["bfloat16", "float16", "float32"]
_RID_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,199}")
# O_NONBLOCK: opening a FIFO put in a file's place must not block (it is then refused).
_O_READ = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
_O_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_TRUST_HINT = (
    "Something other than the producer writes into {root}: make the dump root writable only by "
    "the server's and the client's users (docs/protocol.md, 'Who may write the dump root')."
)


def default_dump_dir() -> Path:
    """The dump root: ``$HSDUMP_DUMP_DIR`` if set, else ``/dev/shm/hsdump`` (read at call time)."""
    return Path(os.environ.get(ENV_DUMP_DIR) or DEFAULT_DUMP_DIR)


@dataclass(frozen=True)
class DtypeSpec:
    """How one protocol dtype is held on disk, in numpy and in torch.

    numpy has no bfloat16 and zarr neither, so every reader (the client's, the store's) holds a
    tensor's values as their raw bits, an unsigned integer of the same width, whatever the float
    format: one representation, bit-exact (NaN payloads included), viewed as floats only where
    torch tensors are handed out.

    Attributes:
        name: The protocol name (``meta.json``'s ``dtype``).
        itemsize: Bytes per element.
        bits: numpy's name of the unsigned integer that holds the bits.
        torch_name: torch's name of the float dtype (``getattr(torch, torch_name)``).
        torch_bits: torch's name of the integer the bits are viewed through on the way in and out
            (``int32`` for 4 bytes: torch's ``uint32`` arrived only in 2.3, with few kernels).
        exponent_mask: The exponent's bits. Without the sign, a value's bits order like its
            magnitude and reach this mask exactly when it is Inf or NaN.
    """

    name: DType
    itemsize: int
    bits: str
    torch_name: str
    torch_bits: str
    exponent_mask: int

    @property
    def magnitude_mask(self) -> int:
        """Every bit but the sign."""
        return (1 << (8 * self.itemsize - 1)) - 1

    @property
    def bits_dtype(self) -> np.dtype[Any]:
        """The numpy dtype of the bits."""
        import numpy as np

        return np.dtype(self.bits)

    def torch_dtype(self) -> torch.dtype:
        """The torch float dtype (imports torch)."""
        import torch

        dtype: torch.dtype = getattr(torch, self.torch_name)
        return dtype

    def bits_of(self, tensor: torch.Tensor) -> np.ndarray:
        """A CPU numpy view of ``tensor``'s bits (a copy only off the CPU or when strided)."""
        import torch

        t = tensor.detach().to("cpu").contiguous()
        if t.dtype != self.torch_dtype():
            raise DtypeMismatch(f"a {t.dtype} tensor is not {self.name}: cast it first")
        return t.view(getattr(torch, self.torch_bits)).numpy().view(self.bits)

    def tensor_of(self, bits: np.ndarray) -> torch.Tensor:
        """Reinterpret bits as a tensor of this dtype without copying."""
        import torch

        return torch.from_numpy(bits.view(self.torch_bits)).view(self.torch_dtype())

    def to_float32(self, bits: np.ndarray) -> np.ndarray:
        """The values of ``bits`` as float32 (a view for float32 itself)."""
        import numpy as np

        if self.name == "bfloat16":  # one ufunc pass (astype then shift made two, 4.8x slower)
            widened: np.ndarray = np.left_shift(bits, 16, dtype=np.uint32)
            return widened.view(np.float32)
        return bits.view(self.torch_name).astype(np.float32, copy=False)

    def from_float32(self, values: npt.ArrayLike) -> np.ndarray:
        """The bits of float32 ``values`` in this dtype, rounded to nearest even."""
        import numpy as np

        wide = np.asarray(values, dtype=np.float32)
        if self.name != "bfloat16":
            with np.errstate(over="ignore"):  # beyond the format's range is Inf, as in torch
                return wide.astype(self.torch_name).view(self.bits)
        u = wide.view(np.uint32)
        return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


#: Every float format the protocol (and so the store) knows, by protocol name.
DTYPES: dict[str, DtypeSpec] = {
    "bfloat16": DtypeSpec("bfloat16", 2, "uint16", "bfloat16", "uint16", 0x7F80),
    "float16": DtypeSpec("float16", 2, "uint16", "float16", "uint16", 0x7C00),
    "float32": DtypeSpec("float32", 4, "uint32", "float32", "int32", 0x7F800000),
}


def dtype_spec(name: str) -> DtypeSpec:
    """The table entry of protocol dtype ``name``.

    Raises:
        DtypeMismatch: ``name`` is not a protocol dtype.
    """
    try:
        return DTYPES[name]
    except KeyError:
        raise DtypeMismatch(
            f"dtype {name!r} is not a protocol dtype: use one of {', '.join(DTYPES)}"
        ) from None


def dtype_of_torch(dtype: torch.dtype) -> DtypeSpec:
    """The table entry of a torch float dtype.

    Raises:
        InputError: The protocol has no such dtype (cast the tensors to one it has).
    """
    name = str(dtype).removeprefix("torch.")
    spec = DTYPES.get(name)
    if spec is None or spec.torch_name != name:
        raise InputError(
            f"hidden states of dtype {name} cannot be dumped or stored: cast them to one of "
            f"{', '.join(DTYPES)}"
        )
    return spec


def dtype_itemsize(dtype: str) -> int:
    """Bytes per element of a protocol dtype name."""
    return dtype_spec(dtype).itemsize


def validate_rid(rid: str) -> str:
    """Return ``rid`` if it is safe as a path component.

    A rid is 1-200 characters of ``[A-Za-z0-9._-]`` starting with a letter or digit, so it can never
    name a parent directory or escape the dump root.

    Raises:
        InvalidRequestId: ``rid`` is not such a name (a ``ValueError`` too).
    """
    if not isinstance(rid, str) or not _RID_RE.fullmatch(rid):
        shown = rid if not isinstance(rid, str) or len(rid) <= 60 else f"{rid[:60]}..."
        raise InvalidRequestId(
            f"request id {shown!r} is not a valid dump name: use 1-200 characters of "
            "[A-Za-z0-9._-] starting with a letter or digit (a producer dumps only such ids, "
            "so choose the rid prefix and ids within them)"
        )
    return rid


def is_opted_in(rid: object, prefix: str = DEFAULT_RID_PREFIX) -> bool:
    """Whether a producer should dump request ``rid``: it carries the opt-in prefix and is safe."""
    return isinstance(rid, str) and rid.startswith(prefix) and _RID_RE.fullmatch(rid) is not None


def request_dir(root: str | os.PathLike[str], rid: str) -> Path:
    """The published directory of request ``rid`` under ``root``."""
    return Path(root) / f"{REQ_PREFIX}{validate_rid(rid)}"


class _Model(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class ProducerInfo(_Model):
    """Which program wrote a dump."""

    name: str
    version: str


class Capabilities(_Model):
    """What a producer guarantees about its captures."""

    chunked_prefill_assembly: bool = Field(
        description="Chunks of one prefill become one dump (else chunked prefill must be off)."
    )
    prefix_cache_guard: bool = Field(
        description="A request with cached prefix tokens gets an error, never a short dump."
    )


class DumpMeta(_Model):
    """``meta.json`` of a published dump.

    ``layer_ids`` follow the transformers convention: id ``i`` is ``hidden_states[i]``, the input of
    decoder layer ``i`` (0 is the embeddings). The final state is separate; ``final_norm`` says
    whether the model's last norm was applied to it.
    """

    format: Literal["hsdump-dump"] = "hsdump-dump"
    version: Literal[1] = 1
    rid: str
    input_ids: list[int]
    num_tokens: int
    layer_ids: list[int]
    layer_convention: Literal["hidden_states_index"] = "hidden_states_index"
    final_norm: Literal["post_norm", "pre_norm"]
    hidden_size: int
    dtype: DType
    aux_shape: tuple[int, int, int]
    final_shape: tuple[int, int]
    producer: ProducerInfo
    model_path: str = ""
    rank: int = 0
    created_at: float = Field(default_factory=time.time)
    extra: dict[str, Any] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _consistent(self) -> DumpMeta:
        t, k, h = self.num_tokens, len(self.layer_ids), self.hidden_size
        if len(self.input_ids) != t:
            raise ValueError(f"num_tokens {t} != len(input_ids) {len(self.input_ids)}")
        if self.aux_shape != (t, k, h) or self.final_shape != (t, h):
            raise ValueError(
                f"shapes aux {self.aux_shape} / final {self.final_shape} do not match "
                f"[T={t}, K={k}, H={h}] / [T, H]"
            )
        return self


class DumpErrorInfo(_Model):
    """The ``error`` marker of a failed capture."""

    format: Literal["hsdump-error"] = "hsdump-error"
    version: Literal[1] = 1
    rid: str
    reason: str
    producer: ProducerInfo
    created_at: float = Field(default_factory=time.time)


class ProducerManifest(_Model):
    """``_producers/<host>-<pid>-<rank>.json``: a producer announcing it dumps into this root."""

    format: Literal["hsdump-producer"] = "hsdump-producer"
    version: Literal[1] = 1
    producer: ProducerInfo
    host: str = Field(default_factory=socket.gethostname)
    pid: int = Field(default_factory=os.getpid)
    rank: int = 0
    rid_prefix: str = DEFAULT_RID_PREFIX
    layer_ids: list[int]
    final_norm: Literal["post_norm", "pre_norm"]
    hidden_size: int
    dtype: DType
    model_path: str = ""
    capabilities: Capabilities
    started_at: float = Field(default_factory=time.time)

    def is_alive(self) -> bool:
        """False only when the producer ran on this host and its pid is gone."""
        if self.host != socket.gethostname():
            return True
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True


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
    rows written cover exactly ``[0, num_tokens)``. Use as a context manager: leaving it without
    publishing removes the temporary directory.

    Args:
        root: The dump root.
        rid: The request id (validated).
        num_tokens: T, the number of prompt tokens.
        num_layers: K, the number of aux layers.
        hidden_size: H.
        dtype: The protocol dtype name of the data.
        mapped: Copy rows into memory maps of the files instead of writing them: then several
            threads can fill one file at once (the producer's writer pool does).
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
        mapped: bool = False,
    ):
        self.root = Path(root)
        self.rid = validate_rid(rid)
        self.num_tokens = num_tokens
        self._aux_row = num_layers * hidden_size * dtype_itemsize(dtype)
        self._final_row = hidden_size * dtype_itemsize(dtype)
        self._covered: list[tuple[int, int]] = []
        self.tmp = _temp_dir(self.root, rid)
        self.tmp.mkdir(parents=True)
        self._fds = [self._open(AUX_FILE, self._aux_row), self._open(FINAL_FILE, self._final_row)]
        sizes = (self._aux_row * num_tokens, self._final_row * num_tokens)
        self._maps = [
            _MappedFile(fd, size) if mapped and size else None
            for fd, size in zip(self._fds, sizes, strict=True)
        ]

    def _open(self, name: str, row_bytes: int) -> int:
        fd = os.open(self.tmp / name, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
        os.ftruncate(fd, row_bytes * self.num_tokens)
        return fd

    def write_rows(self, start: int, aux: Any, final: Any) -> None:
        """Write rows ``[start, start + n)`` from two C-contiguous buffers (bytes-like or arrays).

        ``aux`` holds ``n * K * H`` elements in row order ``[n, K, H]``; ``final`` holds ``n * H``.
        """
        aux_view, final_view = memoryview(aux).cast("B"), memoryview(final).cast("B")
        n = len(final_view) // self._final_row
        if n * self._final_row != len(final_view) or len(aux_view) != n * self._aux_row:
            raise ValueError(f"rows of {len(aux_view)}/{len(final_view)} bytes are not whole rows")
        if start < 0 or start + n > self.num_tokens:
            raise ValueError(f"rows [{start}, {start + n}) fall outside [0, {self.num_tokens})")
        parts = ((aux_view, self._aux_row), (final_view, self._final_row))
        for fd, mapped, (view, row) in zip(self._fds, self._maps, parts, strict=True):
            if mapped is not None:
                mapped.copy_in(start * row, view)
            else:
                os.pwrite(fd, view, start * row)
        self._covered.append((start, start + n))

    def coverage_complete(self) -> bool:
        """Whether the rows written tile ``[0, num_tokens)`` exactly once."""
        end = 0
        for lo, hi in sorted(self._covered):
            if lo != end:
                return False
            end = hi
        return end == self.num_tokens

    def publish(self, meta: DumpMeta) -> Path:
        """Flush, write ``meta.json`` and ``done``, and rename the dump into place."""
        if meta.rid != self.rid or meta.num_tokens != self.num_tokens:
            raise ValueError(f"meta for {meta.rid!r}/{meta.num_tokens} does not match this writer")
        if not self.coverage_complete():
            raise ValueError(
                f"rows written {sorted(self._covered)} do not cover [0, {self.num_tokens})"
            )
        for fd in self._fds:
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
        for fd in self._fds:
            if sync:
                os.fsync(fd)
            os.close(fd)
        self._fds = []

    def __enter__(self) -> DumpWriter:
        return self

    def __exit__(self, *exc_info: object) -> None:
        if self.tmp.exists():
            self.abort()


def write_dump(root: str | os.PathLike[str], meta: DumpMeta, aux: Any, final: Any) -> Path:
    """Write and publish a whole dump in one call; returns the published directory."""
    k, h = len(meta.layer_ids), meta.hidden_size
    with DumpWriter(
        root, meta.rid, num_tokens=meta.num_tokens, num_layers=k, hidden_size=h, dtype=meta.dtype
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


def read_manifests(root: str | os.PathLike[str]) -> list[ProducerManifest]:
    """Every readable producer manifest in ``root``; raises ServerNotDumping when there is none."""
    directory = Path(root) / PRODUCERS_DIR
    found = []
    for path in sorted(directory.glob("*.json")) if directory.is_dir() else []:
        try:
            found.append(ProducerManifest.model_validate_json(path.read_bytes()))
        except (OSError, ValidationError):
            continue  # a manifest being replaced or from another version: not ours to judge
    if not found:
        raise ServerNotDumping(
            f"no producer manifest in {directory}: no server is dumping hidden states into {root}. "
            "Start SGLang with the hsdump plugin (HSDUMP_DUMP_DIR set to this directory) or run "
            "`hsdump serve-reference --dump-dir` with the same directory."
        )
    return found


def read_meta(
    path: str | os.PathLike[str], *, sample_id: str | None = None, dir_fd: int | None = None
) -> DumpMeta:
    """Check a published dump's markers and read its ``meta.json``, never through a link.

    Args:
        path: The dump's directory.
        sample_id: Named in errors.
        dir_fd: ``path`` opened by `open_dump_dir` (else it is opened here).

    Raises:
        DumpFailed: The producer published an ``error`` marker.
        DumpValidationError: The directory is incomplete or its metadata is malformed.
    """
    path = Path(path)
    rid = path.name.removeprefix(REQ_PREFIX)
    context = {"sample_id": sample_id, "rid": rid}
    with _dump_dir(path, dir_fd, **context) as fd:
        if _has_marker(path / ERROR_MARKER, fd, **context):
            raise DumpFailed(_error_reason(path, fd), **context)
        if not _has_marker(path / DONE_MARKER, fd, **context):
            raise DumpValidationError(f"{path} has no done marker", **context)
        try:
            with open_dump_file(path / META_FILE, dir_fd=fd, **context) as fh:
                return DumpMeta.model_validate_json(fh.read())
        except (OSError, ValidationError) as exc:
            raise DumpValidationError(
                f"{path / META_FILE} is unreadable or invalid: {exc}", **context
            ) from exc


@contextlib.contextmanager
def open_dump_dir(
    path: str | os.PathLike[str], *, sample_id: str | None = None, rid: str | None = None
) -> Iterator[int]:
    """Open a dump's directory without following a link; yields its descriptor (then closed).

    Read the dump's files relative to it (``dir_fd``): a link swapped in for the directory later
    changes nothing.

    Raises:
        DumpValidationError: ``path`` is missing, a link, not a directory, or another filesystem
            mounted in the dump root.
    """
    path = Path(path)
    rid = rid or path.name.removeprefix(REQ_PREFIX)
    try:
        fd = os.open(path, _O_DIR)
    except OSError as exc:
        raise _refusal(path, exc, sample_id=sample_id, rid=rid) from exc
    try:
        _check_not_mounted(fd, path, sample_id=sample_id, rid=rid)
        yield fd
    finally:
        os.close(fd)


def open_dump_file(
    file: Path, *, dir_fd: int | None = None, sample_id: str | None = None, rid: str | None = None
) -> io.FileIO:
    """Open a dump's regular file for reading, never through a link.

    With ``dir_fd`` (from `open_dump_dir`), ``file.name`` is opened relative to it.

    Raises:
        DumpValidationError: The file is a link, a FIFO or anything but a regular file.
        OSError: It cannot be opened otherwise (missing, unreadable).
    """
    try:
        fd = os.open(file.name if dir_fd is not None else file, _O_READ, dir_fd=dir_fd)
    except OSError as exc:
        if not _is_link_error(exc):
            raise
        raise _refusal(file, exc, sample_id=sample_id, rid=rid) from exc
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        raise _not_regular(file, mode, sample_id=sample_id, rid=rid)
    return open(fd, "rb", buffering=0)


def _check_not_mounted(fd: int, path: Path, *, sample_id: str | None, rid: str | None) -> None:
    try:
        mounted = os.fstat(fd).st_dev != os.stat(path.parent).st_dev
    except OSError as exc:
        raise DumpValidationError(
            f"{path.parent} could not be checked: {exc}", sample_id=sample_id, rid=rid
        ) from exc
    if mounted:
        raise DumpValidationError(
            f"{path} is another filesystem mounted in the dump root (a FUSE or bind mount), "
            f"not a directory the producer made there. {_TRUST_HINT.format(root=path.parent)}",
            sample_id=sample_id,
            rid=rid,
        )


def _dump_dir(
    path: Path, dir_fd: int | None, *, sample_id: str | None, rid: str | None
) -> contextlib.AbstractContextManager[int]:
    if dir_fd is not None:
        return contextlib.nullcontext(dir_fd)
    return open_dump_dir(path, sample_id=sample_id, rid=rid)


def _has_marker(file: Path, dir_fd: int, *, sample_id: str | None, rid: str | None) -> bool:
    try:
        mode = os.stat(file.name, dir_fd=dir_fd, follow_symlinks=False).st_mode
    except FileNotFoundError:
        return False
    except OSError as exc:
        raise DumpValidationError(
            f"{file} could not be checked: {exc}", sample_id=sample_id, rid=rid
        ) from exc
    if stat.S_ISLNK(mode):
        raise _link_refusal(file, sample_id=sample_id, rid=rid)
    return True


def _is_link_error(exc: OSError) -> bool:
    # O_NOFOLLOW on a link fails with ELOOP; O_DIRECTORY on one (or on a file) with ENOTDIR.
    return exc.errno in (errno.ELOOP, errno.ENOTDIR)


def _refusal(
    path: Path, exc: OSError, *, sample_id: str | None, rid: str | None
) -> DumpValidationError:
    """The error for a dump path that could not be opened as what the protocol says it is."""
    try:
        mode = os.lstat(path).st_mode
    except OSError:
        mode = None
    if mode is not None and stat.S_ISLNK(mode):
        return _link_refusal(path, sample_id=sample_id, rid=rid)
    if mode is not None and _is_link_error(exc):
        return _not_regular(path, mode, sample_id=sample_id, rid=rid)
    if isinstance(exc, FileNotFoundError):
        return DumpValidationError(
            f"{path} is missing (was it removed while being read?)", sample_id=sample_id, rid=rid
        )
    return DumpValidationError(f"{path} could not be opened: {exc}", sample_id=sample_id, rid=rid)


def _link_refusal(path: Path, *, sample_id: str | None, rid: str | None) -> DumpValidationError:
    try:
        target = f" to {os.readlink(path)}"
    except OSError:
        target = ""
    return DumpValidationError(
        f"{path} is a symbolic link{target}: a dump is read only from what the producer wrote "
        "in the dump root, never through a link (the link is removed, never its target). "
        + _TRUST_HINT.format(root=_root_of(path)),
        sample_id=sample_id,
        rid=rid,
    )


def _not_regular(
    path: Path, mode: int, *, sample_id: str | None, rid: str | None
) -> DumpValidationError:
    kinds = [
        (stat.S_ISREG, "a regular file"),
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISSOCK, "a socket"),
    ]
    found = next((name for test, name in kinds if test(mode)), "a device or special file")
    wanted = "a directory" if path.name.startswith((REQ_PREFIX, TMP_PREFIX)) else "a regular file"
    return DumpValidationError(
        f"{path} is {found}, expected {wanted} written by the producer. "
        + _TRUST_HINT.format(root=_root_of(path)),
        sample_id=sample_id,
        rid=rid,
    )


def _root_of(path: Path) -> Path:
    """The dump root of a dump directory or of a file in one."""
    return path.parent if path.name.startswith((REQ_PREFIX, TMP_PREFIX)) else path.parent.parent


def check_file_size(
    file: Path, expected: int, shape: Sequence[int], *, sample_id: str | None, rid: str
) -> None:
    """Raise unless ``file`` is a regular file of exactly ``expected`` bytes (``shape``'s tensor).

    A link is refused, not followed (`open_dump_file` then opens without following one).
    """
    try:
        info = file.lstat()
    except OSError as exc:
        raise DumpValidationError(f"{file} is missing", sample_id=sample_id, rid=rid) from exc
    if stat.S_ISLNK(info.st_mode):
        raise _link_refusal(file, sample_id=sample_id, rid=rid)
    if not stat.S_ISREG(info.st_mode):
        raise _not_regular(file, info.st_mode, sample_id=sample_id, rid=rid)
    size = info.st_size
    if size != expected:
        raise DumpValidationError(
            f"{file} holds {size} bytes, expected {expected} for shape {list(shape)}",
            sample_id=sample_id,
            rid=rid,
        )


def _error_reason(path: Path, dir_fd: int) -> str:
    try:
        with open_dump_file(path / ERROR_MARKER, dir_fd=dir_fd) as fh:
            info = DumpErrorInfo.model_validate_json(fh.read())
    except (OSError, ValidationError, DumpValidationError):
        return f"the producer published an error marker in {path} (unreadable)"
    return f"the producer ({info.producer.name} {info.producer.version}) failed: {info.reason}"


def remove_dump(path: str | os.PathLike[str]) -> None:
    """Delete a dump directory (published or temporary); a missing one is fine.

    Nothing is deleted through a link: a link (or file) in the dump's place is itself removed,
    and the directory is opened without following one and its files unlinked relative to it.
    The protocol's files are unlinked by name first: ``shutil.rmtree`` lists and stats every
    entry, a dozen calls that each wait for the GIL again in a busy client (15% of a dump's
    ingest on 16 cores). Anything else in the directory is left to ``rmtree``, which does not
    follow links either.
    """
    try:
        fd = os.open(path, _O_DIR)
    except FileNotFoundError:
        return
    except OSError:
        with contextlib.suppress(OSError):
            os.unlink(path)  # a link in the dump's place: removed, never its target
        return
    try:
        for name in (DONE_MARKER, AUX_FILE, FINAL_FILE, META_FILE, ERROR_MARKER):
            with contextlib.suppress(OSError):
                os.unlink(name, dir_fd=fd)
    finally:
        os.close(fd)
    try:
        os.rmdir(path)
    except OSError:
        shutil.rmtree(path, ignore_errors=True)
