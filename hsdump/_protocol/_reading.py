"""Reading and removing dumps without following links: the consumer's side."""

from __future__ import annotations

import contextlib
import errno
import io
import os
import shutil
import stat
from collections.abc import Iterator, Sequence
from pathlib import Path

from pydantic import ValidationError

from hsdump._exceptions import (
    DumpFailed,
    DumpValidationError,
    ServerNotDumping,
)
from hsdump._protocol._models import DumpErrorInfo, DumpMeta, ProducerManifest
from hsdump._protocol._names import (
    AUX_FILE,
    DONE_MARKER,
    ERROR_MARKER,
    FINAL_FILE,
    META_FILE,
    PRODUCERS_DIR,
    REQ_PREFIX,
    TMP_PREFIX,
)

# O_NONBLOCK: opening a FIFO put in a file's place must not block (it is then refused).
_O_READ = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
_O_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_TRUST_HINT = (
    "Something other than the producer writes into {root}: make the dump root writable only by "
    "the server's and the client's users (docs/protocol.md, 'Who may write the dump root')."
)


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
