"""What reading and checking one Kimi-sized dump costs: mapped (the client's path) against read.

Publishes dumps of 2048 tokens, K=3 aux layers plus the final state, H=7168 bf16 (117 MB each,
57,344 bytes a token) into a dump root on /dev/shm through the protocol's writer, then reads each
one back through `read_dump`, the client's one read path, in two ways side by side in one run,
alternately:

- mapped: each tensor file mapped copy-on-write with its pages faulted in up front, then scanned
  for non-finite values and all-zero rows (what the client does);
- read: each file read into fresh memory block by block and scanned (what it does where a file
  cannot be mapped, and what it did before).

Each figure is thread CPU seconds per GB of hidden states and GB/s on one thread, for the first
round and the best of ``--rounds`` rounds. Two arrays stay alive at a time, as in a run where the
store still holds the sample before. Reading into fresh memory costs most in the first round, when
the allocator and the kernel hand out pages never used before (as for each dump of a worker that
has freed none of that size yet); later rounds reuse freed memory.

Then what an extraction run pays to take each dump: read unchecked (the mapping's pages faulted
in at ingest) and placed into a shard buffer with its value check, as the store's placement does.

Then how long the mapped path keeps the process's other threads (the store's codec threads, the
event loop) from the interpreter lock: the longest wait of a Python thread while the dumps are
mapped unchecked beside it, with the pages faulted in by hsdump (the lock released) and by
Python's own `mmap.mmap.madvise` (which holds it for the whole call) side by side.

Last, how long the thread that drops the last array on a removed dump is held up (in an extraction
the event loop or a codec thread): with the dump's pages freed in hsdump's closing thread, and
freed in that thread itself (the descriptor closed there), side by side.

Run ``python benchmarks/bench_ingest.py`` (``--dumps N --rounds R``; ~10 s on 2 cores).
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import threading
import time
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np

from hsdump._client import dumpfiles
from hsdump._client.loading import Dump, read_dump
from hsdump._protocol import DumpMeta, ProducerInfo, write_dump
from hsdump._store.shardbuf import Piece, ShardBuffer, ValueCheck, place_sample
from hsdump._store.stats import RowStats

T, K, H = 2048, 3, 7168
LAYERS = [2, 4, 5]


def publish(root: Path, count: int) -> list[Path]:
    rng = np.random.default_rng(0)
    # bf16 bits of values of magnitude 0.25-0.75 with a random sign and mantissa
    magnitude = rng.integers(0x3E80, 0x3F40, (T, K + 1, H))
    bits = (magnitude | (rng.integers(0, 2, (T, K + 1, H)) << 15)).astype(np.uint16)
    aux, final = np.ascontiguousarray(bits[:, :K]), np.ascontiguousarray(bits[:, K])
    producer = ProducerInfo(name="bench-ingest", version="1")
    paths = []
    for i in range(count):
        meta = DumpMeta(
            rid=f"r{i}", input_ids=list(range(T)), num_tokens=T, layer_ids=LAYERS,
            final_norm="post_norm", hidden_size=H, dtype="bfloat16", aux_shape=(T, K, H),
            final_shape=(T, H), producer=producer,
        )  # fmt: skip
        paths.append(write_dump(root, meta, aux, final))
    return paths


def placed_round(paths: list[Path], shard: ShardBuffer) -> tuple[float, float]:
    """Thread CPU seconds per GB and GB/s of reading every dump unchecked, as an extraction run
    does, and placing it into a shard buffer with its value check, as the store does."""
    ids = np.arange(T, dtype=np.int32)
    gb = len(paths) * T * (K + 1) * H * 2 / 1e9
    cpu, wall = time.thread_time(), time.perf_counter()
    for path in paths:
        dump = read_dump(path, check_values=False)
        stats = RowStats("bfloat16", [*LAYERS, "final"])
        check = ValueCheck(path.name, None, K)
        pieces = [Piece(shard, 0, 0, T)]
        placed = place_sample(pieces, dump.aux, dump.final, ids, None, stats, check)
        assert placed.refused is None
        del dump
    dumpfiles.released()  # the pages freed within the round
    return (time.thread_time() - cpu) / gb, gb / (time.perf_counter() - wall)


@contextmanager
def reading_only() -> Iterator[None]:
    """The client's fallback: the kernel refuses the advice that fills a mapping."""
    advice = dumpfiles._MADV_POPULATE_READ
    dumpfiles._MADV_POPULATE_READ = 0x7FFF
    try:
        yield
    finally:
        dumpfiles._MADV_POPULATE_READ = advice


@contextmanager
def python_madvise() -> Iterator[None]:
    """The baseline: pages faulted in by `mmap.mmap.madvise`, which holds the interpreter lock."""
    populate = dumpfiles.populate
    dumpfiles.populate = lambda mapped, advice: mapped.madvise(advice)  # type: ignore[assignment]
    try:
        yield
    finally:
        dumpfiles.populate = populate


@contextmanager
def closed_where_dropped() -> Iterator[None]:
    """The baseline: each descriptor closed in the thread that drops its mapping, as a process
    with no closing thread does."""
    dumpfiles.released()
    start, closer = dumpfiles._start_closer, dumpfiles._closer
    dumpfiles._start_closer, dumpfiles._closer = lambda: None, None  # type: ignore[assignment]
    try:
        yield
    finally:
        dumpfiles._start_closer, dumpfiles._closer = start, closer  # type: ignore[assignment]


def drop_stall(root: Path) -> float:
    """How long dropping a removed dump's states takes the dropping thread, in ms."""
    path = publish(Path(tempfile.mkdtemp(dir=root)), 1)[0]
    dump = read_dump(path, check_values=False)  # as an extraction run reads it
    shutil.rmtree(path)  # as the client removes a dump once it is read
    start = time.perf_counter()
    del dump
    stall = time.perf_counter() - start
    dumpfiles.released()  # the next round starts with these pages freed
    return stall * 1e3


def longest_wait(paths: list[Path]) -> float:
    """The longest a Python thread went without the interpreter lock while every dump was mapped
    unchecked beside it, in ms; a switch interval of 0.5 ms, as in an extraction, bounds the
    waits that the mapping's own Python causes."""
    last, worst, stop = [time.perf_counter()], [0.0], threading.Event()

    def spin() -> None:
        while not stop.is_set():
            now = time.perf_counter()
            worst[0] = max(worst[0], now - last[0])
            last[0] = now

    alive: deque[Dump] = deque(maxlen=2)
    interval = sys.getswitchinterval()
    sys.setswitchinterval(0.0005)
    spinner = threading.Thread(target=spin)
    spinner.start()
    try:
        for path in paths:
            alive.append(read_dump(path, check_values=False))
    finally:
        stop.set()
        spinner.join()
        sys.setswitchinterval(interval)
    return worst[0] * 1e3


def one_round(paths: list[Path]) -> tuple[float, float]:
    """Thread CPU seconds per GB and GB/s of reading every dump once."""
    alive: deque[Dump] = deque(maxlen=2)
    gb = len(paths) * T * (K + 1) * H * 2 / 1e9
    cpu, wall = time.thread_time(), time.perf_counter()
    for path in paths:
        alive.append(read_dump(path))
    return (time.thread_time() - cpu) / gb, gb / (time.perf_counter() - wall)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dumps", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="hsdump-bench-ingest-", dir="/dev/shm"))
    try:
        paths = publish(root, args.dumps)
        rounds: dict[str, list[tuple[float, float]]] = {"mapped": [], "read": []}
        for _ in range(args.rounds):
            rounds["mapped"].append(one_round(paths))
            with reading_only():
                rounds["read"].append(one_round(paths))
        for name, runs in rounds.items():
            first, best = runs[0], min(runs)
            print(
                f"{name:<7}: first round {first[0]:.2f} core-s per GB ({first[1]:.2f} GB/s on "
                f"one thread), best {best[0]:.2f} ({best[1]:.2f} GB/s)"
            )
        shard = ShardBuffer.allocate(T, K + 1, H, np.dtype(np.uint16))
        placed = [placed_round(paths, shard) for _ in range(args.rounds)]
        best = min(placed)
        print(
            f"read unchecked and placed: best {best[0]:.2f} core-s per GB ({best[1]:.2f} GB/s on "
            "one thread), rounds " + ", ".join(f"{r[0]:.2f}" for r in placed)
        )
        waits: dict[str, list[float]] = {"hsdump": [], "mmap.madvise": []}
        for _ in range(args.rounds):
            waits["hsdump"].append(longest_wait(paths))
            with python_madvise():
                waits["mmap.madvise"].append(longest_wait(paths))
        print(
            "longest wait of another thread for the interpreter lock while dumps are mapped: "
            + ", ".join(f"{n} {min(v):.1f}-{max(v):.1f} ms" for n, v in waits.items())
        )
        stalls: dict[str, list[float]] = {"freed by hsdump's thread": [], "freed there": []}
        for _ in range(args.rounds):
            stalls["freed by hsdump's thread"].append(drop_stall(root))
            with closed_where_dropped():
                stalls["freed there"].append(drop_stall(root))
        print(
            "the thread dropping a removed dump's states is held: "
            + ", ".join(f"{n} {min(v):.1f}-{max(v):.1f} ms" for n, v in stalls.items())
        )
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
