"""Which dump roots lie on a tmpfs with 4 KB pages (the plugin's start-up warning about them, and
how the mount table is read, are in tests/test_sglang_patch.py).

The mount table and the kernel's shmem setting are given as text (no tmpfs can be mounted here);
the paths are real, so that the nearest existing parent and symbolic links are resolved for real.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from hsdump.testing import small_page_tmpfs

NEVER = "always within_size advise [never] deny force"


def mounts(*lines: tuple[Path | str, str, str]) -> str:
    """/proc/mounts text: the root on ext4, then (mount point, type, options) per line."""
    rows = ["/dev/vda / ext4 rw,relatime 0 0"]
    for point, kind, options in lines:
        escaped = str(point).replace(" ", "\\040")  # as the kernel writes a space
        rows.append(f"{kind} {escaped} {kind} {options} 0 0")
    return "\n".join(rows) + "\n"


@pytest.fixture
def shm(tmp_path: Path) -> Path:
    path = tmp_path.resolve() / "shm"
    path.mkdir()
    return path


def test_a_root_on_a_tmpfs_with_4kb_pages_names_the_mount_point(shm: Path) -> None:
    table = mounts((shm, "tmpfs", "rw,relatime,size=1048576k"))
    assert small_page_tmpfs(shm / "hsdump", mounts=table, shmem_enabled=NEVER) == str(shm)


def test_huge_never_is_a_tmpfs_with_4kb_pages(shm: Path) -> None:
    table = mounts((shm, "tmpfs", "rw,huge=never"))
    assert small_page_tmpfs(shm, mounts=table, shmem_enabled=NEVER) == str(shm)


@pytest.mark.parametrize("huge", ["within_size", "always", "advise"])
def test_a_tmpfs_mounted_with_huge_pages_is_fine(shm: Path, huge: str) -> None:
    table = mounts((shm, "tmpfs", f"rw,relatime,size=64g,huge={huge},mode=1777"))
    assert small_page_tmpfs(shm / "hsdump", mounts=table, shmem_enabled=NEVER) is None


def test_a_root_on_another_filesystem_is_fine(shm: Path) -> None:
    table = mounts((shm, "xfs", "rw,relatime"))
    assert small_page_tmpfs(shm / "hsdump", mounts=table, shmem_enabled=NEVER) is None


def test_the_longest_mount_point_holding_the_root_wins(shm: Path) -> None:
    (shm / "small").mkdir()
    (shm / "small2").mkdir()
    # The inner mount is listed first: the order of the lines must not decide.
    table = mounts((shm / "small", "tmpfs", "rw"), (shm, "tmpfs", "rw,huge=within_size"))
    assert small_page_tmpfs(shm / "small/d", mounts=table, shmem_enabled=NEVER) == f"{shm}/small"
    assert small_page_tmpfs(shm / "small2/d", mounts=table, shmem_enabled=NEVER) is None
    assert small_page_tmpfs(shm / "d", mounts=table, shmem_enabled=NEVER) is None


def test_a_point_mounted_over_counts_as_its_last_mount(shm: Path) -> None:
    table = mounts((shm, "tmpfs", "rw,huge=within_size"), (shm, "tmpfs", "rw"))
    assert small_page_tmpfs(shm, mounts=table, shmem_enabled=NEVER) == str(shm)


def test_a_root_that_does_not_exist_yet_is_found_through_its_parents(shm: Path) -> None:
    table = mounts((shm, "tmpfs", "rw"))
    assert small_page_tmpfs(shm / "a/b/hsdump", mounts=table, shmem_enabled=NEVER) == str(shm)


def test_symbolic_links_are_resolved(shm: Path) -> None:
    link = shm.parent / "link"
    link.symlink_to(shm)
    table = mounts((shm, "tmpfs", "rw"))
    assert small_page_tmpfs(link / "hsdump", mounts=table, shmem_enabled=NEVER) == str(shm)


def test_octal_escapes_in_mount_points_are_decoded(shm: Path) -> None:
    spaced = shm / "my dumps"
    spaced.mkdir()
    table = mounts((spaced, "tmpfs", "rw"))
    assert r"my\040dumps" in table
    assert small_page_tmpfs(spaced / "hsdump", mounts=table, shmem_enabled=NEVER) == str(spaced)


@pytest.mark.parametrize(
    ("options", "kernel", "small"),
    [
        ("rw,huge=never", "always within_size advise never deny [force]", False),
        ("rw", "[always] within_size advise never deny force", False),
        ("rw,huge=never", "[always] within_size advise never deny force", True),
        ("rw,huge=within_size", "always within_size advise never [deny] force", True),
        ("rw", "always within_size [advise] never deny force", True),
    ],
)
def test_the_kernels_shmem_setting_can_force_or_deny_huge_pages(
    shm: Path, options: str, kernel: str, small: bool
) -> None:
    table = mounts((shm, "tmpfs", options))
    assert small_page_tmpfs(shm, mounts=table, shmem_enabled=kernel) == (
        str(shm) if small else None
    )


def test_a_shmem_setting_without_a_chosen_word_gives_no_answer(shm: Path) -> None:
    table = mounts((shm, "tmpfs", "rw"))
    assert small_page_tmpfs(shm, mounts=table, shmem_enabled="") is None
