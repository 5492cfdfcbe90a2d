"""Ownership of request ids in a dump root, and removal of what crashed runs left behind.

Each client takes a random id and holds an exclusive ``flock`` on ``_clients/<id>.lock`` for its
lifetime; its rids are ``<prefix><id>-<hex>``. A ``req_`` directory is stale when its client's lock
is free (the client is gone) or, for names no client pattern explains, when it is older than
``stale_after``. A second live client's dumps are therefore never touched.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import re
import shutil
import time
import uuid
from pathlib import Path

from hsdump._exceptions import ConfigError
from hsdump._protocol import DEFAULT_RID_PREFIX, REQ_PREFIX, TMP_PREFIX

__all__ = ["ClientLease", "remove_stale"]

logger = logging.getLogger(__name__)
CLIENTS_DIR = "_clients"


class ClientLease:
    """This client's id in a dump root, held by an ``flock`` until :meth:`release`."""

    def __init__(self, root: Path, rid_prefix: str = DEFAULT_RID_PREFIX):
        self.root = root
        self.client_id = uuid.uuid4().hex[:12]
        self.rid_prefix = rid_prefix
        directory = root / CLIENTS_DIR
        self.path = directory / f"{self.client_id}.lock"
        # Lock under a temporary name, then rename: a lease is never visible unlocked.
        tmp = directory / f".{self.client_id}.tmp"
        self._fd: int | None = None
        try:
            directory.mkdir(parents=True, exist_ok=True)
            self._fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            os.write(self._fd, f"{os.getpid()}\n".encode())
            os.rename(tmp, self.path)
        except OSError as exc:
            with contextlib.suppress(OSError):
                tmp.unlink()
            self.release()
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


def _client_alive(root: Path, client_id: str) -> bool:
    path = root / CLIENTS_DIR / f"{client_id}.lock"
    try:
        fd = os.open(path, os.O_RDWR)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
    return False


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
