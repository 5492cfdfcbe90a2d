"""Ownership of request ids in a dump root, and removal of what crashed runs left behind.

Each client takes a random id and holds an exclusive ``flock`` on ``_clients/<id>.lock`` for its
lifetime; its rids are ``<prefix><id>-<hex>``. A ``req_`` directory is stale when its client's lock
is free (the client is gone) or, for names no client pattern explains, when it is older than
``stale_after``. A second live client's dumps are therefore never touched.

A temporary dump root (``hsdump-*``, for an embedded server) works the same way: its owner holds
a lock on ``<root>/_owner.lock`` while it runs, so the next run removes a root whose owner was
killed, even with ``kill -9``.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import re
import shutil
import tempfile
import time
import uuid
from pathlib import Path

from hsdump._exceptions import ConfigError
from hsdump._locking import flock_held
from hsdump._protocol import DEFAULT_RID_PREFIX, REQ_PREFIX, TMP_PREFIX

__all__ = ["ClientLease", "TempRoot", "remove_stale", "remove_stale_roots"]

logger = logging.getLogger(__name__)
CLIENTS_DIR = "_clients"
TEMP_ROOT_PREFIX, OWNER_FILE = "hsdump-", "_owner.lock"


class ClientLease:
    """This client's id in a dump root, held by an ``flock`` until `release`."""

    def __init__(self, root: Path, rid_prefix: str = DEFAULT_RID_PREFIX):
        self.root = root
        self.client_id = uuid.uuid4().hex[:12]
        self.rid_prefix = rid_prefix
        directory = root / CLIENTS_DIR
        self.path = directory / f"{self.client_id}.lock"
        self._fd: int | None = None
        try:
            directory.mkdir(parents=True, exist_ok=True)
            self._fd = _create_locked(self.path)
        except OSError as exc:
            raise ConfigError(
                f"cannot take a client id in {directory}: {exc.strerror or exc}. A client needs "
                f"to write in the dump root {root}: run as a user who may write there, or pass "
                "the dump root this server writes to (--dump-dir, HSDUMP_DUMP_DIR)"
            ) from exc

    def new_rid(self) -> str:
        """A fresh rid owned by this client."""
        return f"{self.rid_prefix}{self.client_id}-{uuid.uuid4().hex[:16]}"

    def release(self) -> None:
        """Give up the id (idempotent)."""
        if self._fd is not None:
            with contextlib.suppress(OSError):
                self.path.unlink()
            os.close(self._fd)
            self._fd = None


class TempRoot:
    """A temporary dump root that this process owns while it lives.

    Args:
        parent: The directory to create it in (default: the system's temporary directory).

    Raises:
        ConfigError: ``parent`` is not a directory this user may write.
    """

    def __init__(self, parent: str | os.PathLike[str] | None = None):
        where = Path(parent) if parent is not None else Path(tempfile.gettempdir())
        try:
            self.path = Path(tempfile.mkdtemp(prefix=TEMP_ROOT_PREFIX, dir=where))
            try:
                self._fd: int | None = _create_locked(self.path / OWNER_FILE)
            except OSError:
                shutil.rmtree(self.path, ignore_errors=True)
                raise
        except OSError as exc:
            raise ConfigError(
                f"cannot create a temporary dump root in {where}: {exc.strerror or exc}. Pass "
                "--dump-dir with a directory this user may write"
            ) from exc

    def remove(self) -> None:
        """Remove the root and everything in it (idempotent)."""
        shutil.rmtree(self.path, ignore_errors=True)
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def remove_stale_roots(parent: str | os.PathLike[str] | None = None) -> int:
    """Remove the temporary dump roots in ``parent`` whose owner has exited; returns how many.

    Only roots with an owner file are considered: one without is being created right now (or
    was made by an older hsdump, or by hand) and is left alone.
    """
    where = Path(parent) if parent is not None else Path(tempfile.gettempdir())
    removed = 0
    for path in where.glob(f"{TEMP_ROOT_PREFIX}*"):
        owner = path / OWNER_FILE
        if not path.is_symlink() and owner.is_file() and not flock_held(owner):
            shutil.rmtree(path, ignore_errors=True)
            removed += 1
    if removed:
        logger.info("removed %d temporary dump roots of exited runs from %s", removed, where)
    return removed


def _create_locked(path: Path) -> int:
    """Create ``path`` holding this pid, locked by this process until the descriptor closes."""
    # Locked under a temporary name, then renamed: the file is never visible unlocked.
    tmp = path.with_name(f".{path.name}.tmp")
    fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.write(fd, f"{os.getpid()}\n".encode())
        os.rename(tmp, path)
    except OSError:
        os.close(fd)
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
    return fd


def _client_alive(root: Path, client_id: str) -> bool:
    return flock_held(root / CLIENTS_DIR / f"{client_id}.lock")


def _is_stale(
    root: Path, entry: os.DirEntry[str], owned: re.Pattern[str], now: float, stale_after: float
) -> bool:
    match = owned.match(entry.name)
    if match is not None:
        return not _client_alive(root, match.group(1))
    # Temporary dirs belong to a producer that may still be writing: only age makes them stale.
    return now - entry.stat(follow_symlinks=False).st_mtime > stale_after


def remove_stale(
    root: Path, *, rid_prefix: str = DEFAULT_RID_PREFIX, stale_after: float = 3600.0
) -> int:
    """Remove dumps and temp dirs no live client can own; returns how many were removed."""
    if not root.is_dir():
        return 0
    now, removed = time.time(), 0
    ours = (REQ_PREFIX + rid_prefix, TMP_PREFIX + REQ_PREFIX + rid_prefix)
    owned = re.compile(re.escape(REQ_PREFIX + rid_prefix) + r"([0-9a-f]{12})-[0-9a-f]{16}$")
    with os.scandir(root) as entries:
        for entry in entries:
            mine = entry.name.startswith(ours) and entry.is_dir(follow_symlinks=False)
            if mine and _is_stale(root, entry, owned, now, stale_after):
                shutil.rmtree(entry.path, ignore_errors=True)
                removed += 1
    _remove_dead_leases(root)
    if removed:
        logger.info("removed %d stale dump directories from %s", removed, root)
    return removed


def _remove_dead_leases(root: Path) -> None:
    for path in (root / CLIENTS_DIR).glob("*.lock"):
        if not _client_alive(root, path.stem):
            with contextlib.suppress(OSError):
                path.unlink()
