"""Whether a path lies on a tmpfs that fills its files through 4 KB pages.

A fresh tmpfs file takes a page fault, a zeroed page and a page-table entry per page it is filled
with, and unmapping it walks them all again. With 2 MB pages a thread pool fills dump files at
3-4x the rate per core (docs/sglang.md has the figures), so the SGLang plugin warns at start-up
when its dump root is on a tmpfs without them. The plugin imports this module; it reads only
``/proc/mounts`` and sysfs.
"""

from __future__ import annotations

import contextlib
import os
import re
from pathlib import Path, PurePosixPath

__all__ = [
    "HUGE_PAGES_DOC",
    "MOUNTS_FILE",
    "SHMEM_ENABLED_FILE",
    "WARNED_FILE",
    "small_page_tmpfs",
    "small_page_warning",
]

MOUNTS_FILE = Path("/proc/mounts")
SHMEM_ENABLED_FILE = Path("/sys/kernel/mm/transparent_hugepage/shmem_enabled")
HUGE_PAGES_DOC = "docs/sglang.md#put-the-dump-root-on-a-tmpfs-with-huge-pages"
WARNED_FILE = "_small_pages_warned"  # in a dump root: its 4 KB-page warning was given

# huge=advise counts: the plugin's mapped dump files ask for huge pages with MADV_HUGEPAGE.
_HUGE_OPTIONS = frozenset({"always", "within_size", "advise"})
_OCTAL_ESCAPE = re.compile(r"\\([0-7]{3})")


def small_page_tmpfs(
    path: str | os.PathLike[str],
    *,
    mounts: str | None = None,
    shmem_enabled: str | None = None,
) -> str | None:
    """The mount point of the tmpfs holding ``path`` if that tmpfs uses only 4 KB pages, else None.

    ``path`` need not exist yet: the mount is that of its nearest existing parent, symbolic links
    resolved. A tmpfs has huge pages when mounted with ``huge=always``, ``huge=within_size`` or
    ``huge=advise``, or when the kernel forces them (``shmem_enabled`` is ``force``, or ``always``
    for a mount without a ``huge=`` option); ``deny`` takes them from every mount.

    Args:
        path: A file or directory, e.g. the dump root.
        mounts: The text of ``/proc/mounts``; read from there when None.
        shmem_enabled: The text of ``/sys/kernel/mm/transparent_hugepage/shmem_enabled``; read
            from there when None.

    Returns:
        The mount point, or None when ``path`` is not on a tmpfs, the tmpfs has huge pages, or
        either file cannot be read (nothing to warn about that can be known).
    """
    try:
        where = PurePosixPath(Path(path).resolve())
        mount = _mount_of(where, _read(MOUNTS_FILE) if mounts is None else mounts)
        if mount is None or mount[1] != "tmpfs":
            return None
        kernel = _bracketed(_read(SHMEM_ENABLED_FILE) if shmem_enabled is None else shmem_enabled)
    except (OSError, RuntimeError):  # RuntimeError: a symbolic link loop
        return None
    point, _, options = mount
    return None if kernel is None or _has_huge_pages(options, kernel) else point


def _read(file: Path) -> str:
    return file.read_text(encoding="utf-8", errors="surrogateescape")


def _mount_of(where: PurePosixPath, mounts: str) -> tuple[str, str, str] | None:
    """(mount point, type, options) of the longest mount point holding ``where``."""
    best: tuple[str, str, str] | None = None
    for line in mounts.splitlines():
        fields = line.split()
        if len(fields) < 4:
            continue
        point = _OCTAL_ESCAPE.sub(lambda m: chr(int(m[1], 8)), fields[1])
        # ">=": a later line for the same point was mounted over the earlier one.
        if where.is_relative_to(point) and (best is None or len(point) >= len(best[0])):
            best = (point, fields[2], fields[3])
    return best


def small_page_warning(root: str | os.PathLike[str]) -> str | None:
    """What the plugin logs at start-up, and the client says before a run, when the dump root
    ``root`` lies on a tmpfs with 4 KB pages: one line, given once per dump root (None after
    that, and when the root is fine).

    Once: the first process to give it leaves `WARNED_FILE` in the root, which lives as long as
    the tmpfs (the server, its ranks and every client run share one root).
    """
    mount = small_page_tmpfs(root)
    if mount is None or not _first_to_warn(Path(root)):
        return None
    # Measured on a 16-core H200 host (docs/sglang.md): 4.0 vs 13.3 GB/s with 4 threads, and 4
    # write threads carried 0.31-0.36 instead of 0.79-0.85 of the server's rate at H=7168.
    return (
        f"the dump root {root} lies on the tmpfs {mount}, which has 4 KB pages: dumps there cost "
        f"3-4x the CPU of a tmpfs with huge pages; mount one as {HUGE_PAGES_DOC} shows"
    )


def _first_to_warn(root: Path) -> bool:
    """Whether no process warned about ``root`` before; marks it warned where it exists."""
    marker = root / WARNED_FILE
    if marker.exists():
        return False
    # A root that does not exist yet, or is not ours to write: warned about each time.
    with contextlib.suppress(OSError):
        marker.touch()
    return True


def _bracketed(text: str) -> str | None:
    found = re.search(r"\[(\w+)\]", text)
    return found[1] if found else None


def _has_huge_pages(options: str, kernel: str) -> bool:
    huge = next((o[5:] for o in options.split(",") if o.startswith("huge=")), None)
    if kernel in ("force", "deny"):
        return kernel == "force"
    return huge in _HUGE_OPTIONS or (huge is None and kernel == "always")
