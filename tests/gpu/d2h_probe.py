"""How fast can hidden states move from GPU memory into fresh dump files under /dev/shm?

Each mode writes `--dumps` dumps of `--mb` MB (one file each, as the plugin's aux.bin) from a CUDA
tensor, with 1, 4 and 8 threads each taking whole dumps, and prints GB/s per mode as JSON lines:
  pinned_memmove  D2H into a pinned buffer, then memmove into the mapped file (the plugin today)
  pageable        D2H straight into the mapped file (driver-staged, no registration)
  registered      the mapped file registered with CUDA (cudaHostRegister), then a DMA into it
  populate        as pinned_memmove, the file fallocated and mapped with MAP_POPULATE first
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import shutil
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch


def mapped(path: Path, size: int, *, populate: bool) -> tuple[int, mmap.mmap]:
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
    if populate:
        os.posix_fallocate(fd, 0, size)
    else:
        os.ftruncate(fd, size)
    flags = mmap.MAP_SHARED | (mmap.MAP_POPULATE if populate else 0)
    return fd, mmap.mmap(fd, size, flags=flags)


def as_tensor(m: mmap.mmap, size: int) -> torch.Tensor:
    return torch.frombuffer(m, dtype=torch.uint8, count=size)


class Mode:
    def __init__(self, name: str, src: torch.Tensor, root: Path):
        self.name, self.src, self.root = name, src, root
        self.local = threading.local()
        self.register_s = 0.0
        self.lock = threading.Lock()

    def stream(self) -> torch.cuda.Stream:
        if not hasattr(self.local, "stream"):
            self.local.stream = torch.cuda.Stream()
            self.local.pinned = torch.empty(self.src.numel(), dtype=torch.uint8, pin_memory=True)
        return self.local.stream

    def one(self, i: int) -> None:
        size = self.src.numel()
        stream = self.stream()
        fd, m = mapped(self.root / f"{self.name}-{i}.bin", size, populate=self.name == "populate")
        dst = as_tensor(m, size)
        with torch.cuda.stream(stream):
            if self.name in ("pinned_memmove", "populate"):
                self.local.pinned.copy_(self.src, non_blocking=True)
                stream.synchronize()
                dst.copy_(self.local.pinned)
            elif self.name == "pageable":
                dst.copy_(self.src, non_blocking=True)
                stream.synchronize()
            else:
                t0 = time.perf_counter()
                rc = torch.cuda.cudart().cudaHostRegister(dst.data_ptr(), size, 0)
                with self.lock:
                    self.register_s += time.perf_counter() - t0
                assert int(rc) == 0, f"cudaHostRegister failed: {rc}"
                dst.copy_(self.src, non_blocking=True)
                stream.synchronize()
                torch.cuda.cudart().cudaHostUnregister(dst.data_ptr())
        del dst
        m.close()
        os.close(fd)


def run(name: str, src: torch.Tensor, threads: int, dumps: int, root: Path) -> dict[str, object]:
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    mode = Mode(name, src, root)
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(mode.one, range(threads)))  # warm each thread's stream and buffer
        shutil.rmtree(root)
        root.mkdir()
        t0 = time.perf_counter()
        list(pool.map(mode.one, range(dumps)))
        elapsed = time.perf_counter() - t0
    shutil.rmtree(root, ignore_errors=True)
    gb = dumps * src.numel() / 1e9
    return {
        "mode": name,
        "threads": threads,
        "dumps": dumps,
        "gb_s": round(gb / elapsed, 2),
        "register_ms_per_dump": round(1e3 * mode.register_s / dumps, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--mb", type=int, default=117)
    parser.add_argument("--dumps", type=int, default=48)
    parser.add_argument("--root", default="/dev/shm/d2h-probe")
    args = parser.parse_args()
    src = torch.randint(0, 255, (args.mb << 20,), dtype=torch.uint8, device="cuda")
    for name in ("pinned_memmove", "populate", "pageable", "registered"):
        for threads in (1, 4, 8):
            try:
                row = run(name, src, threads, args.dumps, Path(args.root))
            except Exception as exc:  # report and go on: each mode is an experiment
                row = {"mode": name, "threads": threads, "error": f"{type(exc).__name__}: {exc}"}
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
