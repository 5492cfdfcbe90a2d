"""A FUSE pass-through file system that records every change made to it, for power-loss tests.

`mounted` serves a backing directory at a mount point from a child process (``python
crashfs.py BACKING MOUNT LOG``, on ``mfusepy`` and libfuse) and appends each operation that changes
the tree to an operation log, in the order the file system ran them: the tree at mount time
(``base``), ``create``, ``mkdir``, ``write``, ``truncate``, ``fsync`` (``fdatasync`` too),
``fsyncdir``, ``unlink``, ``rmdir``, ``rename``, ``link``, and ``marker``. Content operations name
the file by a node number the file system gives each file and directory, so a file renamed or
unlinked while open stays the same file; namespace operations name paths. `tests/crashreplay.py`
replays a prefix of the log into the state a power loss at that point may leave.

A writer marks points of the log with `emit_marker`: creating ``.crash-marker-<label>`` logs a
marker and fails with ``ECANCELED``, creating nothing.

The server is single-threaded, so the log is one total order of what reached the file system.
Without the writeback cache (libfuse's default), each ``write`` reaches it when the writer makes it.
"""

from __future__ import annotations

import base64
import contextlib
import ctypes.util
import errno
import json
import os
import select
import shutil
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

MARKER_PREFIX = ".crash-marker-"
_READY = "crashfs ready"
_MOUNT_TIMEOUT_S = 30.0
_STAT_KEYS = (
    "st_mode",
    "st_ino",
    "st_nlink",
    "st_uid",
    "st_gid",
    "st_size",
    "st_atime_ns",
    "st_mtime_ns",
    "st_ctime_ns",
)
_STATVFS_KEYS = (
    "f_bavail",
    "f_bfree",
    "f_blocks",
    "f_bsize",
    "f_favail",
    "f_ffree",
    "f_files",
    "f_frsize",
    "f_namemax",
)


def emit_marker(directory: str | os.PathLike[str], label: str) -> None:
    """Log ``label`` as a marker on the crashfs mounted at (or above) ``directory``.

    Raises:
        RuntimeError: ``directory`` is not on a crashfs (the marker file was created).
    """
    path = os.path.join(directory, MARKER_PREFIX + label)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except OSError as exc:
        if exc.errno == errno.ECANCELED:
            return
        raise
    os.close(fd)
    os.unlink(path)
    raise RuntimeError(f"{directory} is not on a crashfs: marker {label!r} was not logged")


class FuseUnavailable(RuntimeError):
    """The machine cannot mount a FUSE file system (no /dev/fuse, no libfuse, no fusermount)."""


def fuse_missing() -> str | None:
    """Why a FUSE file system cannot be mounted here, or None."""
    if not os.path.exists("/dev/fuse"):
        return "/dev/fuse does not exist"
    if _fusermount() is None:
        return "neither fusermount3 nor fusermount is installed (Debian: apt-get install fuse3)"
    if not (ctypes.util.find_library("fuse3") or ctypes.util.find_library("fuse")):
        return "libfuse is not installed (Debian: apt-get install libfuse3-3)"
    return None


def require_fuse() -> None:
    """Skip the calling test on a developer's machine that cannot mount a FUSE file system (``CI``
    unset: the README's test command on a fresh machine); fail it in CI, which installs what it
    needs (.ci/run), with what is missing."""
    import pytest

    missing = fuse_missing()
    if missing is None:
        return
    if not os.environ.get("CI"):
        pytest.skip(f"crash tests need FUSE: {missing}")
    pytest.fail(f"crash tests need FUSE: {missing} (.ci/run installs fuse3)")


def _fusermount() -> str | None:
    return shutil.which("fusermount3") or shutil.which("fusermount")


@dataclass(frozen=True)
class Mount:
    """A mounted crashfs: the tree at ``mountpoint`` is ``backing``; changes go to ``log``."""

    mountpoint: Path
    backing: Path
    log: Path
    pid: int


@contextlib.contextmanager
def mounted(backing: Path, mountpoint: Path, log: Path) -> Iterator[Mount]:
    """Serve ``backing`` at ``mountpoint`` from a child process until the block ends.

    On exit the file system is unmounted and its process has ended; the log is complete. The
    process's messages go to ``<log>.stderr``.

    Raises:
        FuseUnavailable: The mount failed (the child's error is in the message).
    """
    mountpoint.mkdir(parents=True, exist_ok=True)
    stderr = log.with_name(log.name + ".stderr")
    args = [sys.executable, __file__, str(backing), str(mountpoint), str(log)]
    with open(stderr, "w") as err:
        proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=err, text=True)
    _await_ready(proc, mountpoint, stderr)
    try:
        yield Mount(mountpoint, backing, log, proc.pid)
    finally:
        _unmount(proc, mountpoint, stderr)


def _await_ready(proc: subprocess.Popen[str], mountpoint: Path, stderr: Path) -> None:
    """Block until the server has answered the kernel's INIT, or has died."""
    assert proc.stdout is not None
    readable, _, _ = select.select([proc.stdout], [], [], _MOUNT_TIMEOUT_S)
    if readable and proc.stdout.readline().strip() == _READY:
        return
    proc.kill()
    proc.wait()
    assert proc.stdout is not None
    proc.stdout.close()
    _detach(mountpoint)
    raise FuseUnavailable(
        f"crashfs did not mount at {mountpoint} (exit {proc.returncode}): {_tail(stderr)}"
    )


def _detach(mountpoint: Path) -> None:
    fusermount = _fusermount()
    if fusermount is not None and is_mounted(mountpoint):
        done = subprocess.run([fusermount, "-u", str(mountpoint)], capture_output=True)
        if done.returncode != 0:  # busy: detach it, so the test run leaves no mount behind
            subprocess.run([fusermount, "-u", "-z", str(mountpoint)], capture_output=True)


def _unmount(proc: subprocess.Popen[str], mountpoint: Path, stderr: Path) -> None:
    _detach(mountpoint)
    try:
        proc.wait(timeout=_MOUNT_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    finally:
        assert proc.stdout is not None
        proc.stdout.close()
    if is_mounted(mountpoint):
        raise RuntimeError(f"{mountpoint} is still mounted after fusermount -u")
    if proc.returncode != 0:
        raise RuntimeError(f"crashfs exited with {proc.returncode}: {_tail(stderr)}")


def _tail(path: Path) -> str:
    return path.read_text(errors="replace").strip()[-2000:]


def is_mounted(mountpoint: Path) -> bool:
    """Whether anything is mounted at ``mountpoint`` (from /proc/self/mounts)."""
    target = os.path.realpath(mountpoint)
    with open("/proc/self/mounts") as mounts:
        return any(line.split()[1] == target for line in mounts)


def _encode(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


class RecordingFS:
    """Pass-through to ``backing`` that logs each change to ``log`` (see the module's docstring).

    The operations are mfusepy's (``mfusepy.Operations``); an ``OSError`` raised here reaches the
    caller as its errno.
    """

    use_ns = True  # mfusepy: times in nanoseconds

    def __init__(self, backing: Path, log: IO[str]) -> None:
        self._backing = backing
        self._log = log
        self._nodes: dict[str, int] = {}  # path ("/a/b") -> node, as the tree is now
        self._handles: dict[int, int] = {}  # open file descriptor -> node
        self._next = 0
        self._record_base()

    # -- the log ---------------------------------------------------------------------------------

    def _record(self, op: str, **fields: Any) -> None:
        self._log.write(json.dumps({"op": op, **fields}) + "\n")

    def _new_node(self, path: str) -> int:
        node, self._next = self._next, self._next + 1
        self._nodes[path] = node
        return node

    def _record_base(self) -> None:
        self._record("base", path="/", node=self._new_node("/"), kind="dir")
        for top, dirs, files in os.walk(self._backing):
            here = Path(top).relative_to(self._backing)
            for name in sorted(dirs):
                path = f"/{(here / name).as_posix()}"
                self._record("base", path=path, node=self._new_node(path), kind="dir")
            for name in sorted(files):
                path = f"/{(here / name).as_posix()}"
                data = _encode(Path(top, name).read_bytes())
                self._record("base", path=path, node=self._new_node(path), kind="file", data=data)

    def _real(self, path: str) -> str:
        return os.path.join(self._backing, path.lstrip("/"))

    def _forget(self, path: str) -> None:
        for key in [k for k in self._nodes if k == path or k.startswith(path + "/")]:
            del self._nodes[key]

    # -- mounting --------------------------------------------------------------------------------

    def init_with_config(self, conn_info: Any, config: Any) -> None:
        print(_READY, flush=True)

    def destroy(self, path: str) -> None:
        self._record("unmounted")
        self._log.flush()

    # -- the tree --------------------------------------------------------------------------------

    def getattr(self, path: str, fh: int | None = None) -> dict[str, Any]:
        st = os.fstat(fh) if fh is not None else os.lstat(self._real(path))
        return {key.removesuffix("_ns"): getattr(st, key) for key in _STAT_KEYS}

    def readdir(self, path: str, fh: int) -> list[str]:
        return [".", "..", *os.listdir(self._real(path))]

    def statfs(self, path: str) -> dict[str, int]:
        st = os.statvfs(self._real(path))
        return {key: getattr(st, key) for key in _STATVFS_KEYS}

    def chmod(self, path: str, mode: int) -> int:
        os.chmod(self._real(path), mode)
        return 0

    def chown(self, path: str, uid: int, gid: int) -> int:
        os.chown(self._real(path), uid, gid)
        return 0

    def utimens(self, path: str, times: tuple[int, int] | None = None) -> int:
        os.utime(self._real(path), ns=times)
        return 0

    def mkdir(self, path: str, mode: int) -> int:
        os.mkdir(self._real(path), mode)
        self._record("mkdir", path=path, node=self._new_node(path))
        return 0

    def rmdir(self, path: str) -> int:
        os.rmdir(self._real(path))
        self._forget(path)
        self._record("rmdir", path=path)
        return 0

    def unlink(self, path: str) -> int:
        os.unlink(self._real(path))
        self._forget(path)
        self._record("unlink", path=path)
        return 0

    def rename(self, old: str, new: str) -> int:
        os.rename(self._real(old), self._real(new))
        self._forget(new)
        for key in [k for k in self._nodes if k == old or k.startswith(old + "/")]:
            self._nodes[new + key[len(old) :]] = self._nodes.pop(key)
        self._record("rename", old=old, new=new)
        return 0

    def link(self, target: str, source: str) -> int:
        """A hard link ``target`` to the existing ``source`` (mfusepy's names)."""
        os.link(self._real(source), self._real(target))
        self._nodes[target] = self._nodes[source]
        self._record("link", existing=source, new=target)
        return 0

    def symlink(self, target: str, source: str) -> int:
        raise OSError(errno.EPERM, "crashfs does not model symbolic links")

    # -- files -----------------------------------------------------------------------------------

    def create(self, path: str, mode: int, flags: int) -> int:
        name = os.path.basename(path)
        if name.startswith(MARKER_PREFIX):
            self._record("marker", label=name.removeprefix(MARKER_PREFIX))
            raise OSError(errno.ECANCELED, "a crashfs marker is logged, not created")
        if path in self._nodes:  # created by another opener since the kernel looked it up
            return self.open(path, flags)
        fd = os.open(self._real(path), flags | os.O_CREAT, mode)
        self._handles[fd] = self._new_node(path)
        self._record("create", path=path, node=self._handles[fd])
        return fd

    def open(self, path: str, flags: int) -> int:
        fd = os.open(self._real(path), flags)
        self._handles[fd] = self._nodes[path]
        if flags & os.O_TRUNC and flags & os.O_ACCMODE != os.O_RDONLY:
            self._record("truncate", node=self._handles[fd], length=0)
        return fd

    def read(self, path: str, size: int, offset: int, fh: int) -> bytes:
        return os.pread(fh, size, offset)

    def write(self, path: str, data: bytes, offset: int, fh: int) -> int:
        written = os.pwrite(fh, data, offset)
        self._record("write", node=self._handles[fh], offset=offset, data=_encode(data[:written]))
        return written

    def truncate(self, path: str, length: int, fh: int | None = None) -> int:
        if fh is not None:
            os.ftruncate(fh, length)
            node = self._handles[fh]
        else:
            os.truncate(self._real(path), length)
            node = self._nodes[path]
        self._record("truncate", node=node, length=length)
        return 0

    def fsync(self, path: str, datasync: int, fh: int) -> int:
        # Nothing is flushed on the backing disk: the log is what a crash is built from.
        self._record("fsync", node=self._handles[fh], datasync=bool(datasync))
        return 0

    def fsyncdir(self, path: str, datasync: int, fh: int) -> int:
        self._record("fsyncdir", node=self._nodes[path], path=path)
        return 0

    def release(self, path: str, fh: int) -> int:
        os.close(fh)
        del self._handles[fh]
        return 0


def serve(backing: Path, mountpoint: Path, log_path: Path) -> None:
    """Run the file system in this process until it is unmounted."""
    import mfusepy

    with open(log_path, "w") as log:
        # One thread: the log is one order. hard_remove: an unlinked open file is not renamed to
        # .fuse_hidden*, which would be logged as a rename the writer never made.
        mfusepy.FUSE(
            RecordingFS(backing, log),
            str(mountpoint),
            foreground=True,
            nothreads=True,
            hard_remove=True,
        )


if __name__ == "__main__":
    serve(Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3]))
