"""Holding a writer's part exclusively: a file lock beside a local store, a lease beside an S3
store (`hsdump._store.lease`); and asking whether a part's writer is gone."""

from __future__ import annotations

import fcntl
import os
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from hsdump._exceptions import PartLockedError, StoreError
from hsdump._locking import flock_held
from hsdump._store.objstore import call_s3, s3_location
from hsdump._store.roots import LOCK_DIR_SUFFIX, PART_PREFIX, local_dir, lock_dir

if TYPE_CHECKING:
    import zarr

__all__ = ["PartLock", "break_lease", "lock_part", "part_holder", "part_released"]


_LEGACY_LOCK_FILE = ".hsdump-writer.lock"  # inside the part, before the locks moved out


class PartLock(Protocol):
    """A writer's hold on one part: a local file lock, an S3 lease, or nothing."""

    def check(self) -> None:
        """Raise `PartLockLostError` if the part may no longer be committed to."""

    def release(self) -> None:
        """Let the part go (idempotent)."""


class _FileLock:
    """``flock`` on open descriptors (none: a store hsdump cannot lock, such as a zarr
    ``MemoryStore``, where distinct writer ids are up to the caller); the OS frees them if the
    process dies."""

    def __init__(self, fds: list[int]) -> None:
        self._fds = fds

    def check(self) -> None:
        return None

    def release(self) -> None:
        for fd in self._fds:
            os.close(fd)
        self._fds = []


def _lease_key(root: zarr.Group, name: str) -> tuple[str, str] | None:
    """(bucket, key) of part ``name``'s lease beside an S3 store; None for other stores."""
    location = s3_location(root.store)
    if location is None or not location.prefix:
        return None
    return location.bucket, f"{location.prefix}{LOCK_DIR_SUFFIX}/{name}.lease"


def break_lease(root: zarr.Group, name: str) -> None:
    """Delete the S3 lease of part ``name``, whose writer is known to be dead (a killed Ray actor
    on another node), so the part can be reopened now rather than once the lease expires.

    A writer that still lived would find its lease gone at its next commit and stop there.
    """
    found = _lease_key(root, name)
    if found is not None:
        call_s3(root.store, "delete_object", Bucket=found[0], Key=found[1])


def part_holder(root: zarr.Group, name: str) -> str | None:
    """Who holds part ``name`` now: ``"part-x (pid P on HOST)"`` for an S3 lease, ``"part-x"``
    for a local lock; None when nobody does.

    A free local lock is taken for an instant to see that it is free, as the dump root's janitor
    does with client locks.
    """
    if s3_location(root.store) is not None:
        from hsdump._store.lease import lease_holder

        found = _lease_key(root, name)
        holder = None if found is None else lease_holder(root.store, *found)
        return None if holder is None else f"{name} ({holder})"
    locks = lock_dir(root)
    return name if locks is not None and flock_held(locks / f"{name}.lock") else None


def lock_part(
    root: zarr.Group, name: str, where: str, writer_id: str = "", *, ttl_s: float = 60.0
) -> PartLock:
    """Hold the part exclusively while it is open: a file lock beside a local store, a lease
    object beside an S3 store (`hsdump._store.lease`), nothing for other stores.

    Raises:
        PartLockedError: Another live writer holds the part.
    """
    location = s3_location(root.store)
    if location is not None:
        from hsdump._store.lease import Lease

        found = _lease_key(root, name)
        if found is None:
            raise StoreError(
                f"{where} is a whole bucket: a writer keeps its lease beside the store, so give "
                f"the store a prefix (s3://{location.bucket}/<name>.zarr)"
            )
        key = "/".join(found)
        return Lease.acquire(root.store, name, writer_id or name, where, key=key, ttl_s=ttl_s)
    return _FileLock(_lock_local(root, name, where))


def _lock_local(root: zarr.Group, name: str, where: str) -> list[int]:
    """The descriptors holding a local part's locks (none for a store that is not local)."""
    local, locks = local_dir(root), lock_dir(root)
    if local is None or locks is None:
        return []
    locks.mkdir(exist_ok=True)
    fd = _flock(locks / f"{name}.lock", name, where, create=True)
    assert fd is not None  # created if missing
    fds = [fd]
    legacy = local / name / _LEGACY_LOCK_FILE
    try:
        # A part written before the locks moved out: an older hsdump may hold the old lock.
        old = _flock(legacy, name, where, create=False) if legacy.exists() else None
    except BaseException:
        os.close(fds[0])
        raise
    if old is not None:
        legacy.unlink(missing_ok=True)  # kept locked until release, so zarr's walk stays clean
        fds.append(old)
    return fds


def part_released(store: str, writer_id: str, timeout: float) -> bool:
    """Whether the lock of ``writer_id``'s part of the local store at ``store`` is free within
    ``timeout`` seconds (its writer's process is gone). True at once for object storage, whose
    parts are leased, and for a part that never opened."""
    if "://" in store:
        return True
    root = Path(store).resolve()
    lock = root.parent / f"{root.name}{LOCK_DIR_SUFFIX}" / f"{PART_PREFIX}{writer_id}.lock"
    try:
        fd = os.open(lock, os.O_RDWR)
    except FileNotFoundError:
        return True
    freed = threading.Event()

    def take() -> None:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)  # blocks until the dead writer's lock is released
            fcntl.flock(fd, fcntl.LOCK_UN)
        finally:
            os.close(fd)
        freed.set()

    threading.Thread(target=take, name=f"hsdump-fence-{writer_id}", daemon=True).start()
    return freed.wait(timeout)


def _flock(path: Path, name: str, where: str, *, create: bool) -> int | None:
    """An open descriptor of ``path`` holding its exclusive lock (None: ``path`` vanished)."""
    try:
        fd = os.open(path, os.O_RDWR | (os.O_CREAT if create else 0), 0o644)
    except FileNotFoundError:
        if create:
            raise
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError as exc:
        os.close(fd)
        raise PartLockedError(
            f"another live process is writing part {name!r} of {where} (it holds {path}): give "
            "each concurrent writer its own writer_id (one part per writer)"
        ) from exc
    return fd
