"""Files that survive a power loss: what a local store writes is on disk before it counts.

A rename makes a file appear whole or not at all, but only for processes: after a machine goes
down, ext4 with delayed allocation may keep a renamed file's name and lose its blocks. So every
file of a local store is written to a temporary name, its data flushed (``fdatasync``), renamed
into place, and its directory flushed (``fsync``) so that the name stays too; a directory made on
the way is flushed into its parent. A part's commit point, its ``zarr.json``, is written last,
this same way, after the shards and the index it references: `HiddenStateStore.flush` returns
once all of it is durable. Each shard is flushed by the background writer that wrote it, while
the extraction goes on, so closing a store has no gigabytes left to flush.
"""

from __future__ import annotations

import os
import uuid
from pathlib import Path
from typing import Any

from zarr.storage import LocalStore

__all__ = ["PARTIAL_SUFFIX", "DurableLocalStore", "make_dirs", "sync_dir", "write_file_atomic"]

_IOV_MAX = 1024  # Linux's limit on buffers per writev
# A file being written; zarr's LocalStore uses the same suffix, and reopening a part for writing
# removes what a killed writer left with it.
PARTIAL_SUFFIX = ".partial"


def write_file_atomic(
    path: Path, pieces: list[bytes | memoryview], *, exclusive: bool = False
) -> None:
    """Write ``pieces`` to ``path`` as one file that appears whole or not at all, and is on disk
    (data, name and any directory made for it) when this returns.

    The pieces go to the kernel in one ``writev`` instead of being joined first, and no event
    loop is involved: a shard write costs one copy of its bytes and almost no time holding the
    GIL.

    Raises:
        FileExistsError: ``exclusive`` and ``path`` exists.
        OSError: The write failed; nothing is left under ``path``.
    """
    make_dirs(path.parent)
    tmp = path.with_name(f"{path.name}.{uuid.uuid4().hex}{PARTIAL_SUFFIX}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        try:
            _writev_all(fd, [memoryview(p) for p in pieces])
            os.fdatasync(fd)
        finally:
            os.close(fd)
        if exclusive:
            _link_new(tmp, path)
        else:
            os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    sync_dir(path.parent)


def _link_new(tmp: Path, path: Path) -> None:
    """Give ``tmp``'s file the name ``path`` unless that name exists (a rename would replace it)."""
    try:
        os.link(tmp, path)
    except FileExistsError:
        raise
    except OSError:  # a file system without hard links: not atomic against a racing writer
        if path.exists():
            raise FileExistsError(path) from None
        os.replace(tmp, path)
        return
    tmp.unlink()


def make_dirs(path: Path) -> None:
    """``mkdir -p path``, each directory made flushed into its parent."""
    if path.is_dir():
        return
    make_dirs(path.parent)
    try:
        path.mkdir()
    except FileExistsError:
        return
    sync_dir(path.parent)


def sync_dir(path: Path) -> None:
    """Flush a directory's entries (names made, renamed or removed in it) to disk."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _writev_all(fd: int, views: list[memoryview]) -> None:
    while views:
        written = os.writev(fd, views[:_IOV_MAX])
        while views and written >= len(views[0]):
            written -= len(views[0])
            views.pop(0)
        if views and written:
            views[0] = views[0][written:]


class DurableLocalStore(LocalStore):
    """zarr's `LocalStore`, whose every write is on disk when it returns (`write_file_atomic`):
    the index chunks and the ``zarr.json`` of a commit included.

    The write runs in zarr's event loop, not in a thread of its own: a commit's few small files
    are written one after another, and a write whose caller zarr cancels (when another write of
    the same call fails) is never left running behind it, still making its temporary file.
    """

    async def _open(self, **kwargs: Any) -> None:
        if not self.read_only:
            # The store's own directory, and its name in its parent: the first commit needs both.
            make_dirs(self.root)
            sync_dir(self.root.parent)
        await super()._open(**kwargs)

    async def _set(self, key: str, value: Any, exclusive: bool = False) -> None:
        if not self._is_open:
            await self._open()
        self._check_writable()
        write_file_atomic(self.root / key, [value.as_buffer_like()], exclusive=exclusive)
