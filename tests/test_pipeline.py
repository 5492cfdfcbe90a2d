"""The extraction loop: resume, retries with fresh requests, failures recorded, cancellation."""

from __future__ import annotations

import itertools
import json
import math
import re
import sys
import threading
import time
from collections.abc import Callable

import anyio
import pytest

from hsdump import (
    Backoff,
    ExtractionSummary,
    Failure,
    HiddenStateClient,
    HiddenStates,
    HiddenStateStore,
    InputError,
    RunOptions,
    Sample,
    StoreError,
    open_store,
    run_extraction,
)
from hsdump.testing import FakeServer, Fault, MemorySink

pytestmark = pytest.mark.anyio
NO_WAIT = Backoff(initial=0.0, jitter=0.0)
QUEUES = {"slot_wait", "ingest_queue", "store_queue"}


def _samples(n: int) -> list[Sample]:
    return [Sample(f"s{i}", [i + 1] * (i + 2)) for i in range(n)]


@pytest.fixture
def server(tmp_path):
    with FakeServer(tmp_path / "dumps", hidden_size=8) as running:
        yield running


async def _run(server, store, samples, **options):
    # No probe at open: these tests queue faults for, and count, the samples' requests.
    async with HiddenStateClient(
        server.url, dump_dir=server.dump_dir, dump_timeout=5, probe=False
    ) as client:
        run = RunOptions(backoff=NO_WAIT, **options)
        return await run_extraction(samples, client=client, store=store, options=run)


async def test_every_sample_is_committed_once_under_its_own_id(server):
    store = MemorySink()
    summary = await _run(server, store, _samples(4))
    assert sorted(store.writes) == ["s0", "s1", "s2", "s3"] and summary.ok
    assert all(store.samples[f"s{i}"].input_ids.tolist() == [i + 1] * (i + 2) for i in range(4))
    assert (summary.samples_done, summary.tokens_done, summary.skipped) == (4, 2 + 3 + 4 + 5, 0)
    assert summary.ratio == pytest.approx(2.0)


async def test_committed_samples_are_skipped_and_not_requested(server):
    samples = _samples(4)
    store = MemorySink(committed=samples[0::2])
    summary = await _run(server, store, samples)
    assert store.writes == ["s1", "s3"] and summary.skipped == 2 and summary.samples_total == 2
    assert len(server.received) == 2


async def test_a_transient_failure_is_retried_with_a_fresh_request(server):
    server.inject(Fault("http_500"), Fault("error_marker"))
    store = MemorySink()
    summary = await _run(server, store, _samples(1), retries=2)
    rids = [r.rid for r in server.received]
    assert store.writes == ["s0"] and summary.retries == 2 and summary.ok
    assert len(set(rids)) == 3 and len({r.extra_key for r in server.received}) == 3


async def test_a_sample_that_keeps_failing_is_recorded_and_the_run_goes_on(server, tmp_path):
    s0 = _samples(1)[0]
    server.engine.fault_for = lambda rid, ids: Fault("http_500") if ids == s0.input_ids else None
    store, failures = MemorySink(), tmp_path / "f.jsonl"
    summary = await _run(
        server, store, _samples(2), retries=2, failures_path=failures, line_numbers={"s0": 7}
    )
    assert store.writes == ["s1"] and not summary.ok
    (record,) = [json.loads(line) for line in failures.read_text().splitlines()]
    assert record["id"] == "s0" and record["line"] == 7 and record["attempts"] == 3
    assert record["error"] == "ServerResponseError" and "500" in record["message"]


async def test_a_permanent_failure_is_not_retried(server, tmp_path):
    server.inject(Fault("nan"))
    summary = await _run(server, MemorySink(), _samples(2), retries=3)
    assert [(f.sample_id, f.error, f.attempts) for f in summary.failures] == [
        ("s0", "NonFiniteValues", 1)
    ]
    assert len(server.received) == 2


async def test_fail_fast_stops_at_the_first_failure(server):
    server.inject(Fault("http_400"))
    store = MemorySink()
    summary = await _run(server, store, _samples(3), fail_fast=True)
    assert store.writes == [] and len(summary.failures) == 1 and summary.interrupted


async def test_a_sample_the_store_refuses_fails_alone_and_the_run_goes_on(server):
    store = MemorySink()
    store.refuse["s1"] = InputError("shapes do not fit", sample_id="s1")
    summary = await _run(server, store, _samples(3))
    assert store.writes == ["s0", "s2"] and [f.error for f in summary.failures] == ["InputError"]


async def test_a_store_error_stops_the_run_at_once_and_keeps_what_was_committed(server, tmp_path):
    store, samples = MemorySink(), _samples(10)
    store.refuse["s1"] = StoreError("no space left on the device")
    failures = tmp_path / "f.jsonl"
    with pytest.raises(StoreError, match="no space left"):
        await _run(server, store, samples, failures_path=failures)
    assert store.writes == ["s0"] and store.flushes == 1
    assert len(server.received) < len(samples)  # the rest is neither prefilled nor dropped
    assert not failures.exists()  # no sample failed: the store did


async def test_prior_failures_lead_the_failures_file(server, tmp_path):
    bad = Failure(None, 3, "InputError", str(InputError("line 3: not valid JSON")), 0)
    failures = tmp_path / "f.jsonl"
    summary = await _run(
        server, MemorySink(), _samples(1), failures_path=failures, prior_failures=[bad]
    )
    assert json.loads(failures.read_text().splitlines()[0])["line"] == 3 and not summary.ok


async def test_a_stale_failures_file_is_removed_by_a_run_without_failures(server, tmp_path):
    failures = tmp_path / "f.jsonl"
    failures.write_text('{"id": "old"}\n')
    await _run(server, MemorySink(), _samples(1), failures_path=failures)
    assert not failures.exists()


async def test_cancellation_keeps_committed_samples_and_marks_the_run_interrupted(server):
    seen, store = [], MemorySink()
    with anyio.CancelScope() as scope:

        def progress(summary):
            seen.append(summary)
            if summary.samples_done == 2:
                scope.cancel()  # mid-run: the next samples are at the server or on their way

        await _run(server, store, _samples(10), progress=progress)
    summary = seen[-1]
    assert scope.cancelled_caught and summary.interrupted
    assert store.writes == ["s0", "s1"] and summary.samples_done == 2 and store.flushes == 1


async def test_concurrent_workers_commit_every_sample_once(tmp_path):
    store = MemorySink()
    with FakeServer(tmp_path / "dumps", hidden_size=8, latency=0.05) as server:
        async with HiddenStateClient(
            server.url, dump_dir=server.dump_dir, max_in_flight=4
        ) as client:
            run = RunOptions(concurrency=4)
            await run_extraction(_samples(12), client=client, store=store, options=run)
    assert sorted(store.writes) == sorted(s.id for s in _samples(12))
    assert all(store.samples[s.id].input_ids.tolist() == s.input_ids for s in _samples(12))


def test_summary_rates_and_eta_follow_the_counters():
    summary = ExtractionSummary(tokens_total=300, tokens_done=100, started=0.0, finished=10.0)
    assert summary.tokens_per_s == 10.0 and summary.eta_s == 20.0 and math.isnan(summary.ratio)


def test_backoff_grows_and_is_capped():
    backoff = Backoff(initial=1.0, factor=3.0, maximum=5.0, jitter=0.0)
    assert [backoff.delay(n) for n in (1, 2, 3)] == [1.0, 3.0, 5.0]


class WaitingStore(MemorySink):
    """Each write first waits for ``ready(sample_id)`` (a threading.Event, 10 s at most) and
    records whether it came, and how long the write took."""

    def __init__(self, ready: Callable[[str], threading.Event]):
        super().__init__()
        self.ready = ready
        self.came: dict[str, bool] = {}
        self.write_s = 0.0

    async def awrite(self, states: HiddenStates) -> None:
        started = time.perf_counter()
        event = self.ready(states.sample_id)
        self.came[states.sample_id] = await anyio.to_thread.run_sync(event.wait, 10)
        await super().awrite(states)
        self.write_s += time.perf_counter() - started


async def test_the_next_request_is_at_the_server_while_a_sample_is_written(server):
    samples = _samples(3)
    sent = {s.id: threading.Event() for s in samples}
    ids = {tuple(s.input_ids): s.id for s in samples}
    server.engine.fault_for = lambda rid, got: sent[ids[tuple(got)]].set()
    following = {a.id: sent[b.id] for a, b in itertools.pairwise(samples)}
    store = WaitingStore(lambda sample_id: following.get(sample_id, sent[sample_id]))
    summary = await _run(server, store, samples, concurrency=1)
    assert summary.ok and store.came == {"s0": True, "s1": True, "s2": True}


async def test_the_summary_reports_time_per_stage(server):
    done = threading.Event()
    done.set()
    store = WaitingStore(lambda sample_id: done)
    async with HiddenStateClient(server.url, dump_dir=server.dump_dir, probe=False) as client:
        summary = await run_extraction(_samples(2), client=client, store=store)
    work = {"server", "dump_wait", "ingest", "store_write"}
    assert set(summary.stages) == work | QUEUES
    measured = client.stats.stages()  # the client's own clock for its stages and queues
    assert {name: summary.stages[name] for name in measured} == pytest.approx(measured)
    assert summary.stages["store_write"] >= store.write_s > 0
    assert set(summary.stage_rates()) == work  # GB/s only for stages that move bytes


class StampingClient:
    """The client, noting when each sample came out of it (extracted, checked)."""

    def __init__(self, client: HiddenStateClient, extracted: dict[str, threading.Event]):
        self.client, self.extracted, self.at = client, extracted, {}

    async def extract(self, sample: Sample) -> HiddenStates:
        states = await self.client.extract(sample)
        self.at[sample.id] = time.perf_counter()
        self.extracted[sample.id].set()
        return states


async def test_samples_waiting_for_a_busy_store_are_counted_in_its_queue(server):
    samples = _samples(3)
    extracted = {s.id: threading.Event() for s in samples}
    first, *others = (s.id for s in samples)
    all_out = threading.Event()

    class FirstWriteWaits(WaitingStore):
        async def awrite(self, states: HiddenStates) -> None:
            self.began[states.sample_id] = time.perf_counter()
            if states.sample_id == first:  # until the others are out of the client
                for sample_id in others:
                    await anyio.to_thread.run_sync(extracted[sample_id].wait, 10)
                all_out.set()
            await super().awrite(states)

    store = FirstWriteWaits(lambda sample_id: all_out)
    store.began = {}
    async with HiddenStateClient(server.url, dump_dir=server.dump_dir, probe=False) as client:
        stamping = StampingClient(client, extracted)
        run = RunOptions(concurrency=3)
        summary = await run_extraction(samples, client=stamping, store=store, options=run)
    assert summary.ok and store.came == dict.fromkeys(extracted, True)
    # Each sample queued from leaving the client until its write began; the run's own clock
    # stamps both ends a little inside these.
    queued = sum(store.began[s] - stamping.at[s] for s in extracted)
    assert 0 < summary.stages["store_queue"] <= queued
    assert summary.stages["store_queue"] == pytest.approx(queued, abs=0.05)


async def test_a_request_waiting_for_the_one_in_flight_is_counted_as_slot_wait(server):
    async with HiddenStateClient(server.url, dump_dir=server.dump_dir, probe=False) as client:
        summary = await run_extraction(_samples(2), client=client, store=MemorySink())
    # One request at a time: the second waited while the first was at the server.
    assert summary.ok and summary.stages["slot_wait"] > 0


def test_the_limit_is_the_stage_samples_queued_longest_for():
    summary = ExtractionSummary(stages={"server": 9.0, "ingest": 2.0, "ingest_queue": 3.0})
    assert summary.limit == "ingest"  # not the busiest stage: the one samples waited for
    summary.stages.update(store_queue=4.0, slot_wait=1.0)
    assert summary.limit == "store_write"
    assert ExtractionSummary(stages={"server": 1.0, "slot_wait": 0.0}).limit is None


async def test_a_stored_sample_whose_dataset_tokens_changed_is_a_failure_not_a_skip(
    server, tmp_path
):
    path, failures = tmp_path / "s.zarr", tmp_path / "f.jsonl"
    s0, s1, s2 = _samples(3)
    with open_store(path, "a") as store:
        assert (await _run(server, store, [s0, s1, s2])).ok
    sent = len(server.received)
    rerun = [s0, Sample("s1", [9] * len(s1.input_ids)), Sample("s2", s2.input_ids, [1, 0, 1, 0])]
    with open_store(path, "a") as store:
        summary = await _run(
            server, store, rerun, failures_path=failures, line_numbers={"s1": 2, "s2": 3}
        )
    assert len(server.received) == sent and (summary.skipped, summary.samples_total) == (1, 0)
    assert not summary.ok
    records = [json.loads(line) for line in failures.read_text().splitlines()]
    assert [(r["id"], r["line"], r["error"]) for r in records] == [
        ("s1", 2, "SampleExistsError"),
        ("s2", 3, "SampleExistsError"),
    ]
    digest = "[0-9a-f]{16}"
    assert re.search(
        rf"stored token digest {digest} \(3 tokens, no loss mask\) != dataset token digest "
        rf"{digest} \(3 tokens, no loss mask\).*new store",
        records[0]["message"],
    )
    assert "(4 tokens, no loss mask) != dataset token digest" in records[1]["message"]
    assert "(4 tokens, with loss mask)" in records[1]["message"]


class IntervalStore(MemorySink):
    """Records the interpreter's switch interval at each write."""

    def __init__(self) -> None:
        super().__init__()
        self.intervals: list[float] = []

    async def awrite(self, states: HiddenStates) -> None:
        self.intervals.append(sys.getswitchinterval())
        await super().awrite(states)


async def test_a_run_leaves_the_interpreters_switch_interval_alone(server):
    before = sys.getswitchinterval()
    store = IntervalStore()
    store.refuse["s1"] = StoreError("no space left on device")
    with pytest.raises(StoreError):
        await _run(server, store, _samples(3))
    assert store.intervals == [before, before] and sys.getswitchinterval() == before


class _Overlap:
    """Wraps a write: the first waits (up to 10 s) for a second to begin, so two writes at once
    show as ``most == 2``; a run that hands over one at a time leaves it at 1."""

    def __init__(self) -> None:
        self.active = self.most = self.calls = 0
        self.second = threading.Event()
        self._lock = threading.Lock()

    def enter(self) -> bool:
        with self._lock:
            self.active += 1
            self.calls += 1
            self.most = max(self.most, self.active)
            first = self.calls == 1
        if not first:
            self.second.set()
        return first

    def leave(self) -> None:
        with self._lock:
            self.active -= 1


async def test_a_hidden_state_store_gets_the_next_write_while_one_runs(
    server, tmp_path, monkeypatch
):
    overlap, write = _Overlap(), HiddenStateStore.write

    def watched(self, hs, **kw):
        first = overlap.enter()
        try:
            if first:
                overlap.second.wait(10)
            return write(self, hs, **kw)
        finally:
            overlap.leave()

    monkeypatch.setattr(HiddenStateStore, "write", watched)
    with open_store(tmp_path / "s.zarr", "a") as store:
        summary = await _run(server, store, _samples(4), concurrency=2)
        assert sorted(store) == [f"s{i}" for i in range(4)]
    assert summary.samples_done == 4 and not summary.failures
    assert overlap.most == 2


async def test_any_other_sink_gets_one_write_at_a_time(server):
    overlap = _Overlap()

    class Watched(MemorySink):
        async def awrite(self, states: HiddenStates) -> None:
            if overlap.enter():  # a second write at once would begin within this wait
                await anyio.to_thread.run_sync(overlap.second.wait, 0.5)
            try:
                await super().awrite(states)
            finally:
                overlap.leave()

    store = Watched()
    summary = await _run(server, store, _samples(3), concurrency=2)
    assert summary.samples_done == 3 and sorted(store.writes) == ["s0", "s1", "s2"]
    assert overlap.most == 1


async def test_a_written_sample_is_not_held_while_the_next_one_is_awaited(server):
    # A dump's states hold its pages (a mapping of a removed file on a tmpfs): once the store
    # has them, the run itself must not keep them while it waits for the next sample.
    import gc
    import weakref

    class Dropping(MemorySink):
        def __init__(self) -> None:
            super().__init__()
            self.refs: list[weakref.ref[HiddenStates]] = []

        async def awrite(self, states: HiddenStates) -> None:
            self.refs.append(weakref.ref(states))
            self.writes.append(states.sample_id)

    store = Dropping()
    send, receive = anyio.create_memory_object_stream[Sample](4)
    samples = _samples(2)
    async with send, receive, anyio.create_task_group() as tg:

        async def run() -> None:
            summaries.append(await _run(server, store, receive, concurrency=2))

        summaries: list[ExtractionSummary] = []
        tg.start_soon(run)
        await send.send(samples[0])
        while not store.refs:
            await anyio.wait_all_tasks_blocked()
        await anyio.wait_all_tasks_blocked()  # the run is waiting for its next sample
        gc.collect()
        assert store.refs[0]() is None, "the written sample's states are still referenced"
        await send.send(samples[1])
        await send.aclose()
    assert store.writes == ["s0", "s1"]  # written, not committed: this sink keeps nothing
    assert summaries[0].samples_done == 0


async def test_a_memory_sink_sees_a_run_as_a_store_does(server, tmp_path):
    """The fake behind the run's seam: what a run commits and fails into `MemorySink` is what it
    commits and fails into a store, value check and changed tokens included."""
    s0, s1, s2, s3 = _samples(4)
    nan = s2.input_ids
    server.engine.fault_for = lambda rid, ids: Fault("nan") if ids == nan else None
    changed = Sample("s1", [7] * len(s1.input_ids))
    with open_store(tmp_path / "s.zarr", "a") as store:
        assert (await _run(server, store, [s1])).ok
    outcomes = []
    for sink in (MemorySink(committed=[s1]), open_store(tmp_path / "s.zarr", "a")):
        summary = await _run(server, sink, [s0, changed, s2, s3])
        failed = [(f.sample_id, f.error, f.attempts) for f in summary.failures]
        held = [s.id for s in (s0, s1, s2, s3) if s.id in sink]
        outcomes.append((held, failed, summary.samples_done, summary.tokens_done))
        if isinstance(sink, HiddenStateStore):
            sink.close()
    assert outcomes[0] == outcomes[1]
    assert outcomes[0][1] == [("s1", "SampleExistsError", 0), ("s2", "NonFiniteValues", 1)]
