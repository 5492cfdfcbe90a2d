"""Dump protocol v1: the on-disk contract between a producer (a server) and the client.

This module is the only implementation of the format; ``docs/protocol.md`` is its specification.
It imports nothing heavier than pydantic (numpy only inside :func:`read_dump`), so the SGLang
plugin, the reference server, the test fakes and the client all share it without pulling in the
client's dependencies.

Layout of a dump root::

    <root>/
      _producers/<host>-<pid>-<rank>.json   producer manifests (who is dumping here)
      .tmp-req_<rid>-<pid>-<hex>/           a dump being written (never read by clients)
      req_<rid>/                            a published dump, renamed into place atomically
        meta.json  aux.bin  final.bin  done     on success
        error                                   on failure (JSON with a reason)
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import socket
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from hsdump._exceptions import DumpFailed, DumpValidationError, ServerNotDumping

if TYPE_CHECKING:
    import numpy as np

__all__ = [
    "AUX_FILE",
    "DEFAULT_DUMP_DIR",
    "DEFAULT_RID_PREFIX",
    "DONE_MARKER",
    "ENV_DUMP_DIR",
    "ERROR_MARKER",
    "FINAL_FILE",
    "META_FILE",
    "PROTOCOL_VERSION",
    "Capabilities",
    "Dump",
    "DumpErrorInfo",
    "DumpMeta",
    "DumpWriter",
    "ProducerInfo",
    "ProducerManifest",
    "check_file_size",
    "default_dump_dir",
    "dtype_itemsize",
    "is_opted_in",
    "read_dump",
    "read_manifests",
    "read_meta",
    "remove_dump",
    "request_dir",
    "storage_dtype",
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
_ITEMSIZE: dict[str, int] = {"bfloat16": 2, "float16": 2, "float32": 4}
_RID_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,199}")


def default_dump_dir() -> Path:
    """The dump root: ``$HSDUMP_DUMP_DIR`` if set, else ``/dev/shm/hsdump`` (read at call time)."""
    return Path(os.environ.get(ENV_DUMP_DIR) or DEFAULT_DUMP_DIR)


def dtype_itemsize(dtype: str) -> int:
    """Bytes per element of a protocol dtype name."""
    return _ITEMSIZE[dtype]


def validate_rid(rid: str) -> str:
    """Return ``rid`` if it is safe as a path component, else raise ``ValueError``.

    A rid is 1-200 characters of ``[A-Za-z0-9._-]`` starting with a letter or digit, so it can never
    name a parent directory or escape the dump root.
    """
    if not isinstance(rid, str) or not _RID_RE.fullmatch(rid):
        raise ValueError(
            f"request id {rid!r} is not a valid dump name: use 1-200 characters of [A-Za-z0-9._-] "
            "starting with a letter or digit"
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


@dataclass(frozen=True)
class Dump:
    """A published dump, read without copying: ``aux`` and ``final`` map the files.

    bf16 data is exposed as ``uint16`` arrays holding the raw bits.
    """

    path: Path
    meta: DumpMeta
    aux: np.ndarray
    final: np.ndarray


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


class DumpWriter:
    """Writes one request's dump under a temporary name, then publishes it atomically.

    Rows may arrive in any order and in pieces (chunked prefill); :meth:`publish` refuses unless the
    rows written cover exactly ``[0, num_tokens)``. Use as a context manager: leaving it without
    publishing removes the temporary directory.

    Args:
        root: The dump root.
        rid: The request id (validated).
        num_tokens: T, the number of prompt tokens.
        num_layers: K, the number of aux layers.
        hidden_size: H.
        dtype: The protocol dtype name of the data.
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
        os.pwrite(self._fds[0], aux_view, start * self._aux_row)
        os.pwrite(self._fds[1], final_view, start * self._final_row)
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
        self._close_fds(sync=True)
        _write_json_atomic(self.tmp / META_FILE, meta.model_dump_json())
        (self.tmp / DONE_MARKER).touch()
        final = request_dir(self.root, self.rid)
        os.rename(self.tmp, final)
        return final

    def abort(self) -> None:
        """Drop everything written so far."""
        self._close_fds(sync=False)
        shutil.rmtree(self.tmp, ignore_errors=True)

    def _close_fds(self, *, sync: bool) -> None:
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


def read_meta(path: str | os.PathLike[str], *, sample_id: str | None = None) -> DumpMeta:
    """Check a published dump's markers and read its ``meta.json``.

    Raises:
        DumpFailed: The producer published an ``error`` marker.
        DumpValidationError: The directory is incomplete or its metadata is malformed.
    """
    path = Path(path)
    rid = path.name.removeprefix(REQ_PREFIX)
    if (path / ERROR_MARKER).exists():
        raise DumpFailed(_error_reason(path), sample_id=sample_id, rid=rid)
    if not (path / DONE_MARKER).exists():
        raise DumpValidationError(f"{path} has no done marker", sample_id=sample_id, rid=rid)
    try:
        return DumpMeta.model_validate_json((path / META_FILE).read_bytes())
    except (OSError, ValidationError) as exc:
        raise DumpValidationError(
            f"{path / META_FILE} is unreadable or invalid: {exc}", sample_id=sample_id, rid=rid
        ) from exc


def storage_dtype(dtype: str) -> Any:
    """The numpy dtype a tensor file holds: raw ``uint16`` bits for bf16 (numpy has no bf16)."""
    import numpy as np

    return np.dtype(np.uint16) if dtype == "bfloat16" else np.dtype(dtype)


def check_file_size(
    file: Path, expected: int, shape: Sequence[int], *, sample_id: str | None, rid: str
) -> None:
    """Raise unless ``file`` holds exactly ``expected`` bytes (the tensor of ``shape``)."""
    try:
        size = file.stat().st_size
    except OSError as exc:
        raise DumpValidationError(f"{file} is missing", sample_id=sample_id, rid=rid) from exc
    if size != expected:
        raise DumpValidationError(
            f"{file} holds {size} bytes, expected {expected} for shape {list(shape)}",
            sample_id=sample_id,
            rid=rid,
        )


def read_dump(path: str | os.PathLike[str], *, sample_id: str | None = None) -> Dump:
    """Read a published dump without copying its tensors (they map the files).

    Raises:
        DumpFailed: The producer published an ``error`` marker.
        DumpValidationError: The directory is incomplete or its metadata or files are malformed.
    """
    path = Path(path)
    meta = read_meta(path, sample_id=sample_id)
    np_dtype = storage_dtype(meta.dtype)
    rid = path.name.removeprefix(REQ_PREFIX)
    aux = _map(path / AUX_FILE, np_dtype, meta.aux_shape, sample_id, rid)
    final = _map(path / FINAL_FILE, np_dtype, meta.final_shape, sample_id, rid)
    return Dump(path=path, meta=meta, aux=aux, final=final)


def _map(
    file: Path, dtype: Any, shape: Sequence[int], sample_id: str | None, rid: str
) -> np.ndarray:
    import numpy as np

    expected = int(np.prod(shape)) * np.dtype(dtype).itemsize
    check_file_size(file, expected, shape, sample_id=sample_id, rid=rid)
    if expected == 0:
        return np.zeros(shape, dtype)
    # Copy-on-write mapping: zero-copy, and writable so torch.from_numpy accepts it.
    return np.memmap(file, dtype=dtype, mode="c", shape=tuple(shape))


def _error_reason(path: Path) -> str:
    try:
        info = DumpErrorInfo.model_validate_json((path / ERROR_MARKER).read_bytes())
    except (OSError, ValidationError):
        return f"the producer published an error marker in {path} (unreadable)"
    return f"the producer ({info.producer.name} {info.producer.version}) failed: {info.reason}"


def remove_dump(path: str | os.PathLike[str]) -> None:
    """Delete a dump directory (published or temporary); a missing one is fine.

    The protocol's files are unlinked by name first: ``shutil.rmtree`` lists and stats every
    entry, a dozen calls that each wait for the GIL again in a busy client (15% of a dump's
    ingest on 16 cores). Anything else in the directory is left to ``rmtree``.
    """
    for name in (DONE_MARKER, AUX_FILE, FINAL_FILE, META_FILE, ERROR_MARKER):
        with contextlib.suppress(OSError):
            os.unlink(os.path.join(path, name))
    try:
        os.rmdir(path)
    except OSError:
        shutil.rmtree(path, ignore_errors=True)
