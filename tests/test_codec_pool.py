"""The store's codec pool: made on first use, nothing registered at import, fork-safe, stoppable."""

from __future__ import annotations

import multiprocessing
import subprocess
import sys
import threading

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
