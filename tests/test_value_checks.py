"""The value check of each dump (no NaN or Inf, no vector of all zeros), taken in the store.

An extraction run leaves the check to the store, which reads every byte as it places a sample
anyway; `HiddenStateClient.extract` called alone, and a fail-fast run, check at ingest. A sample
that fails is not committed, is recorded as failed with the error the client's own check raises,
and a rerun extracts it again.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import zarr
from store_crash_writer import make_sample, open_test_store

from hsdump import (
    Backoff,
    DegenerateValues,
    HiddenStateClient,
    HiddenStates,
    NonFiniteValues,
    RunOptions,
    Sample,
    open_store,
    run_extraction,
    verify_store,
)
from hsdump.testing import FakeServer, Fault, MemorySink

NO_WAIT = Backoff(initial=0.0, jitter=0.0)


def _unchecked(hs: HiddenStates) -> HiddenStates:
    hs.values_checked = False
    return hs


def _bits(hs: HiddenStates) -> tuple[bytes, bytes]:
    return (
        hs.aux_hidden_states.view(torch.int16).numpy().tobytes(),
        hs.final_hidden_state.view(torch.int16).numpy().tobytes(),
    )


# (what to spoil, value, error, where the error points)
SPOILED = [
    ("aux", float("nan"), NonFiniteValues, "aux_hidden_states has NaN or Inf at token 7"),
    ("aux", float("-inf"), NonFiniteValues, "aux_hidden_states has NaN or Inf at token 7"),
    ("final", float("inf"), NonFiniteValues, "final_hidden_state has NaN or Inf at token 7"),
    ("aux", 0.0, DegenerateValues, "aux_hidden_states is all zeros at token 7"),
    ("final", -0.0, DegenerateValues, "final_hidden_state is all zeros at token 7"),
]


def _spoil(hs: HiddenStates, where: str, value: float) -> None:
    whole_vector = value == 0.0  # a zero only counts when the whole vector is zeros
    if where == "aux":
        if whole_vector:
            hs.aux_hidden_states[7, 1] = value
        else:
            hs.aux_hidden_states[7, 1, 3] = value
    elif whole_vector:
        hs.final_hidden_state[7] = value
    else:
        hs.final_hidden_state[7, 3] = value


@pytest.mark.parametrize(("where", "value", "error", "message"), SPOILED)
def test_the_store_refuses_an_unchecked_sample_whose_values_fail(
    tmp_path: Path, where: str, value: float, error: type[Exception], message: str
) -> None:
    good, bad, after = make_sample(0), make_sample(1), make_sample(2)
    _spoil(bad, where, value)
    path = str(tmp_path / "store")
    with open_test_store(path) as store:
        store.write(good)
        store.write(_unchecked(bad))
        store.write(_unchecked(after))
        store.flush()
        (refused,) = store.take_refused()
        assert store.take_refused() == []
    assert refused.sample_id == "s1" and isinstance(refused.error, error)
    assert message in str(refused.error) and refused.error.sample_id == "s1"
    assert (refused.num_tokens, refused.raw_bytes) == (bad.num_tokens, bad.nbytes)
    report = verify_store(path)
    assert report.clean and report.checked == 2
    with open_test_store(path) as store:
        assert sorted(store) == ["s0", "s2"]
        assert _bits(store["s2"]) == _bits(make_sample(2))
        store.write(_unchecked(make_sample(1)))  # a rerun: the id is free, the values pass
    with open_store(path, "r") as store:
        assert sorted(store) == ["s0", "s1", "s2"] and _bits(store["s1"]) == _bits(make_sample(1))


def test_no_value_of_a_refused_sample_stays_in_the_store_files(tmp_path: Path) -> None:
    path, bad = tmp_path / "store", make_sample(1)
    bad.aux_hidden_states[:, 0] = float("nan")  # every row: any byte of it left would show
    with open_test_store(str(path)) as store:
        store.write(make_sample(0))
        store.write(_unchecked(bad))
        store.write(make_sample(2))
    hidden = torch.from_numpy(zarr.open_group(str(path), mode="r")["part-default"]["hidden"][:])
    assert torch.isfinite(hidden.view(torch.bfloat16).float()).all()


def test_a_non_finite_row_is_named_before_an_all_zero_one(tmp_path: Path) -> None:
    hs = make_sample(1)
    hs.final_hidden_state[2] = 0.0
    hs.aux_hidden_states[9, 0, 0] = float("nan")
    with open_test_store(str(tmp_path / "store")) as store:
        store.write(_unchecked(hs))
        store.flush()
        (refused,) = store.take_refused()
    assert isinstance(refused.error, NonFiniteValues) and "token 9" in str(refused.error)


def test_a_checked_sample_is_stored_as_it_is(tmp_path: Path) -> None:
    hs = make_sample(1)
    hs.aux_hidden_states[7, 1] = 0.0  # values a caller wrote on purpose, not from a dump
    with open_test_store(str(tmp_path / "store")) as store:
        store.write(hs)
        store.flush()
        assert store.take_refused() == [] and "s1" in store


# -- through an extraction run ------------------------------------------------------------------


@pytest.fixture
def server(tmp_path: Path):  # type: ignore[no-untyped-def]
    with FakeServer(tmp_path / "dumps", hidden_size=8) as running:
        yield running


def _samples(n: int) -> list[Sample]:
    return [Sample(f"s{i}", [i + 1] * (i + 3)) for i in range(n)]


async def _extract(server: FakeServer, path: Path, samples: list[Sample], **options):  # type: ignore[no-untyped-def]
    async with HiddenStateClient(
        server.url, dump_dir=server.dump_dir, dump_timeout=5, probe=False
    ) as client:
        with open_store(path, "a") as store:
            run = RunOptions(backoff=NO_WAIT, **options)
            summary = await run_extraction(samples, client=client, store=store, options=run)
        return summary, client.stats


def _fault_on(server: FakeServer, sample: Sample, kind: str) -> None:
    server.engine.fault_for = lambda rid, ids: Fault(kind) if ids == sample.input_ids else None


@pytest.mark.anyio
@pytest.mark.parametrize(
    ("fault", "error"), [("nan", NonFiniteValues), ("zero_row", DegenerateValues)]
)
async def test_a_run_records_a_sample_the_store_refused_and_a_rerun_extracts_it(
    server: FakeServer, tmp_path: Path, fault: str, error: type[Exception]
) -> None:
    samples, path = _samples(3), tmp_path / "store"
    _fault_on(server, samples[1], fault)
    summary, stats = await _extract(server, path, samples, retries=2)
    (failure,) = summary.failures
    (rid,) = [r.rid for r in server.received if r.input_ids == samples[1].input_ids]
    assert (failure.sample_id, failure.error, failure.attempts) == ("s1", error.__name__, 1)
    assert rid in failure.message and "token" in failure.message
    assert stats.failures == {}  # the client did not check: the store did
    assert (summary.samples_done, summary.tokens_done) == (2, 3 + 5) and not summary.ok
    assert len(server.received) == 3  # no retry: no fresh request fixes the values
    assert verify_store(path).clean
    with open_store(path, "r") as store:
        assert sorted(store) == ["s0", "s2"]
    server.engine.fault_for = lambda rid, ids: None
    again, _ = await _extract(server, path, samples)
    assert again.ok and (again.samples_done, again.skipped) == (1, 2)
    with open_store(path, "r") as store:
        assert sorted(store) == ["s0", "s1", "s2"] and not store.duplicates


@pytest.mark.anyio
async def test_a_fail_fast_run_checks_at_ingest_and_stops_at_the_sample(
    server: FakeServer, tmp_path: Path
) -> None:
    samples = _samples(4)
    _fault_on(server, samples[1], "nan")
    summary, stats = await _extract(server, tmp_path / "store", samples, fail_fast=True)
    assert stats.failures == {"NonFiniteValues": 1} and summary.interrupted
    assert [f.sample_id for f in summary.failures] == ["s1"]
    assert samples[3].input_ids not in [r.input_ids for r in server.received]


class HandedOver(MemorySink):
    """Notes, for each sample the run hands over, whether its values were checked and finite."""

    def __init__(self) -> None:
        super().__init__()
        self.handed: dict[str, tuple[bool, bool]] = {}

    async def awrite(self, states: HiddenStates) -> None:
        finite = bool(torch.isfinite(states.aux_hidden_states.float()).all())
        self.handed[states.sample_id] = (states.values_checked, finite)
        await super().awrite(states)


@pytest.mark.anyio
@pytest.mark.parametrize("fail_fast", [False, True])
async def test_a_run_hands_the_store_the_dumps_values_unchecked_unless_it_fails_fast(
    server: FakeServer, fail_fast: bool
) -> None:
    samples = _samples(3)
    _fault_on(server, samples[1], "nan")
    sink = HandedOver()
    async with HiddenStateClient(server.url, dump_dir=server.dump_dir, dump_timeout=5) as client:
        run = RunOptions(fail_fast=fail_fast)
        summary = await run_extraction(samples, client=client, store=sink, options=run)
    assert [(f.sample_id, f.error) for f in summary.failures] == [("s1", "NonFiniteValues")]
    if fail_fast:  # the client refused it: the store never saw it
        assert sink.handed == {"s0": (True, True)} and client.stats.failures
    else:
        assert sink.handed == {"s0": (False, True), "s1": (False, False), "s2": (False, True)}
        assert sink.writes == ["s0", "s2"] and client.stats.failures == {}


class TrustsTheClient(HandedOver):
    """A sink that does not check values: the run must hand it checked states only."""

    checks_values = False


@pytest.mark.anyio
async def test_a_sink_that_does_not_check_values_gets_them_checked_by_the_client(
    server: FakeServer,
) -> None:
    samples = _samples(3)
    _fault_on(server, samples[1], "nan")
    sink = TrustsTheClient()
    async with HiddenStateClient(server.url, dump_dir=server.dump_dir, dump_timeout=5) as client:
        summary = await run_extraction(samples, client=client, store=sink)
    assert [(f.sample_id, f.error) for f in summary.failures] == [("s1", "NonFiniteValues")]
    assert sink.handed == {"s0": (True, True), "s2": (True, True)}
    assert client.stats.failures == {"NonFiniteValues": 1}


@pytest.mark.anyio
async def test_extract_alone_checks_the_values_at_ingest(server: FakeServer) -> None:
    good, bad = _samples(2)
    _fault_on(server, bad, "nan")
    async with HiddenStateClient(server.url, dump_dir=server.dump_dir, dump_timeout=5) as client:
        assert (await client.extract(good)).values_checked
        with pytest.raises(NonFiniteValues, match="aux_hidden_states has NaN or Inf at token"):
            await client.extract(bad)
        assert client.stats.failures == {"NonFiniteValues": 1}
