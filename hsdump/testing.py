"""Test helpers for hsdump and for code built on it (like ``zarr.testing``).

- `FakeServer`: an SGLang stand-in on loopback that dumps through the real protocol, with
  fault injection (`Fault`).
- `DumpWatcherTests`: the conformance suite every `DumpWatcher` must pass.
  Its tests order producer and waiter by events, never by sleeping. Subclass it and define
  ``make_watcher``::

      class TestMyWatcher(DumpWatcherTests):
          def make_watcher(self, root):
              return MyWatcher(root)

  Every test runs under asyncio and under trio; a watcher for one event loop only narrows
  ``backends`` (``backends = ("asyncio",)``), and the other's tests are skipped, as they are
  where trio is not installed.
- `MemorySink`: a `SampleSink` in memory, for tests of an extraction run without a store.
- `cli_app`: the ``hsdump`` command's Typer app, for ``typer.testing.CliRunner``.
- `build_default_model`: the reference server's small random Llama, built from a config.
- `publish`, `read_dump`, `request_dir`: writing and reading dumps as the protocol lays them out.
- `small_page_tmpfs`: whether a path lies on a tmpfs with 4 KB pages only.

Importing this module needs neither pytest nor torch; `DumpWatcherTests` needs pytest and
anyio's pytest plugin (bundled with anyio), and is loaded on first use.
"""

from __future__ import annotations

import importlib.util
import os
import uuid
from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import anyio
from anyio.abc import TaskGroup

from hsdump._client.watcher import DumpWatcher
from hsdump._exceptions import (
    DumpTimeout,
    DumpValidationError,
    HsdumpError,
    InvalidRequestId,
    SampleExistsError,
)
from hsdump._protocol import (
    Capabilities,
    DumpWriter,
    ProducerInfo,
    dtype_of_torch,
    request_dir,
    small_page_tmpfs,
    value_error,
    write_error,
)
from hsdump._servers.fake import FakeEngine, FakeServer, Fault, FaultKind, fake_states
from hsdump._types import HiddenStates, Sample

if TYPE_CHECKING:
    import pytest
    import typer
    from transformers import PreTrainedModel

    from hsdump._store.part import Refused
    from hsdump._store.reader import CorruptSample

    #: The ``hsdump`` command's Typer app (loaded on first use).
    cli_app: typer.Typer

__all__ = [
    "Capabilities",
    "DumpWatcherTests",
    "FakeEngine",
    "FakeServer",
    "Fault",
    "FaultKind",
    "MemorySink",
    "build_default_model",
    "cli_app",
    "fake_states",
    "publish",
    "read_dump",
    "request_dir",
    "small_page_tmpfs",
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


class _DumpWatcherSuite:
    """Behaviour every DumpWatcher implementation must have, under each anyio backend.

    `DumpWatcherTests` adds the pytest fixtures and marks; this class holds the tests.
    """

    #: The anyio backends the watcher under test supports.
    backends: ClassVar[tuple[str, ...]] = ("asyncio", "trio")

    def make_watcher(self, root: Path) -> DumpWatcher:
        """Return the watcher under test for dump root ``root``."""
        raise NotImplementedError

    def _backend(self, backend: str) -> str:
        """``backend`` if this suite runs under it; else the test is skipped."""
        import pytest

        if backend not in self.backends:
            pytest.skip(f"{type(self).__name__} does not support {backend}")
        if importlib.util.find_spec(backend) is None:
            pytest.skip(f"{backend} is not installed")
        return backend

    @staticmethod
    def rid() -> str:
        return f"hsdump-test-{uuid.uuid4().hex[:12]}"

    async def test_returns_when_dump_published_after_wait_began(self, watcher: DumpWatcher) -> None:
        rid = self.rid()
        async with anyio.create_task_group() as tg:
            wait = await _begin_wait(tg, watcher, rid)
            await _produce(lambda: publish(watcher.root, rid))
            await wait.returned.wait()
        assert wait.path == request_dir(watcher.root, rid)

    async def test_returns_at_once_when_dump_published_before_wait(
        self, watcher: DumpWatcher
    ) -> None:
        rid = self.rid()
        publish(watcher.root, rid)
        with anyio.fail_after(1):
            assert await watcher.wait(rid, timeout=5) == request_dir(watcher.root, rid)

    async def test_returns_on_error_marker(self, watcher: DumpWatcher) -> None:
        rid = self.rid()
        async with anyio.create_task_group() as tg:
            wait = await _begin_wait(tg, watcher, rid)
            await _produce(lambda: write_error(watcher.root, rid, "test failure", _PRODUCER))
            await wait.returned.wait()
        assert wait.path is not None and (wait.path / "error").exists()

    async def test_waits_for_marker_when_directory_appears_first(
        self, watcher: DumpWatcher
    ) -> None:
        rid = self.rid()
        path = request_dir(watcher.root, rid)
        async with anyio.create_task_group() as tg:
            wait = await _begin_wait(tg, watcher, rid)
            await _produce(path.mkdir)
            assert not wait.returned.is_set()
            await _produce((path / "done").touch)
            await wait.returned.wait()

    async def test_waits_for_marker_after_files_written_in_place(
        self, watcher: DumpWatcher
    ) -> None:
        """A producer that makes ``req_<rid>`` itself and writes its files there, marker last."""
        rid = self.rid()
        path = request_dir(watcher.root, rid)
        async with anyio.create_task_group() as tg:
            wait = await _begin_wait(tg, watcher, rid)
            await _produce(path.mkdir)
            for name in ("meta.json", "aux.bin", "final.bin"):
                await _produce((path / name).touch)
                assert not wait.returned.is_set()
            await _produce((path / "done").touch)
            await wait.returned.wait()

    async def test_sees_a_marker_written_right_after_its_directory(
        self, watcher: DumpWatcher
    ) -> None:
        """A producer that makes ``req_<rid>`` and writes the marker at once, before any watch of
        the new directory could be in place."""
        rids = [self.rid() for _ in range(20)]

        def produce() -> None:
            for rid in rids:
                path = request_dir(watcher.root, rid)
                path.mkdir()
                (path / "done").touch()

        async with anyio.create_task_group() as tg:
            waits = [await _begin_wait(tg, watcher, rid, timeout=2) for rid in rids]
            await _produce(produce)
            for wait in waits:
                await wait.returned.wait()

    async def test_waits_for_marker_in_a_directory_made_before_the_wait(
        self, watcher: DumpWatcher
    ) -> None:
        rid = self.rid()
        path = request_dir(watcher.root, rid)
        path.mkdir()
        (path / "meta.json").touch()
        async with anyio.create_task_group() as tg:
            wait = await _begin_wait(tg, watcher, rid)
            await _produce((path / "aux.bin").touch)
            assert not wait.returned.is_set()
            await _produce((path / "done").touch)
            await wait.returned.wait()

    async def test_other_requests_dumps_do_not_end_the_wait(self, watcher: DumpWatcher) -> None:
        mine, before, during = self.rid(), self.rid(), self.rid()
        publish(watcher.root, before)
        async with anyio.create_task_group() as tg:
            wait = await _begin_wait(tg, watcher, mine)
            await _produce(lambda: publish(watcher.root, during))
            assert not wait.returned.is_set()
            await _produce(lambda: publish(watcher.root, mine))
            await wait.returned.wait()
        assert wait.path == request_dir(watcher.root, mine)

    async def test_timeout_raises_dump_timeout_naming_the_request(
        self, watcher: DumpWatcher
    ) -> None:
        import pytest

        rid = self.rid()
        with pytest.raises(DumpTimeout, match=rid) as info:
            await watcher.wait(rid, timeout=0.1)
        assert isinstance(info.value, TimeoutError)

    async def test_many_concurrent_waits_complete_in_any_order(self, watcher: DumpWatcher) -> None:
        rids = [self.rid() for _ in range(20)]
        done: list[str] = []

        async def wait_one(rid: str) -> None:
            await watcher.wait(rid, timeout=5)
            done.append(rid)

        async with anyio.create_task_group() as tg:
            for rid in rids:
                tg.start_soon(wait_one, rid)
            await anyio.wait_all_tasks_blocked()  # every wait has begun
            assert done == []
            await _produce(lambda: [publish(watcher.root, rid) for rid in reversed(rids)])
        assert sorted(done) == sorted(rids)

    async def test_cancelled_and_timed_out_waits_leave_nothing_behind(
        self, watcher: DumpWatcher
    ) -> None:
        import pytest

        await _warm_up(watcher)
        fds, tasks = _fd_count(), len(anyio.get_running_tasks())
        for _ in range(30):
            async with anyio.create_task_group() as tg:
                await _begin_wait(tg, watcher, self.rid())
                tg.cancel_scope.cancel()  # while the wait is blocked in the watcher
            with pytest.raises(DumpTimeout):
                await watcher.wait(self.rid(), timeout=0.005)
        assert _fd_count() == fds
        assert len(anyio.get_running_tasks()) == tasks

    async def test_a_cancelled_wait_leaves_the_other_waits_seeing_their_dumps(
        self, watcher: DumpWatcher
    ) -> None:
        first, second, third = self.rid(), self.rid(), self.rid()
        async with anyio.create_task_group() as tg:
            async with anyio.create_task_group() as doomed:
                await _begin_wait(doomed, watcher, first)  # began first: it may be the reader
                waits = [await _begin_wait(tg, watcher, rid) for rid in (second, third)]
                doomed.cancel_scope.cancel()
            await _produce(lambda: publish(watcher.root, second))
            with anyio.fail_after(5):
                await waits[0].returned.wait()
            assert not waits[1].returned.is_set()
            await _produce(lambda: publish(watcher.root, third))
            with anyio.fail_after(5):
                await waits[1].returned.wait()

    async def test_refuses_a_rid_that_would_escape_the_root(self, watcher: DumpWatcher) -> None:
        import pytest

        for bad in ("../etc", "a/b", "", ".hidden"):
            with pytest.raises(InvalidRequestId):
                await watcher.wait(bad, timeout=0.1)

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


class _Wait:
    """A `DumpWatcher.wait` running in a task of its own."""

    def __init__(self) -> None:
        self.path: Path | None = None
        self.returned = anyio.Event()


async def _begin_wait(tg: TaskGroup, watcher: DumpWatcher, rid: str, timeout: float = 5) -> _Wait:
    """Start waiting for ``rid`` in ``tg``; return once the wait has begun (blocks in it)."""
    wait = _Wait()

    async def run() -> None:
        wait.path = await watcher.wait(rid, timeout)
        wait.returned.set()

    tg.start_soon(run)
    await anyio.wait_all_tasks_blocked()
    return wait


async def _produce(step: Callable[[], object]) -> None:
    """Run one step of a producer; return once the watcher has seen it and waits (or returned).

    The step runs in a worker thread, so its file events are queued before the event loop learns
    that the thread finished, and the loop polls them before it resumes this task; then every task
    blocking again means a woken wait has looked and gone back to waiting.
    """
    await anyio.to_thread.run_sync(step)
    await anyio.wait_all_tasks_blocked()


def _dump_watcher_tests() -> type[_DumpWatcherSuite]:
    """`DumpWatcherTests`: the suite with its pytest fixtures and marks (imports pytest)."""
    import pytest

    class DumpWatcherTests(_DumpWatcherSuite):
        """Behaviour every DumpWatcher implementation must have, under each anyio backend.

        Subclass it and define `make_watcher`; narrow `backends` for a watcher of one event loop.
        """

        pytestmark: ClassVar[list[pytest.MarkDecorator]] = [pytest.mark.anyio]

        @pytest.fixture(params=["asyncio", "trio"])
        def anyio_backend(self, request: pytest.FixtureRequest) -> str:
            return self._backend(request.param)

        @pytest.fixture
        async def watcher(self, tmp_path: Path) -> AsyncIterator[DumpWatcher]:
            w = self.make_watcher(tmp_path)
            yield w
            await w.aclose()

    DumpWatcherTests.__module__ = __name__
    return DumpWatcherTests


if TYPE_CHECKING:
    #: The conformance suite every `DumpWatcher` passes (loaded on first use: it needs pytest).
    DumpWatcherTests = _DumpWatcherSuite


def __getattr__(name: str) -> Any:
    """`DumpWatcherTests` and `cli_app`, loaded on first use."""
    if name == "DumpWatcherTests":
        value: Any = _dump_watcher_tests()
    elif name == "cli_app":
        from hsdump._cli import app as value
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals()[name] = value
    return value


class MemorySink:
    """A `SampleSink` in memory: what `run_extraction` commits to in a test that needs no store.

    It answers a run as a `HiddenStateStore` does: a sample is in the sink once its write
    returns, a second write of its id raises `SampleExistsError`, `token_mismatch` compares a
    dataset sample with the tokens written under its id, and a sample handed over with its values
    unchecked (`HiddenStates.values_checked` False, as a run hands over a `HiddenStateClient`'s
    dumps) is checked as a store's placement checks it: one that fails is not committed and is
    reported once by `take_refused`. The byte counters move at `aflush`, as a store's move when
    it writes a shard. One write at a time: a run hands a sink other than a store no more.

    Args:
        committed: Samples the sink holds before a run, as a store written earlier would.
        compression: Raw bytes per stored byte, for `bytes_stored`.

    Attributes:
        samples: The states of each sample written, by id.
        writes: The ids committed, in the order their writes returned.
        flushes: How many times `aflush` ran.
        refuse: Errors `awrite` raises for these sample ids instead of writing them: a
            `StoreError` stops a run, any other `HsdumpError` fails that sample alone.
    """

    checks_values = True

    def __init__(self, committed: Iterable[Sample] = (), *, compression: float = 2.0) -> None:
        self.samples: dict[str, HiddenStates] = {}
        self.writes: list[str] = []
        self.flushes = 0
        self.refuse: dict[str, HsdumpError] = {}
        self.compression = compression
        self._tokens = {s.id: _tokens_of(s.input_ids, s.loss_mask) for s in committed}
        self._buffered = self._raw = 0
        self._refused: list[Refused] = []

    def __contains__(self, sample_id: object) -> bool:
        return sample_id in self._tokens

    async def awrite(self, states: HiddenStates) -> None:
        """Commit ``states``, or raise what `refuse` holds for its id.

        Raises:
            SampleExistsError: The sink holds the id.
        """
        from hsdump._store.part import Refused

        sample_id = states.sample_id
        if sample_id in self.refuse:
            raise self.refuse[sample_id]
        if sample_id in self._tokens:
            raise SampleExistsError("already in the sink", sample_id=sample_id)
        error = None if states.values_checked else _value_error(states)
        if error is not None:
            self._refused.append(Refused(sample_id, states.num_tokens, states.nbytes, error))
            return
        mask = None if states.loss_mask is None else states.loss_mask.tolist()
        self._tokens[sample_id] = _tokens_of(states.input_ids.tolist(), mask)
        self.samples[sample_id] = states
        self.writes.append(sample_id)
        self._buffered += states.nbytes

    async def aflush(self) -> None:
        """Count the samples written since the last flush as stored."""
        self.flushes += 1
        self._raw += self._buffered
        self._buffered = 0

    def token_mismatch(self, sample: Sample) -> str | None:
        """How the tokens written under ``sample.id`` differ from ``sample``'s; None when they do
        not, or when the id is not in the sink."""
        stored = self._tokens.get(sample.id)
        given = _tokens_of(sample.input_ids, sample.loss_mask)
        if stored is None or stored == given:
            return None
        return f"stored {_describe(stored)} != dataset {_describe(given)}"

    def take_refused(self) -> Sequence[Refused]:
        """The unchecked samples whose values were refused since the last call."""
        refused, self._refused = self._refused, []
        return refused

    @property
    def recovered(self) -> Sequence[CorruptSample]:
        """None: a sink in memory loses nothing in a crash."""
        return []

    @property
    def bytes_raw_written(self) -> int:
        """Raw bytes of the samples flushed so far."""
        return self._raw

    @property
    def bytes_stored(self) -> int:
        """``bytes_raw_written`` divided by ``compression``."""
        return int(self._raw / self.compression)


_Tokens = tuple[tuple[int, ...], tuple[int, ...] | None]


def _tokens_of(ids: Iterable[int], mask: Iterable[int] | None) -> _Tokens:
    return tuple(ids), None if mask is None else tuple(mask)


def _describe(tokens: _Tokens) -> str:
    ids, mask = tokens
    return f"{len(ids)} tokens, {'no' if mask is None else 'with'} loss mask"


def _value_error(states: HiddenStates) -> DumpValidationError | None:
    """What a store's placement refuses an unchecked sample for: the aux rows first."""
    spec = dtype_of_torch(states.final_hidden_state.dtype)
    rid = states.meta.rid if states.meta is not None else None
    for name, tensor in (
        ("aux_hidden_states", states.aux_hidden_states),
        ("final_hidden_state", states.final_hidden_state),
    ):
        peaks = spec.peak_magnitude(spec.bits_of(tensor), axis=-1)
        error = value_error(peaks, spec, name=name, sample_id=states.sample_id, rid=rid)
        if error is not None:
            return error
    return None


def build_default_model(seed: int = 0, **overrides: Any) -> PreTrainedModel:
    """The small random Llama the reference server serves when given no model: built from a
    config with a fixed seed, so equal seeds give equal weights (no download; imports torch and
    transformers).

    Args:
        seed: The torch seed the weights are initialised with.
        **overrides: ``LlamaConfig`` fields replacing the built-in ones (``hidden_size``,
            ``num_hidden_layers``, ``vocab_size``...), for a smaller or a different model.
    """
    from hsdump._servers.reference import build_default_model as build

    return build(seed, **overrides)


def read_dump(path: str | os.PathLike[str]) -> HiddenStates:
    """Read and check the published dump at ``path`` (``request_dir(root, rid)``) as a client
    reads one, without asking whose it is.

    Returns:
        Its states: ``sample_id`` is the dump's rid, ``meta`` its ``meta.json``; the tensors
        view the dump's files.

    Raises:
        DumpFailed: The producer published an ``error`` marker.
        DumpValidationError: The dump is incomplete or malformed, or a value is non-finite or
            a vector all zeros.
    """
    from hsdump._client.loading import read_dump as read

    dump = read(path)
    return dump.states(dump.meta.rid)
