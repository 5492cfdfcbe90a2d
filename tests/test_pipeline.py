"""The extraction loop: resume, retries with fresh requests, failures recorded, cancellation."""

from __future__ import annotations

import json
import math

import anyio
import pytest

from hsdump import HiddenStateClient, HiddenStates, Sample
from hsdump._exceptions import InputError, StoreError
from hsdump._pipeline import Backoff, Failure, failures_path_for, run_extraction
from hsdump.testing import FakeServer, Fault

pytestmark = pytest.mark.anyio
NO_WAIT = Backoff(initial=0.0, jitter=0.0)


class MemoryStore:
    """The store's write seam, in memory: commits whole samples, counts bytes."""

    def __init__(self, committed: tuple[str, ...] = ()):
        self.samples: dict[str, HiddenStates] = dict.fromkeys(committed)  # type: ignore[arg-type]
        self.writes: list[str] = []
        self.bytes_raw = self.bytes_stored = self.pending = self.flushes = 0
        self.refuse: dict[str, Exception] = {}

    def __contains__(self, sample_id: object) -> bool:
        return sample_id in self.samples

    async def write(self, states: HiddenStates) -> None:
        if states.sample_id in self.refuse:
            raise self.refuse[states.sample_id]
        self.samples[states.sample_id] = states
        self.writes.append(states.sample_id)
        self.pending += states.nbytes

    async def flush(self) -> None:
        self.flushes += 1
        self.bytes_raw += self.pending
        self.bytes_stored += self.pending // 2
        self.pending = 0


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
        return await run_extraction(samples, client=client, store=store, backoff=NO_WAIT, **options)


async def test_every_sample_is_committed_once_under_its_own_id(server):
    store = MemoryStore()
    summary = await _run(server, store, _samples(4))
    assert sorted(store.writes) == ["s0", "s1", "s2", "s3"] and summary.ok
    assert all(store.samples[f"s{i}"].input_ids.tolist() == [i + 1] * (i + 2) for i in range(4))
    assert (summary.samples_done, summary.tokens_done, summary.skipped) == (4, 2 + 3 + 4 + 5, 0)
    assert summary.ratio == pytest.approx(2.0)


async def test_committed_samples_are_skipped_and_not_requested(server):
    store = MemoryStore(committed=("s0", "s2"))
    summary = await _run(server, store, _samples(4))
    assert store.writes == ["s1", "s3"] and summary.skipped == 2 and summary.samples_total == 2
    assert len(server.received) == 2


async def test_a_transient_failure_is_retried_with_a_fresh_request(server):
    server.inject(Fault("http_500"), Fault("error_marker"))
    store = MemoryStore()
    summary = await _run(server, store, _samples(1), retries=2)
    rids = [r.rid for r in server.received]
    assert store.writes == ["s0"] and summary.retries == 2 and summary.ok
    assert len(set(rids)) == 3 and len({r.extra_key for r in server.received}) == 3


async def test_a_sample_that_keeps_failing_is_recorded_and_the_run_goes_on(server, tmp_path):
    s0 = _samples(1)[0]
    server.engine.fault_for = lambda rid, ids: Fault("http_500") if ids == s0.input_ids else None
    store, failures = MemoryStore(), tmp_path / "f.jsonl"
    summary = await _run(
        server, store, _samples(2), retries=2, failures_path=failures, line_numbers={"s0": 7}
    )
    assert store.writes == ["s1"] and not summary.ok
    (record,) = [json.loads(line) for line in failures.read_text().splitlines()]
    assert record["id"] == "s0" and record["line"] == 7 and record["attempts"] == 3
    assert record["error"] == "ServerResponseError" and "500" in record["message"]


async def test_a_permanent_failure_is_not_retried(server, tmp_path):
    server.inject(Fault("nan"))
    summary = await _run(server, MemoryStore(), _samples(2), retries=3)
    assert [(f.sample_id, f.error, f.attempts) for f in summary.failures] == [
        ("s0", "NonFiniteValues", 1)
    ]
    assert len(server.received) == 2


async def test_fail_fast_stops_at_the_first_failure(server):
    server.inject(Fault("http_400"))
    store = MemoryStore()
    summary = await _run(server, store, _samples(3), fail_fast=True)
    assert store.writes == [] and len(summary.failures) == 1 and summary.interrupted


async def test_a_sample_the_store_refuses_fails_alone_and_the_run_goes_on(server):
    store = MemoryStore()
    store.refuse["s1"] = InputError("shapes do not fit", sample_id="s1")
    summary = await _run(server, store, _samples(3))
    assert store.writes == ["s0", "s2"] and [f.error for f in summary.failures] == ["InputError"]


async def test_a_store_error_stops_the_run_at_once_and_keeps_what_was_committed(server, tmp_path):
    store, samples = MemoryStore(), _samples(10)
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
        server, MemoryStore(), _samples(1), failures_path=failures, prior_failures=[bad]
    )
    assert json.loads(failures.read_text().splitlines()[0])["line"] == 3 and not summary.ok


async def test_a_stale_failures_file_is_removed_by_a_run_without_failures(server, tmp_path):
    failures = tmp_path / "f.jsonl"
    failures.write_text('{"id": "old"}\n')
    await _run(server, MemoryStore(), _samples(1), failures_path=failures)
    assert not failures.exists()


async def test_cancellation_keeps_committed_samples_and_marks_the_run_interrupted(tmp_path):
    seen = []
    store = MemoryStore()
    with FakeServer(tmp_path / "dumps", hidden_size=8, latency=0.2) as slow:
        with anyio.move_on_after(0.5):
            await _run(slow, store, _samples(10), progress=seen.append)
    summary = seen[-1]
    assert summary.interrupted and 1 <= len(store.writes) < 10
    assert store.writes == [f"s{i}" for i in range(len(store.writes))]
    assert summary.samples_done == len(store.writes) and store.flushes == 1


async def test_concurrent_workers_commit_every_sample_once(tmp_path):
    store = MemoryStore()
    with FakeServer(tmp_path / "dumps", hidden_size=8, latency=0.05) as server:
        async with HiddenStateClient(
            server.url, dump_dir=server.dump_dir, max_in_flight=4
        ) as client:
            await run_extraction(_samples(12), client=client, store=store, concurrency=4)
    assert sorted(store.writes) == sorted(s.id for s in _samples(12))
    assert all(store.samples[s.id].input_ids.tolist() == s.input_ids for s in _samples(12))


def test_summary_rates_and_eta_follow_the_counters():
    from hsdump._pipeline import ExtractionSummary

    summary = ExtractionSummary(tokens_total=300, tokens_done=100, started=0.0, finished=10.0)
    assert summary.tokens_per_s == 10.0 and summary.eta_s == 20.0 and math.isnan(summary.ratio)


def test_backoff_grows_and_is_capped():
    backoff = Backoff(initial=1.0, factor=3.0, maximum=5.0, jitter=0.0)
    assert [backoff.delay(n) for n in (1, 2, 3)] == [1.0, 3.0, 5.0]


def test_failures_file_sits_beside_the_store(tmp_path):
    assert failures_path_for(tmp_path / "out.zarr") == tmp_path / "out.zarr.failures.jsonl"


class SlowStore(MemoryStore):
    """Records how many requests the server had received when each write ended."""

    def __init__(self, server: FakeServer):
        super().__init__()
        self.server = server
        self.seen_at_write: dict[str, int] = {}

    async def write(self, states: HiddenStates) -> None:
        await anyio.sleep(0.2)
        self.seen_at_write[states.sample_id] = len(self.server.received)
        await super().write(states)


async def test_the_next_request_is_at_the_server_while_a_sample_is_written(server):
    store = SlowStore(server)
    summary = await _run(server, store, _samples(3), concurrency=1)
    assert summary.ok
    assert store.seen_at_write["s0"] >= 2  # s1 was sent during s0's write, one at a time


async def test_the_summary_reports_time_per_stage(server):
    summary = await _run(server, SlowStore(server), _samples(2))
    assert set(summary.stages) == {"server", "dump_wait", "ingest", "store_write"}
    assert summary.stages["store_write"] >= 0.4 - 0.05
    assert all(seconds >= 0 for seconds in summary.stages.values())
