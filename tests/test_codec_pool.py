"""The store's codec pool: made on first use, nothing registered at import, fork-safe, stoppable,
sized once; the rows it places land before their shard is written."""

from __future__ import annotations

import multiprocessing
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from store_crash_writer import make_sample

import hsdump._store.part as part
from hsdump import StoreOptions, open_store
from hsdump._store.shardio import codec_pool, shutdown_codec_pool


def _codec_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("hsdump-codec")]


def test_importing_registers_no_hook_and_the_first_use_registers_them_once() -> None:
    code = """
import atexit, os
calls = []
def ours(hook):
    return getattr(getattr(hook, "__self__", hook), "__module__", "") == "hsdump._store.shardio"
os.register_at_fork = lambda **hooks: calls.extend("fork" for h in hooks.values() if ours(h))
atexit.register = lambda hook, *args: calls.extend(["exit"] if ours(hook) else [])
import hsdump._store.shardio as shardio
print(calls)
shardio.codec_pool().submit(int).result()
shardio.shutdown_codec_pool()
shardio.codec_pool().submit(int).result()
print(calls)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split("\n")[:2] == ["[]", "['fork', 'exit']"]


def test_shutdown_stops_the_threads_and_the_next_use_makes_a_new_pool() -> None:
    first = codec_pool()
    assert list(first.map(abs, [-1, -2])) == [1, 2] and _codec_threads()
    shutdown_codec_pool()
    assert not _codec_threads()
    assert codec_pool() is not first and codec_pool().submit(abs, -3).result(timeout=10) == 3


def _child_uses_the_pool(result: multiprocessing.queues.Queue[int]) -> None:
    result.put(codec_pool().submit(abs, -7).result(timeout=10))


def test_a_forked_child_gets_a_pool_of_its_own() -> None:
    """A child that used the parent's pool object would wait forever: its threads are not there."""
    codec_pool().submit(int).result()
    fork = multiprocessing.get_context("fork")
    result = fork.Queue()
    child = fork.Process(target=_child_uses_the_pool, args=(result,))
    child.start()
    assert result.get(timeout=30) == 7
    child.join(timeout=30)
    assert child.exitcode == 0


def _threads_when_busy(pool: Any) -> int:
    """The pool's threads while more jobs than it can run at once wait for an event."""
    release = threading.Event()
    jobs = [pool.submit(release.wait, 10) for _ in range(12)]
    try:
        return len(_codec_threads())
    finally:
        release.set()
        assert all(job.result() for job in jobs)


def test_the_pool_is_sized_by_the_cores_of_its_first_use_and_kept() -> None:
    shutdown_codec_pool()
    try:
        pool = codec_pool(3)
        assert _threads_when_busy(pool) == 3
        assert codec_pool(8) is pool and codec_pool() is pool  # one per process
        assert _threads_when_busy(pool) == 3
    finally:
        shutdown_codec_pool()


def test_a_pool_for_one_core_still_has_two_threads() -> None:
    """Placement and encoding share the pool: with one thread a shard's jobs would queue behind
    each other."""
    shutdown_codec_pool()
    try:
        assert _threads_when_busy(codec_pool(1)) == 2
    finally:
        shutdown_codec_pool()


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16)


@pytest.mark.parametrize("writers", [1, 3])
def test_a_shard_is_written_only_once_every_row_placed_in_it_landed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, writers: int
) -> None:
    """A sample's rows are placed by a job on the pool while the store takes the next sample: a
    shard writer that did not wait for the jobs of its shard would store rows not yet placed."""
    place = part.place_sample

    def slow_place(*args: Any) -> Any:
        time.sleep(0.01)  # no event to wait for: the writer must not start before this returns
        return place(*args)

    monkeypatch.setattr(part, "place_sample", slow_place)
    path, options = tmp_path / "s.zarr", StoreOptions(shard_writers=writers)
    geometry: dict[str, Any] = {"shard_tokens": 128, "chunk_tokens": 16, "options": options}
    with open_store(path, "a", **geometry) as store:  # most samples straddle two shards or more
        for i in range(30):
            store.write(make_sample(i))
    with open_store(path, "a", **geometry) as store:  # resumes inside a partial shard
        for i in range(30, 45):
            store.write(make_sample(i))
    with open_store(path, "r") as store:
        for i in range(45):
            want = make_sample(i)
            got = store[f"s{i}"]
            assert torch.equal(_bits(got.aux_hidden_states), _bits(want.aux_hidden_states))
            assert torch.equal(_bits(got.final_hidden_state), _bits(want.final_hidden_state))
        assert store.verify().clean
