"""crashfs (tests/crashfs.py) and its replay (tests/crashreplay.py): what a simulated power loss
keeps of each kind of change, checked on one scripted run through a real FUSE mount."""

from __future__ import annotations

import ctypes
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
from crashfs import emit_marker, is_mounted, mounted, require_fuse
from crashreplay import Op, Replay, read_log

Tree = dict[str, bytes | None]  # path -> content, None for a directory
_SYNC_FILE_RANGE_ALL = 1 | 2 | 4  # WAIT_BEFORE | WRITE | WAIT_AFTER


def _sync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)  # reaches the file system as fsyncdir
    finally:
        os.close(fd)


def _write(path: Path, data: bytes, sync: Callable[[int], None] | None = None) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        os.write(fd, data)
        if sync is not None:
            sync(fd)
    finally:
        os.close(fd)


def _sync_file_range(fd: int) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.sync_file_range(fd, ctypes.c_int64(0), ctypes.c_int64(0), _SYNC_FILE_RANGE_ALL):
        raise OSError(ctypes.get_errno(), "sync_file_range failed")


def _script(root: Path) -> None:
    """Each step's changes, then a marker named after what a crash there should keep."""
    d = root / "d"
    d.mkdir()
    _write(d / "a.tmp", b"A")
    os.rename(d / "a.tmp", d / "a")
    emit_marker(root, "renamed")
    _sync_dir(root)
    emit_marker(root, "root-synced")
    _sync_dir(d)
    emit_marker(root, "dir-synced")
    _write(d / "b.tmp", b"B1", os.fdatasync)
    os.rename(d / "b.tmp", d / "b")
    _sync_dir(d)
    emit_marker(root, "synced")
    _write(d / "b", b"B2", _sync_file_range)
    os.truncate(root / "old", 0)
    emit_marker(root, "overwritten")
    _write(d / "b", b"B3", os.fsync)
    emit_marker(root, "overwrite-synced")
    os.unlink(d / "a")
    os.rename(d / "b", d / "c")
    os.link(d / "c", d / "e")
    emit_marker(root, "unlinked")
    _sync_dir(d)
    emit_marker(root, "unlink-synced")


@dataclass(frozen=True)
class Scripted:
    """The log of `_script` on a mount of ``backing`` (which held ``old``), and the pid of the
    file system's process."""

    ops: list[Op]
    backing: Path
    pid: int


@pytest.fixture(scope="module")
def scripted(tmp_path_factory: pytest.TempPathFactory) -> Scripted:
    require_fuse()
    base = tmp_path_factory.mktemp("crashfs")
    (base / "backing").mkdir()
    (base / "backing" / "old").write_bytes(b"mount-time")
    with mounted(base / "backing", base / "mnt", base / "ops.log") as mount:
        _script(mount.mountpoint)
    return Scripted(read_log(base / "ops.log"), base / "backing", mount.pid)


def _tree(root: Path) -> Tree:
    return {
        str(p.relative_to(root)): None if p.is_dir() else p.read_bytes()
        for p in sorted(root.rglob("*"))
    }


def _marker(ops: list[Op], label: str) -> int:
    return next(op.index for op in ops if op.op == "marker" and op.fields["label"] == label)


def _crash_at(ops: list[Op], label: str, tmp_path: Path) -> Tree:
    """The tree a power loss right at marker ``label`` leaves."""
    replay = Replay()
    for op in ops[: _marker(ops, label)]:
        replay.apply(op)
    replay.materialise(tmp_path / label)
    return _tree(tmp_path / label)


def test_a_new_name_is_lost_until_its_directory_is_synced(
    scripted: Scripted, tmp_path: Path
) -> None:
    assert _crash_at(scripted.ops, "renamed", tmp_path) == {"old": b"mount-time"}
    assert _crash_at(scripted.ops, "root-synced", tmp_path) == {"d": None, "old": b"mount-time"}


def test_names_kept_as_made_show_unsynced_data_as_empty_files(
    scripted: Scripted, tmp_path: Path
) -> None:
    replay = Replay()
    for op in scripted.ops[: _marker(scripted.ops, "renamed")]:
        replay.apply(op)
    replay.materialise(tmp_path, names="made")
    assert _tree(tmp_path) == {"d": None, "d/a": b"", "old": b"mount-time"}


def test_a_durable_name_whose_data_was_never_synced_is_an_empty_file(
    scripted: Scripted, tmp_path: Path
) -> None:
    assert _crash_at(scripted.ops, "dir-synced", tmp_path) == {
        "d": None,
        "d/a": b"",
        "old": b"mount-time",
    }


def test_data_synced_before_the_rename_and_the_directory_sync_survive(
    scripted: Scripted, tmp_path: Path
) -> None:
    assert _crash_at(scripted.ops, "synced", tmp_path)["d/b"] == b"B1"


def test_writes_and_truncations_are_lost_until_the_file_is_synced(
    scripted: Scripted, tmp_path: Path
) -> None:
    overwritten = _crash_at(scripted.ops, "overwritten", tmp_path)
    assert (overwritten["d/b"], overwritten["old"]) == (b"B1", b"mount-time")  # sync_file_range
    assert _crash_at(scripted.ops, "overwrite-synced", tmp_path)["d/b"] == b"B3"


def test_unlinks_renames_and_links_take_effect_at_the_directory_sync(
    scripted: Scripted, tmp_path: Path
) -> None:
    before = _crash_at(scripted.ops, "unlinked", tmp_path)
    assert sorted(before) == ["d", "d/a", "d/b", "old"]
    after = _crash_at(scripted.ops, "unlink-synced", tmp_path)
    assert sorted(after) == ["d", "d/c", "d/e", "old"]
    assert after["d/c"] == after["d/e"] == b"B3"


def test_the_whole_log_replays_to_the_backing_directory(scripted: Scripted, tmp_path: Path) -> None:
    replay = Replay()
    for op in scripted.ops:
        replay.apply(op)
    replay.materialise(tmp_path / "replayed", names="made", data="made")
    assert _tree(tmp_path / "replayed") == _tree(scripted.backing)
    assert [m.fields["label"] for m in replay.markers][:2] == ["renamed", "root-synced"]
    assert not [p for p in _tree(scripted.backing) if "crash-marker" in p]


def test_unmounting_leaves_no_mount_and_no_process(scripted: Scripted, tmp_path: Path) -> None:
    assert not is_mounted(scripted.backing.parent / "mnt")
    with pytest.raises(ProcessLookupError):
        os.kill(scripted.pid, 0)


def test_a_marker_off_crashfs_is_refused(tmp_path: Path) -> None:
    with pytest.raises(RuntimeError, match="not on a crashfs"):
        emit_marker(tmp_path, "durable:s0")
    assert list(tmp_path.iterdir()) == []
