"""Test helpers for hsdump and for code built on it (like ``zarr.testing``).

- :class:`FakeServer`: an SGLang stand-in on loopback that dumps through the real protocol, with
  fault injection (:class:`Fault`).
- :class:`DumpWatcherTests`: the conformance suite every :class:`~hsdump.DumpWatcher` must pass.
  Subclass it and define ``make_watcher``::

      class TestMyWatcher(DumpWatcherTests):
          def make_watcher(self, root):
              return MyWatcher(root)

Requires pytest and anyio's pytest plugin (bundled with anyio).
"""

from __future__ import annotations

import asyncio
import os
import uuid
from pathlib import Path

import anyio
import pytest

from hsdump._exceptions import DumpTimeout
from hsdump._fake import FakeEngine, FakeServer, Fault, FaultKind, fake_states
from hsdump._protocol import DumpWriter, ProducerInfo, request_dir, write_error
from hsdump._watcher import DumpWatcher

__all__ = [
    "DumpWatcherTests",
    "FakeEngine",
    "FakeServer",
    "Fault",
    "FaultKind",
    "fake_states",
    "publish",
]

_PRODUCER = ProducerInfo(name="hsdump-testing", version="1")


def publish(root: Path, rid: str) -> Path:
    """Publish a tiny valid dump for ``rid`` through the protocol's writer."""
    import numpy as np

    from hsdump._protocol import DumpMeta

    meta = DumpMeta(
        rid=rid, input_ids=[1], num_tokens=1, layer_ids=[1], final_norm="post_norm",
        hidden_size=1, dtype="bfloat16", aux_shape=(1, 1, 1), final_shape=(1, 1),
        producer=_PRODUCER,
    )  # fmt: skip
    with DumpWriter(root, rid, num_tokens=1, num_layers=1, hidden_size=1, dtype="bfloat16") as w:
        one = np.ones(1, np.uint16)
        w.write_rows(0, one, one)
        return w.publish(meta)


def _fd_count() -> int:
    return len(os.listdir("/proc/self/fd"))


class DumpWatcherTests:
    """Behaviour every DumpWatcher implementation must have."""

    def make_watcher(self, root: Path) -> DumpWatcher:
        """Return the watcher under test for dump root ``root``."""
        raise NotImplementedError

    @pytest.fixture
    def anyio_backend(self) -> str:
        return "asyncio"

    @pytest.fixture
    async def watcher(self, tmp_path: Path):  # type: ignore[no-untyped-def]
        w = self.make_watcher(tmp_path)
        yield w
        await w.aclose()

    @staticmethod
    def rid() -> str:
        return f"hsdump-test-{uuid.uuid4().hex[:12]}"

    @pytest.mark.anyio
    async def test_returns_when_dump_published_after_wait_began(self, watcher: DumpWatcher) -> None:
        rid = self.rid()
        async with anyio.create_task_group() as tg:
            tg.start_soon(_publish_later, watcher.root, rid, 0.05)
            path = await watcher.wait(rid, timeout=5)
        assert path == request_dir(watcher.root, rid)

    @pytest.mark.anyio
    async def test_returns_at_once_when_dump_published_before_wait(
        self, watcher: DumpWatcher
    ) -> None:
        rid = self.rid()
        publish(watcher.root, rid)
        with anyio.fail_after(1):
            assert await watcher.wait(rid, timeout=5) == request_dir(watcher.root, rid)

    @pytest.mark.anyio
    async def test_returns_on_error_marker(self, watcher: DumpWatcher) -> None:
        rid = self.rid()
        async with anyio.create_task_group() as tg:
            tg.start_soon(_error_later, watcher.root, rid, 0.05)
            path = await watcher.wait(rid, timeout=5)
        assert (path / "error").exists()

    @pytest.mark.anyio
    async def test_waits_for_marker_when_directory_appears_first(
        self, watcher: DumpWatcher
    ) -> None:
        rid = self.rid()
        path = request_dir(watcher.root, rid)

        async def slow_producer() -> None:
            await anyio.sleep(0.05)
            path.mkdir()
            await anyio.sleep(0.1)
            (path / "done").touch()

        async with anyio.create_task_group() as tg:
            tg.start_soon(slow_producer)
            await watcher.wait(rid, timeout=5)
            assert (path / "done").exists()

    @pytest.mark.anyio
    async def test_other_requests_dumps_do_not_end_the_wait(self, watcher: DumpWatcher) -> None:
        mine, other = self.rid(), self.rid()
        publish(watcher.root, other)
        with pytest.raises(DumpTimeout):
            await watcher.wait(mine, timeout=0.2)

    @pytest.mark.anyio
    async def test_timeout_raises_dump_timeout_naming_the_request(
        self, watcher: DumpWatcher
    ) -> None:
        rid = self.rid()
        with pytest.raises(DumpTimeout, match=rid) as info:
            await watcher.wait(rid, timeout=0.1)
        assert isinstance(info.value, TimeoutError)

    @pytest.mark.anyio
    async def test_many_concurrent_waits_complete_in_any_order(self, watcher: DumpWatcher) -> None:
        rids = [self.rid() for _ in range(20)]
        done: list[str] = []

        async def wait_one(rid: str) -> None:
            await watcher.wait(rid, timeout=5)
            done.append(rid)

        async with anyio.create_task_group() as tg:
            for rid in rids:
                tg.start_soon(wait_one, rid)
            await anyio.sleep(0.05)
            for rid in reversed(rids):
                publish(watcher.root, rid)
        assert sorted(done) == sorted(rids)

    @pytest.mark.anyio
    async def test_cancelled_and_timed_out_waits_leave_nothing_behind(
        self, watcher: DumpWatcher
    ) -> None:
        await _warm_up(watcher)
        fds, tasks = _fd_count(), len(asyncio.all_tasks())
        for _ in range(30):
            with anyio.move_on_after(0.005):
                await watcher.wait(self.rid(), timeout=5)
            with pytest.raises(DumpTimeout):
                await watcher.wait(self.rid(), timeout=0.005)
        assert _fd_count() == fds
        assert len(asyncio.all_tasks()) == tasks

    @pytest.mark.anyio
    async def test_refuses_a_rid_that_would_escape_the_root(self, watcher: DumpWatcher) -> None:
        for bad in ("../etc", "a/b", "", ".hidden"):
            with pytest.raises(ValueError):
                await watcher.wait(bad, timeout=0.1)

    @pytest.mark.anyio
    async def test_closing_releases_file_handles(self, tmp_path: Path) -> None:
        fds = _fd_count()
        w = self.make_watcher(tmp_path)
        await _warm_up(w)
        await w.aclose()
        assert _fd_count() == fds


async def _warm_up(watcher: DumpWatcher) -> None:
    rid = f"hsdump-warmup-{uuid.uuid4().hex[:8]}"
    publish(watcher.root, rid)
    await watcher.wait(rid, timeout=5)


async def _publish_later(root: Path, rid: str, delay: float) -> None:
    await anyio.sleep(delay)
    publish(root, rid)


async def _error_later(root: Path, rid: str, delay: float) -> None:
    await anyio.sleep(delay)
    write_error(root, rid, "test failure", _PRODUCER)
