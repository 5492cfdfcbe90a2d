"""How fast do threads fill fresh dump-sized files under /dev/shm, per way of writing them?

Each mode writes `--dumps` files of `--mb` MB in 16 MB jobs spread over a thread pool (the plugin's
write pool does the same), from one source buffer in ordinary memory, and prints GB/s per mode and
thread count as JSON lines:
  mapped     ftruncate, mmap, memmove (the plugin's default)
  huge       as mapped, with madvise(MADV_HUGEPAGE) on the mapping (2 MB folios where the kernel's
             shmem_enabled allows "advise")
  populate   as mapped, each job's range prefaulted with madvise(MADV_POPULATE_WRITE) first
  pwrite     ftruncate, os.pwrite
A mode with the suffix `-reused` (`mapped-reused`, `pwrite-reused`) writes into files that hold a
dump's worth of pages already (filled before the clock and kept after it), as a dump root would
whose consumed files were handed back for the next dump instead of removed.
It also prints the kernel's transparent huge page settings for shmem and /dev/shm's mount.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import mmap
import os
import shutil
import time
from concurrent.futures import ThreadPoolExecutor, wait
from pathlib import Path

import numpy as np

JOB = 16 << 20
MADV_POPULATE_WRITE = 23  # Linux 5.14
PAGE = mmap.PAGESIZE


def settings() -> dict[str, str]:
    out = {"kernel": os.uname().release}
    for name in ("enabled", "shmem_enabled"):
        try:
            out[name] = Path(f"/sys/kernel/mm/transparent_hugepage/{name}").read_text().strip()
        except OSError as exc:
            out[name] = str(exc)
    out["mount"] = next(
        (line for line in Path("/proc/mounts").read_text().splitlines() if " /dev/shm " in line), ""
    )
    return out


class File:
    def __init__(self, path: Path, size: int, mode: str):
        mode, reused = mode.removesuffix("-reused"), mode.endswith("-reused")
        self.fd = os.open(path, os.O_RDWR | (0 if reused else os.O_CREAT | os.O_EXCL), 0o644)
        if not reused:
            os.ftruncate(self.fd, size)
        self.mode, self.map = mode, None
        if mode != "pwrite":
            self.map = mmap.mmap(self.fd, size)
            if mode == "huge":
                self.map.madvise(mmap.MADV_HUGEPAGE)
            view = (ctypes.c_char * size).from_buffer(self.map)
            self.address = ctypes.addressof(view)
            del view

    def write(self, offset: int, src: np.ndarray) -> None:
        n = src.nbytes
        if self.map is None:
            os.pwrite(self.fd, memoryview(src), offset)
            return
        if self.mode == "populate":
            lo = offset // PAGE * PAGE
            self.map.madvise(MADV_POPULATE_WRITE, lo, offset + n - lo)
        ctypes.memmove(self.address + offset, src.ctypes.data, n)

    def close(self) -> None:
        if self.map is not None:
            self.map.close()
        os.close(self.fd)


def run(
    mode: str, threads: int, dumps: int, size: int, root: Path, src: np.ndarray
) -> tuple[float, float]:
    """GB/s, and CPU seconds of this process per GB (user and system, the files' removal in
    unless they are reused)."""
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    reused = mode.endswith("-reused")
    if reused:
        for i in range(dumps):
            fill(root / f"{mode}-{i}.bin", size, src)
    cpu = sum(os.times()[:2])
    with ThreadPoolExecutor(threads) as pool:
        t0 = time.perf_counter()
        files = [File(root / f"{mode}-{i}.bin", size, mode) for i in range(dumps)]
        jobs = [
            pool.submit(f.write, off, src[: min(JOB, size - off)])
            for f in files
            for off in range(0, size, JOB)
        ]
        wait(jobs)
        for job in jobs:
            job.result()
        for f in files:
            f.close()
        seconds = time.perf_counter() - t0
    if not reused:
        shutil.rmtree(root, ignore_errors=True)
    cost = sum(os.times()[:2]) - cpu
    shutil.rmtree(root, ignore_errors=True)
    gb = dumps * size / 1e9
    return gb / seconds, cost / gb


def fill(path: Path, size: int, src: np.ndarray) -> None:
    """A file holding `size` bytes of written pages, as a consumed dump's file does."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        for off in range(0, size, JOB):
            os.pwrite(fd, memoryview(src[: min(JOB, size - off)]), off)
    finally:
        os.close(fd)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--root", type=Path, default=Path("/dev/shm/hsdump-shm-probe"))
    p.add_argument("--mb", type=int, default=117)
    p.add_argument("--dumps", type=int, default=48)
    p.add_argument("--threads", default="4,8,16")
    p.add_argument("--modes", default="mapped,huge,populate,pwrite")
    a = p.parse_args()
    print(json.dumps(settings()), flush=True)
    size = a.mb << 20
    src = np.random.default_rng(0).integers(0, 255, JOB, dtype=np.uint8)
    for threads in map(int, a.threads.split(",")):
        for mode in a.modes.split(","):
            gbs, cost = run(mode, threads, a.dumps, size, a.root, src)
            row = {"mode": mode, "threads": threads, "GB/s": round(gbs, 2),
                   "core_s_per_gb": round(cost, 3)}  # fmt: skip
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
