"""Extraction in worker processes: one store, every sample once, failures and stops in workers."""

from __future__ import annotations

import contextlib
import json
import multiprocessing
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from _servers import count_requests

from hsdump import (
    RunOptions,
    Sample,
    WorkerError,
    open_store,
    run_parallel_extraction,
    verify_store,
)
from hsdump.testing import FakeServer, Fault, cli_app

pytestmark = pytest.mark.timeout(180)


def _samples(n: int, seed: int = 0) -> list[Sample]:
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 80, (n,), generator=gen).tolist()
    return [
        Sample(f"s{i}", torch.randint(0, 500, (t,), generator=gen).tolist())
        for i, t in enumerate(lengths)
    ]


@pytest.fixture
def fake(tmp_path: Path):
    with FakeServer(tmp_path / "dumps", hidden_size=16) as server:
        yield server


def _run(  # type: ignore[no-untyped-def]
    server: FakeServer,
    store: Path,
    samples: list[Sample],
    *,
    workers: int = 2,
    client_options: dict | None = None,
    **options,
):
    """``run_parallel_extraction`` on ``server``; ``options`` are `RunOptions` (concurrency 2)."""
    return run_parallel_extraction(
        samples, url=server.url, dump_dir=server.dump_dir, store=store, workers=workers,
        options=RunOptions(**{"concurrency": 2, **options}), client_options=client_options,
    )  # fmt: skip


def _contents(store: Path) -> dict[str, tuple[torch.Tensor, torch.Tensor, list[int]]]:
    with open_store(store, "r") as opened:
        assert not opened.duplicates
        return {
            sid: (hs.aux_hidden_states, hs.final_hidden_state, hs.input_ids.tolist())
            for sid in opened
            for hs in [opened[sid]]
        }


def _dumps_left(server: FakeServer) -> list[str]:
    return sorted(p.name for p in server.dump_dir.iterdir() if p.name.startswith(("req_", ".tmp")))


def test_workers_store_what_one_process_stores(fake, tmp_path) -> None:
    samples = _samples(24)
    summary = _run(fake, tmp_path / "par.zarr", samples, workers=3, concurrency=3)
    assert summary.ok and summary.samples_done == 24 and summary.workers == 3
    one = _run(fake, tmp_path / "one.zarr", samples, workers=1, concurrency=1)
    par, ref = _contents(tmp_path / "par.zarr"), _contents(tmp_path / "one.zarr")
    assert one.ok and sorted(par) == sorted(ref) == sorted(s.id for s in samples)
    for sid, (aux, final, ids) in ref.items():
        assert torch.equal(par[sid][0], aux) and torch.equal(par[sid][1], final)
        assert par[sid][2] == ids
    assert _dumps_left(fake) == []


def test_requests_in_flight_stay_bounded_over_all_workers(fake, tmp_path) -> None:
    _, peak = count_requests(fake)
    fake.engine.latency = 0.02
    summary = _run(fake, tmp_path / "s.zarr", _samples(30), workers=3, concurrency=2)
    assert summary.ok and summary.samples_done == 30
    assert peak[0] == 2  # reached, never passed


def test_only_the_first_worker_of_a_server_probes_it(fake, tmp_path) -> None:
    summary = _run(fake, tmp_path / "s.zarr", _samples(6), workers=3)
    assert summary.ok and summary.samples_done == 6
    probes = [r for r in fake.engine.received if r.input_ids == [0]]  # the probe's one token
    assert len(probes) == 1


def test_a_rerun_with_another_worker_count_skips_what_is_stored(fake, tmp_path) -> None:
    samples = _samples(16)
    _run(fake, tmp_path / "s.zarr", samples[:10], workers=2)
    summary = _run(fake, tmp_path / "s.zarr", samples, workers=3)
    assert summary.skipped == 10 and summary.samples_done == 6
    assert sorted(_contents(tmp_path / "s.zarr")) == sorted(s.id for s in samples)


def test_a_killed_worker_loses_nothing_and_its_samples_are_redone(fake, tmp_path) -> None:
    samples, killed = _samples(40), []

    def kill_one(summary) -> None:
        # Mid-run: commits come once a second, so the server's count says how far the run is.
        alive = multiprocessing.active_children()
        if not killed and len(fake.engine.received) >= 8 and alive:
            os.kill(alive[0].pid, signal.SIGKILL)
            killed.append(alive[0].pid)

    fake.engine.latency = 0.02
    summary = _run(fake, tmp_path / "s.zarr", samples, progress=kill_one)
    assert killed and summary.ok
    assert sorted(_contents(tmp_path / "s.zarr")) == sorted(s.id for s in samples)
    assert verify_store(tmp_path / "s.zarr").clean
    assert multiprocessing.active_children() == []


def test_a_worker_that_cannot_open_stops_the_run_with_its_reason(tmp_path) -> None:
    with pytest.raises(WorkerError, match="ServerUnavailable: cannot reach the server"):
        run_parallel_extraction(
            _samples(4), url="http://127.0.0.1:9", dump_dir=tmp_path, store=tmp_path / "s.zarr",
            workers=2,
        )  # fmt: skip
    assert multiprocessing.active_children() == []


def test_failures_in_workers_are_recorded_with_their_dataset_line(fake, tmp_path) -> None:
    samples = _samples(6)
    bad = samples[3].input_ids
    fake.engine.fault_for = lambda rid, ids: Fault("error_marker") if ids == bad else None
    failures = tmp_path / "f.jsonl"
    summary = _run(
        fake, tmp_path / "s.zarr", samples, retries=0, failures_path=failures,
        line_numbers={s.id: i + 1 for i, s in enumerate(samples)},
    )  # fmt: skip
    assert [f.sample_id for f in summary.failures] == ["s3"] and summary.samples_done == 5
    (record,) = [json.loads(line) for line in failures.read_text().splitlines()]
    assert (record["id"], record["line"], record["error"]) == ("s3", 4, "DumpFailed")


def test_a_sample_a_workers_store_refuses_is_recorded_and_the_rest_is_stored(
    fake, tmp_path
) -> None:
    samples = _samples(6)
    bad = samples[2].input_ids
    fake.engine.fault_for = lambda rid, ids: Fault("nan") if ids == bad else None
    summary = _run(fake, tmp_path / "s.zarr", samples)
    assert [(f.sample_id, f.error) for f in summary.failures] == [("s2", "NonFiniteValues")]
    assert summary.samples_done == 5 and summary.tokens_done == sum(
        len(s.input_ids) for s in samples if s.input_ids != bad
    )
    assert sorted(_contents(tmp_path / "s.zarr")) == sorted(s.id for s in samples if s.id != "s2")
    assert verify_store(tmp_path / "s.zarr").clean


@pytest.mark.parametrize(
    ("fault", "error"),
    [
        (Fault("http_400"), "ServerResponseError"),
        (Fault("drop_connection"), "ServerUnavailable"),
        (Fault("response_rid"), "RidMismatch"),
        (Fault("dump_first", delay=2.0), "ServerTimeout"),
    ],
)
def test_what_the_server_answers_through_the_parent_reaches_the_worker_as_its_error(
    fake, tmp_path, fault: Fault, error: str
) -> None:
    samples = _samples(6)
    bad = samples[1].input_ids
    fake.engine.fault_for = lambda rid, ids: fault if ids == bad else None
    summary = _run(
        fake, tmp_path / "s.zarr", samples, retries=0, client_options={"request_timeout": 0.5}
    )
    assert [(f.sample_id, f.error) for f in summary.failures] == [("s1", error)]
    assert sorted(_contents(tmp_path / "s.zarr")) == sorted(s.id for s in samples if s.id != "s1")


# -- the CLI in a process of its own: signals and SIGKILL ---------------------------------------


def _cli(
    server: FakeServer, tmp_path: Path, n: int, concurrency: int = 2
) -> subprocess.Popen[bytes]:
    dataset = tmp_path / "d.jsonl"
    rows = [{"id": s.id, "input_ids": list(s.input_ids)} for s in _samples(n)]
    dataset.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cmd = [
        sys.executable, "-m", "hsdump", "extract", str(dataset),
        "--out", str(tmp_path / "s.zarr"), "--server-url", server.url, "--dump-dir",
        str(server.dump_dir), "--workers", "2", "--concurrency", str(concurrency),
    ]  # fmt: skip
    with (tmp_path / "stderr.log").open("ab") as err:
        return subprocess.Popen(cmd, stderr=err, start_new_session=True)


def _committed(store: Path) -> int:
    try:
        with open_store(store, "r") as opened:
            return len(opened)
    except Exception:
        return 0


def _wait_for_commits(proc: subprocess.Popen[bytes], store: Path, count: int) -> None:
    deadline = time.monotonic() + 60
    while _committed(store) < count:
        assert proc.poll() is None, (store.parent / "stderr.log").read_text()
        assert time.monotonic() < deadline, "no commit within 60 s"
        time.sleep(0.05)  # polls another process's store: there is no event to await


def _semaphores() -> set[str]:
    """Named POSIX semaphores (multiprocessing's live in /dev/shm as ``sem.*``)."""
    shm = Path("/dev/shm")
    return {p.name for p in shm.glob("sem.*")} if shm.is_dir() else set()


def _group_gone(pgid: int) -> bool:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.05)
    return False


@pytest.mark.slow
@pytest.mark.parametrize(("sig", "codes"), [(signal.SIGTERM, (130, 143)), (signal.SIGINT, (130,))])
def test_a_signal_stops_every_worker_and_leaves_nothing_behind(fake, tmp_path, sig, codes):
    fake.engine.latency = 0.05
    proc = _cli(fake, tmp_path, 200)
    _wait_for_commits(proc, tmp_path / "s.zarr", 1)
    if sig == signal.SIGINT:
        os.killpg(proc.pid, sig)  # Ctrl-C in a terminal reaches the whole process group
    else:
        proc.send_signal(sig)
    proc.wait(timeout=120)
    err = (tmp_path / "stderr.log").read_text()
    assert proc.returncode in codes, err
    assert _group_gone(proc.pid), "a worker outlived the run"
    assert _dumps_left(fake) == [] and "Traceback" not in err
    stored = _committed(tmp_path / "s.zarr")
    assert 0 < stored < 200 and verify_store(tmp_path / "s.zarr").clean


@pytest.mark.slow
def test_ctrl_c_sends_nothing_more_and_reports_what_the_store_holds(fake, tmp_path) -> None:
    fake.engine.latency = 0.1
    arrived, _ = count_requests(fake)
    proc = _cli(fake, tmp_path, 200, concurrency=1)
    _wait_for_commits(proc, tmp_path / "s.zarr", 1)
    before = len(arrived)
    os.killpg(proc.pid, signal.SIGINT)  # Ctrl-C in a terminal reaches the whole process group
    proc.wait(timeout=60)
    err = (tmp_path / "stderr.log").read_text()
    assert proc.returncode == 130, err
    # Only the request posted as the signal came reaches the server: the workers' queued samples
    # (four each) are dropped, not sent.
    assert len(arrived) - before <= 1, err
    assert _group_gone(proc.pid), "a worker outlived the run"
    summary = err[err.index("interrupted") :]
    written = re.search(r"(\d+) samples written", summary)
    assert written and int(written[1]) == _committed(tmp_path / "s.zarr") > 0, err
    assert "progress:" not in summary, "the progress bar came back under the summary"
    assert _dumps_left(fake) == [] and verify_store(tmp_path / "s.zarr").clean


@pytest.mark.slow
def test_a_sigkill_of_the_whole_run_then_a_rerun_resumes_exactly(fake, tmp_path) -> None:
    fake.engine.latency = 0.02
    before = _semaphores()
    proc = _cli(fake, tmp_path, 120)
    _wait_for_commits(proc, tmp_path / "s.zarr", 10)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=60)
    assert _group_gone(proc.pid)
    # Nothing left in /dev/shm: no named semaphore of a worker (its remover died with the run).
    assert _semaphores() <= before
    fake.engine.latency = 0.0
    rerun = _cli(fake, tmp_path, 120)
    assert rerun.wait(timeout=150) == 0, (tmp_path / "stderr.log").read_text()
    assert sorted(_contents(tmp_path / "s.zarr")) == sorted(s.id for s in _samples(120))
    assert verify_store(tmp_path / "s.zarr").clean


# -- several servers, one store ----------------------------------------------------------------


def test_samples_spread_over_several_servers_land_once_in_one_store(tmp_path) -> None:
    samples = _samples(30)
    with contextlib.ExitStack() as stack:
        servers = [
            stack.enter_context(FakeServer(tmp_path / f"dumps{i}", hidden_size=16))
            for i in range(3)
        ]
        for server in servers:
            server.engine.latency = 0.01
        summary = run_parallel_extraction(
            samples, servers=[(s.url, s.dump_dir) for s in servers], store=tmp_path / "many.zarr",
            workers=1, options=RunOptions(concurrency=1),
        )  # fmt: skip
        served = [sum(r.rid.startswith("hsdump-") for r in s.received) for s in servers]
        one = _run(servers[0], tmp_path / "one.zarr", samples, workers=1, concurrency=1)
    assert summary.ok and one.ok and summary.samples_done == 30 and summary.workers == 3
    assert _contents(tmp_path / "many.zarr").keys() == _contents(tmp_path / "one.zarr").keys()
    for sid, (aux, final, ids) in _contents(tmp_path / "one.zarr").items():
        many = _contents(tmp_path / "many.zarr")[sid]
        assert torch.equal(many[0], aux) and torch.equal(many[1], final) and many[2] == ids
    assert all(count > 1 for count in served)  # its probe and at least one sample each


def test_a_server_whose_workers_cannot_open_is_left_out(fake, tmp_path) -> None:
    samples = _samples(12)
    summary = run_parallel_extraction(
        samples, servers=[(fake.url, fake.dump_dir), ("http://127.0.0.1:9", tmp_path / "none")],
        store=tmp_path / "s.zarr", workers=1,
    )  # fmt: skip
    assert summary.ok and summary.samples_done == 12
    assert sorted(_contents(tmp_path / "s.zarr")) == sorted(s.id for s in samples)


def test_a_server_that_dumps_elsewhere_gets_no_sample_from_its_other_workers(
    fake, tmp_path
) -> None:
    """Only a server's first worker probes it: the others wait for that probe before any
    sample is theirs, so a server whose dumps never reach the client's root costs no timeout."""
    samples = _samples(40)
    with FakeServer(tmp_path / "elsewhere", hidden_size=16) as stray:
        # The client's root announces the server (a copy of its manifest), but no dump lands there.
        shutil.copytree(stray.dump_dir / "_producers", tmp_path / "not-its-root" / "_producers")
        summary = run_parallel_extraction(
            samples, servers=[(fake.url, fake.dump_dir), (stray.url, tmp_path / "not-its-root")],
            store=tmp_path / "s.zarr", workers=2, options=RunOptions(concurrency=2),
        )  # fmt: skip
        asked = len(stray.engine.received)
    assert summary.ok and summary.samples_done == 40
    assert asked == 1  # its probe, and nothing else


def test_extract_spreads_a_dataset_over_the_servers_in_a_servers_file(tmp_path) -> None:
    from typer.testing import CliRunner

    dataset = tmp_path / "d.jsonl"
    rows = [{"id": s.id, "input_ids": list(s.input_ids)} for s in _samples(10)]
    dataset.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with contextlib.ExitStack() as stack:
        roots = [tmp_path / f"dumps{i}" for i in range(2)]
        servers = [stack.enter_context(FakeServer(root, hidden_size=16)) for root in roots]
        listing = [{"url": s.url, "dump_dir": str(s.dump_dir)} for s in servers]
        (tmp_path / "servers.json").write_text(json.dumps(listing))
        args = ["extract", str(dataset), "--out", str(tmp_path / "s.zarr"), "--servers"]
        result = CliRunner().invoke(
            cli_app, [*args, str(tmp_path / "servers.json"), "--workers", "1", "-v"]
        )
    assert result.exit_code == 0, result.output
    assert sorted(_contents(tmp_path / "s.zarr")) == sorted(r["id"] for r in rows)
    assert "2 worker process(es)" in result.output


@pytest.mark.parametrize(("lines", "parts"), [(1, ["part-default"]), (4, ["part-w0", "part-w1"])])
def test_extract_runs_a_worker_per_eight_cores_and_none_for_one_sample(
    fake, tmp_path, monkeypatch, lines, parts
) -> None:
    from typer.testing import CliRunner

    monkeypatch.setenv("HSDUMP_CORES", "16")  # the cores the command may use, not the host's
    dataset, store = tmp_path / "d.jsonl", tmp_path / "s.zarr"
    rows = [{"id": s.id, "input_ids": list(s.input_ids)} for s in _samples(lines)]
    dataset.write_text("".join(json.dumps(r) + "\n" for r in rows))
    args = ["--out", str(store), "--server-url", fake.url, "--dump-dir", str(fake.dump_dir)]
    result = CliRunner().invoke(cli_app, ["extract", str(dataset), *args])
    assert result.exit_code == 0, result.output
    assert sorted(p.name for p in store.glob("part-*")) == parts


def test_a_malformed_servers_file_is_a_one_line_error(tmp_path) -> None:
    from typer.testing import CliRunner

    (tmp_path / "servers.json").write_text(json.dumps([{"dump_dir": "/x"}]))
    (tmp_path / "d.jsonl").write_text(json.dumps({"id": "a", "input_ids": [1]}) + "\n")
    args = ["extract", str(tmp_path / "d.jsonl"), "--out", str(tmp_path / "s.zarr")]
    result = CliRunner().invoke(cli_app, [*args, "--servers", str(tmp_path / "servers.json")])
    assert result.exit_code == 2 and "server 1: expected" in result.output
