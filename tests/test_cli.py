"""The ``hsdump`` command line, run in-process against real servers on loopback."""

from __future__ import annotations

import json
import logging
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from hsdump import DumpMeta, PollingWatcher, ProducerInfo, __version__, open_store
from hsdump.testing import FakeServer, Fault, build_default_model, cli_app, small_page_tmpfs

TINY = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 256,
    "max_position_embeddings": 64,
}
runner = CliRunner()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("model")
    build_default_model(seed=5, **TINY).save_pretrained(path)
    return path


def _dataset(path, *lines):
    path.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines))
    return path


def _good(n):
    return [{"id": f"s{i}", "input_ids": list(range(1, 3 + 5 * i))} for i in range(n)]


def _extract(model_dir, tmp_path, dataset, *extra):
    args = ["extract", str(dataset), "--out", str(tmp_path / "s.zarr"), "--model", str(model_dir)]
    return runner.invoke(cli_app, [*args, "--dump-dir", str(tmp_path / "dumps"), *extra])


def _ids(tmp_path):
    with open_store(tmp_path / "s.zarr", "r") as store:
        return sorted(store)


def test_extract_writes_every_sample_prints_a_summary_and_exits_zero(model_dir, tmp_path):
    result = _extract(model_dir, tmp_path, _dataset(tmp_path / "d.jsonl", *_good(3)))
    assert result.exit_code == 0, result.output
    assert "3 samples written" in result.output and "tokens/s" in result.output
    assert _ids(tmp_path) == ["s0", "s1", "s2"]
    assert not (tmp_path / "s.zarr.failures.jsonl").exists()


def test_a_rerun_skips_stored_samples_and_says_how_many(model_dir, tmp_path):
    dataset = _dataset(tmp_path / "d.jsonl", *_good(2))
    _extract(model_dir, tmp_path, dataset)
    _dataset(dataset, *_good(3))
    result = _extract(model_dir, tmp_path, dataset)
    assert result.exit_code == 0 and "1 samples written, 2 skipped" in result.output
    assert _ids(tmp_path) == ["s0", "s1", "s2"]


def test_bad_lines_are_named_recorded_and_the_rest_is_extracted(model_dir, tmp_path):
    lines = [
        _good(1)[0],
        "{oops",
        {"id": "far", "input_ids": [1, 256]},
        {"id": "long", "input_ids": [1] * 65},
        {"id": "s0", "input_ids": [4]},
        {"id": "ok", "input_ids": [7, 8]},
    ]
    result = _extract(model_dir, tmp_path, _dataset(tmp_path / "d.jsonl", *lines))
    assert result.exit_code == 1 and result.output.count("bad line") == 4
    assert _ids(tmp_path) == ["ok", "s0"]
    records = [json.loads(x) for x in (tmp_path / "s.zarr.failures.jsonl").read_text().splitlines()]
    reasons = ["not valid JSON", "vocabulary", "context", "duplicate"]
    assert [(r["line"], r["error"], r["attempts"]) for r in records] == [
        (n, "InputError", 0) for n in (2, 3, 4, 5)
    ]
    for number, reason, record in zip((2, 3, 4, 5), reasons, records, strict=True):
        assert f"d.jsonl:{number}: " in record["message"] and reason in record["message"]


def test_fail_fast_stops_before_extracting_after_a_bad_line(model_dir, tmp_path):
    dataset = _dataset(tmp_path / "d.jsonl", "nope", *_good(2))
    result = _extract(model_dir, tmp_path, dataset, "--fail-fast")
    assert result.exit_code == 1 and _ids(tmp_path) == []


@pytest.fixture
def fake(tmp_path):
    with FakeServer(tmp_path / "fake-dumps", hidden_size=8) as server:
        yield server


def _extract_from(server, tmp_path, dataset, *extra):
    args = ["extract", str(dataset), "--out", str(tmp_path / "s.zarr")]
    server_args = ["--server-url", server.url, "--dump-dir", str(server.dump_dir)]
    return runner.invoke(cli_app, [*args, *server_args, *extra])


def test_a_transient_failure_is_retried_and_the_sample_stored(fake, tmp_path):
    s0, faults = _good(1)[0]["input_ids"], iter([Fault("http_500"), Fault("drop_connection")])
    fake.engine.fault_for = lambda rid, ids: next(faults, None) if ids == s0 else None
    result = _extract_from(fake, tmp_path, _dataset(tmp_path / "d.jsonl", *_good(2)))
    assert result.exit_code == 0, result.output
    assert _ids(tmp_path) == ["s0", "s1"] and [r.input_ids for r in fake.received].count(s0) == 3


def test_a_sample_failing_every_retry_is_recorded_and_the_exit_code_is_one(fake, tmp_path):
    s0 = _good(1)[0]["input_ids"]
    fake.engine.fault_for = lambda rid, ids: Fault("error_marker") if ids == s0 else None
    dataset = _dataset(tmp_path / "d.jsonl", *_good(2))
    result = _extract_from(fake, tmp_path, dataset, "--retries", "1")
    assert result.exit_code == 1 and _ids(tmp_path) == ["s1"]
    (record,) = [
        json.loads(x) for x in (tmp_path / "s.zarr.failures.jsonl").read_text().splitlines()
    ]
    assert (record["id"], record["line"], record["error"], record["attempts"]) == (
        "s0",
        1,
        "DumpFailed",
        2,
    )


def test_request_timeout_bounds_the_wait_for_the_http_response(fake, tmp_path):
    s0, release = _good(1)[0]["input_ids"], threading.Event()
    fake.engine.fault_for = lambda rid, ids: release.wait(30) and None if ids == s0 else None
    dataset = _dataset(tmp_path / "d.jsonl", *_good(1))
    try:
        result = _extract_from(
            fake, tmp_path, dataset, "--request-timeout", "0.2", "--retries", "0"
        )
    finally:
        release.set()
    assert result.exit_code == 1, result.output
    (record,) = [
        json.loads(x) for x in (tmp_path / "s.zarr.failures.jsonl").read_text().splitlines()
    ]
    assert record["error"] == "ServerTimeout" and "within 0.2 s" in record["message"]


@pytest.mark.parametrize(
    ("workers", "setting"), [("1", {"layer_ids": (1, 3, 5)}), ("2", {"hidden_size": 16})]
)
def test_a_store_of_another_setting_is_refused_before_any_request(fake, tmp_path, workers, setting):
    _extract_from(fake, tmp_path, _dataset(tmp_path / "d.jsonl", *_good(2)))
    dataset = _dataset(tmp_path / "more.jsonl", *_good(8))
    with FakeServer(tmp_path / "other-dumps", **{"hidden_size": 8, **setting}) as other:
        result = _extract_from(other, tmp_path, dataset, "--workers", workers)
        sent = [r.input_ids for r in other.received]
    assert result.exit_code == 2, result.output
    (name,) = setting
    assert result.output.count("error:") == 1 and f"{name} differs" in result.output
    assert "another setting than the server at" in result.output
    assert sent == [] and _ids(tmp_path) == ["s0", "s1"]  # refused before any request


def test_an_unreachable_server_is_a_one_line_error_with_exit_code_two(tmp_path):
    dataset = _dataset(tmp_path / "d.jsonl", *_good(1))
    args = ["extract", str(dataset), "--out", str(tmp_path / "s.zarr")]
    result = runner.invoke(
        cli_app, [*args, "--server-url", "http://127.0.0.1:9", "--dump-dir", str(tmp_path)]
    )
    assert result.exit_code == 2 and result.output.startswith("error:")
    assert "cannot reach the server at http://127.0.0.1:9" in result.output
    assert "Traceback" not in result.output


def test_an_unwritable_dump_root_is_a_one_line_error_with_exit_code_two(model_dir, tmp_path):
    (tmp_path / "file").write_text("")
    dataset = _dataset(tmp_path / "d.jsonl", *_good(1))
    args = ["extract", str(dataset), "--out", str(tmp_path / "s.zarr"), "--model", str(model_dir)]
    result = runner.invoke(cli_app, [*args, "--dump-dir", str(tmp_path / "file" / "dumps")])
    assert result.exit_code == 2 and "Traceback" not in result.output
    assert "error: cannot write to the dump root" in result.output
    assert str(tmp_path / "file" / "dumps") in result.output.replace("\n", "")


def test_a_missing_dataset_is_a_one_line_error(model_dir, tmp_path):
    result = _extract(model_dir, tmp_path, tmp_path / "missing.jsonl")
    assert result.exit_code == 2 and "cannot read the dataset" in result.output
    assert "No such file or directory" in result.output
    assert "starting the reference server" not in result.output  # checked before any server
    assert "Traceback" not in result.output


def test_help_lists_the_subcommands_and_their_examples():
    result = runner.invoke(cli_app, ["--help"])
    for command in ("extract", "serve-reference", "verify-store", "stats"):
        assert command in result.output
    assert "hsdump extract bundled --out" in runner.invoke(cli_app, ["extract", "--help"]).output


def _help_at_80_columns(*command):
    result = runner.invoke(cli_app, [*command, "--help"], env={"COLUMNS": "80"})
    assert result.exit_code == 0, result.output
    return result.output


@pytest.mark.parametrize("name", ["", *sorted(typer.main.get_command(cli_app).commands)])
def test_help_at_80_columns_piped_shows_every_option_whole(name):
    command = typer.main.get_command(cli_app)
    if name:
        command = command.commands[name]
    said = _help_at_80_columns(*filter(None, [name]))
    assert "…" not in said and "\\b" not in said
    assert all(len(line) <= 80 for line in said.splitlines())
    for param in command.params:
        for opt in [*param.opts, *param.secondary_opts]:
            if opt.startswith("--"):
                assert re.search(rf"{opt}(?![\w-])", said), f"{opt} not whole in {name} --help"
    if name:  # the usage names the arguments as the help does
        usage = said.split("Usage:", 1)[1].splitlines()[0]
        labels = re.findall(r"[{\[](\w+)[}\]]", usage)
        assert all(label.isupper() for label in labels if label != "OPTIONS"), usage


def test_extract_help_groups_its_options_in_panels():
    said = _help_at_80_columns("extract")
    panels = re.findall(r"^╭─ (\w+) ─", said, re.M)
    assert panels == ["Arguments", "Options", "Input", "Server", "Run", "Store", "Output"]
    server = said.split("╭─ Server", 1)[1].split("╰", 1)[0]
    assert "--request-timeout" in server and "--dump-dir" in server
    assert "(pip install hsdump[ray])" in " ".join(said.replace("│", " ").split())


def test_shell_completion_completes_commands_and_choices():
    def complete(words):
        cword = str(len(words.split(" ")) - 1)
        env = {"_HSDUMP_COMPLETE": "complete_bash", "COMP_WORDS": words, "COMP_CWORD": cword}
        return runner.invoke(cli_app, [], prog_name="hsdump", env=env).output.split()

    assert complete("hsdump ext") == ["extract"]
    assert complete("hsdump extract --watcher ") == ["inotify", "poll", "watchfiles"]
    assert "--install-completion" in _help_at_80_columns()


def test_verify_store_and_stats_report_a_clean_store(model_dir, tmp_path):
    _extract(model_dir, tmp_path, _dataset(tmp_path / "d.jsonl", *_good(2)))
    verified = runner.invoke(cli_app, ["verify-store", str(tmp_path / "s.zarr")])
    assert verified.exit_code == 0 and "2 intact, 0 corrupted" in verified.output
    stats = runner.invoke(cli_app, ["stats", str(tmp_path / "s.zarr")])
    assert stats.exit_code == 0 and "final" in stats.output and "non-finite" in stats.output


def test_verify_store_on_a_missing_store_is_a_one_line_error(tmp_path):
    result = runner.invoke(cli_app, ["verify-store", str(tmp_path / "none.zarr")])
    assert result.exit_code == 2 and result.output.startswith("error:")


def test_serve_reference_rejects_malformed_layer_ids(tmp_path):
    result = runner.invoke(
        cli_app, ["serve-reference", "--layer-ids", "2,x", "--dump-dir", str(tmp_path)]
    )
    assert result.exit_code == 2 and "--layer-ids" in result.output


def test_version_and_short_help():
    version = runner.invoke(cli_app, ["--version"])
    assert version.exit_code == 0 and version.output.strip() == f"hsdump {__version__}"
    for command in ([], ["extract"]):
        short, long = (runner.invoke(cli_app, [*command, flag]) for flag in ("-h", "--help"))
        assert short.exit_code == 0 and "Usage: hsdump" in short.output
        assert short.output == long.output


def test_a_rerun_of_a_complete_store_starts_no_server(model_dir, tmp_path):
    dataset = _dataset(tmp_path / "d.jsonl", *_good(2))
    assert _extract(model_dir, tmp_path, dataset).exit_code == 0
    result = _extract(model_dir, tmp_path, dataset)
    assert result.exit_code == 0 and "nothing to extract" in result.output
    assert "starting the reference server" not in result.output and _ids(tmp_path) == ["s0", "s1"]


def test_fail_fast_says_it_stopped_at_the_first_failure(fake, tmp_path):
    s0 = _good(1)[0]["input_ids"]
    fake.engine.fault_for = lambda rid, ids: Fault("http_400") if ids == s0 else None
    dataset = _dataset(tmp_path / "d.jsonl", *_good(3))
    result = _extract_from(fake, tmp_path, dataset, "--fail-fast")
    assert result.exit_code == 1 and "stopped at the first failure:" in result.output
    assert "interrupted" not in result.output


def _progress(output):
    return [x for x in output.splitlines() if x.startswith("progress: ")]


def test_progress_lines_where_stderr_is_not_a_terminal(fake, tmp_path):
    dataset = _dataset(tmp_path / "d.jsonl", *_good(3))
    every_sample = _extract_from(fake, tmp_path, dataset, "--log-every", "0")
    lines = _progress(every_sample.output)
    done = [int(x.split(" samples")[0].removeprefix("progress: ").split("/")[0]) for x in lines]
    # A line at the start, after each sample and after the last commit, counting the samples
    # whose commit is on disk.
    assert len(lines) == 5 and done == sorted(done) and done[0] == 0 and done[-1] == 3
    pattern = r"\(\d+%\), [\d,]+ tokens/s, [\d,.]+ MB/s, elapsed [\d:]+, ETA [\d:-]+, no failures$"
    assert all(re.search(pattern, x) for x in lines), lines
    assert lines[0].startswith("progress: 0/3 samples (0%)")
    assert lines[-1].startswith("progress: 3/3 samples (100%)")


def test_progress_in_a_log_comes_at_each_tenth_and_at_the_end(fake, tmp_path, monkeypatch):
    monkeypatch.setenv("HSDUMP_COMMIT_INTERVAL_S", "0")  # a commit at each shard of 64 tokens
    dataset = _dataset(tmp_path / "d.jsonl", *_good(20))
    lines = _progress(_extract_from(fake, tmp_path, dataset, "--shard-tokens", "64").output)
    percents = [int(re.search(r"\((\d+)%\)", x)[1]) for x in lines]  # 30 s apart: none came
    assert percents[0] == 0 and percents[-1] == 100 and len(lines) > 3, lines
    tenths = [p // 10 for p in percents]
    assert tenths == sorted(set(tenths)), lines  # one line per tenth passed, no repeats


def test_a_rerun_says_it_resumes_and_how_much_is_stored(fake, tmp_path):
    _extract_from(fake, tmp_path, _dataset(tmp_path / "d.jsonl", *_good(2)))
    result = _extract_from(fake, tmp_path, _dataset(tmp_path / "d.jsonl", *_good(5)))
    assert result.exit_code == 0, result.output
    assert "resuming: 2 of 5 samples already stored" in result.output.splitlines()


def test_the_summary_leads_with_counts_and_counts_failures_by_kind(fake, tmp_path):
    s0 = _good(1)[0]["input_ids"]
    fake.engine.fault_for = lambda rid, ids: Fault("error_marker") if ids == s0 else None
    dataset = _dataset(tmp_path / "d.jsonl", *_good(3), "{oops", "nope")
    result = _extract_from(fake, tmp_path, dataset, "--retries", "0")
    assert result.exit_code == 1, result.output
    summary = result.output.split("progress: ")[-1].splitlines()[1:]
    assert (
        summary[0].startswith("done: 2 samples written, 0 skipped, ") and "tokens/s" in summary[0]
    )
    assert re.match(r"stored [\d.]+ MB, [\d.]+ MB raw \(compression [\d.]+x\)$", summary[1])
    failures = tmp_path / "s.zarr.failures.jsonl"
    assert summary[2] == f"1 samples failed, 2 dataset lines rejected: see {failures}"
    assert len(summary) == 3  # the stages only with -v
    verbose = _extract_from(fake, tmp_path, dataset, "--retries", "0", "-v")
    assert "stages (overlapping" in verbose.output and "worker process(es)" in verbose.output


def test_extract_json_prints_the_summary_as_one_object_on_stdout(fake, tmp_path):
    dataset = _dataset(tmp_path / "d.jsonl", *_good(2), "{oops")
    result = _extract_from(fake, tmp_path, dataset, "--json")
    assert result.exit_code == 1, result.output
    summary = json.loads(result.stdout)
    assert summary["state"] == "done" and summary["samples_written"] == 2
    assert (summary["samples_failed"], summary["lines_rejected"]) == (0, 1)
    assert summary["failures_file"] == str(tmp_path / "s.zarr.failures.jsonl")
    assert summary["tokens"] == 2 + 7 and summary["bytes_stored"] > 0
    assert "samples written" not in result.stderr  # the JSON replaces the printed summary


def test_verify_store_json_prints_the_report_on_stdout(fake, tmp_path):
    _extract_from(fake, tmp_path, _dataset(tmp_path / "d.jsonl", *_good(2)))
    result = runner.invoke(cli_app, ["verify-store", str(tmp_path / "s.zarr"), "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert (report["checked"], report["ok"], report["corrupted"], report["duplicates"]) == (
        2, 2, [], [],
    )  # fmt: skip


def test_a_rerun_with_only_bad_lines_left_starts_no_server(model_dir, tmp_path):
    dataset = _dataset(tmp_path / "d.jsonl", *_good(2), {"id": "far", "input_ids": [1, 256]})
    assert _extract(model_dir, tmp_path, dataset).exit_code == 1
    result = _extract(model_dir, tmp_path, dataset)
    assert result.exit_code == 1, result.output
    assert "starting the reference server" not in result.output and "progress:" not in result.output
    failures = tmp_path / "s.zarr.failures.jsonl"
    said = result.output.replace("\n", " ")
    assert "d.jsonl:3: token id 256 at position 1 is outside" in said
    assert f"nothing left to extract: {tmp_path / 's.zarr'} holds all 2 samples" in said
    assert f"1 dataset lines rejected: see {failures}" in said
    (record,) = [json.loads(x) for x in failures.read_text().splitlines()]
    assert (record["id"], record["line"], record["attempts"]) == ("far", 3, 0)
    summary = json.loads(_extract(model_dir, tmp_path, dataset, "--json").stdout)
    assert (summary["samples_written"], summary["samples_skipped"]) == (0, 2)
    assert (summary["lines_rejected"], summary["failures_file"]) == (1, str(failures))


def test_verbose_logs_samples_but_not_each_http_request(fake, tmp_path, caplog):
    with caplog.at_level(logging.INFO):
        result = _extract_from(fake, tmp_path, _dataset(tmp_path / "d.jsonl", *_good(2)), "-v")
    assert result.exit_code == 0
    names = {record.name for record in caplog.records}
    assert any(r.getMessage().startswith("wrote sample 's1'") for r in caplog.records)
    assert not {"httpx", "httpcore"} & names


def _many(n):
    return [{"id": f"m{i}", "input_ids": [1 + i % 200, 2, 3]} for i in range(n)]


class _Run:
    """``hsdump extract`` with the embedded server in a process of its own."""

    def __init__(self, model_dir, tmp_path, name, samples=400):
        dataset = _dataset(tmp_path / f"{name}.jsonl", *_many(samples))
        self.store = tmp_path / f"{name}.zarr"
        command = [sys.executable, "-m", "hsdump", "extract"]
        args = [str(dataset), "--out", str(self.store), "--model", str(model_dir)]
        self.process = subprocess.Popen(
            [*command, *args, "--log-every", "3600"], stderr=subprocess.PIPE, text=True
        )
        self.seen: list[str] = []

    def begun(self):
        """Wait until the client is open and the run has begun; returns the temporary root."""
        started = self.wait_for("starting the reference server")
        self.root = Path(re.search(r"dumping into (\S+)\)", started)[1])
        self.wait_for("progress: 0/")
        return self

    def wait_for(self, prefix):
        assert self.process.stderr is not None
        for line in self.process.stderr:
            self.seen.append(line)
            if line.startswith(prefix):
                return line
        raise AssertionError(f"no line {prefix!r} in {''.join(self.seen)}")

    def finish(self):
        _, rest = self.process.communicate(timeout=60)
        return "".join(self.seen) + rest


@pytest.mark.slow
def test_sigterm_stops_like_ctrl_c_and_a_killed_runs_root_goes_with_the_next_run(
    model_dir, tmp_path
):
    running, killed = _Run(model_dir, tmp_path, "a"), _Run(model_dir, tmp_path, "b")
    running.begun(), killed.begun()
    killed.process.kill()
    killed.finish()
    assert killed.root.is_dir()  # kill -9 leaves it: nothing in the run could remove it
    dataset = _dataset(tmp_path / "c.jsonl", *_good(1))
    args = ["extract", str(dataset), "--out", str(tmp_path / "c.zarr"), "--model", str(model_dir)]
    assert runner.invoke(cli_app, args).exit_code == 0
    assert not killed.root.exists() and running.root.is_dir()  # a live run's root is kept
    running.process.send_signal(signal.SIGTERM)
    output = running.finish()
    assert running.process.returncode == 143, output
    written = re.search(r"^interrupted: (\d+) samples written", output, re.M)
    assert written and not running.root.exists() and "Traceback" not in output
    with open_store(running.store, "r") as store:
        assert len(store) == int(written[1]) < 400  # what it says it wrote is committed


@pytest.mark.slow
def test_a_second_ctrl_c_during_the_cleanup_does_not_abort_it(model_dir, tmp_path):
    run = _Run(model_dir, tmp_path, "a").begun()
    run.process.send_signal(signal.SIGINT)
    run.wait_for("stopping: ")  # the first one is in hand: the store commit and cleanup follow
    run.process.send_signal(signal.SIGINT)
    output = run.finish()
    assert run.process.returncode == 130, output
    assert "still stopping: " in output and re.search(r"^interrupted: \d+ samples", output, re.M)
    assert "terminate called" not in output and "Traceback" not in output
    assert not run.root.exists()


@pytest.mark.slow
def test_ctrl_c_below_a_live_bar_stops_on_a_line_of_its_own_and_says_how_to_resume(
    model_dir, tmp_path
):
    dataset = _dataset(tmp_path / "d.jsonl", *_many(400))
    args = [str(dataset), "--out", str(tmp_path / "s.zarr"), "--model", str(model_dir)]
    env = {**os.environ, "FORCE_COLOR": "1", "COLUMNS": "150"}  # rich draws its live bar
    process = subprocess.Popen(
        [sys.executable, "-m", "hsdump", "extract", *args, "--workers", "1"],
        stderr=subprocess.PIPE,
        env=env,
    )
    assert process.stderr is not None
    seen = b""
    while b"/400 samples" not in seen:  # the bar counts the run's samples: it has begun
        chunk = os.read(process.stderr.fileno(), 65536)
        assert chunk, seen.decode()
        seen += chunk
    process.send_signal(signal.SIGINT)
    _, rest = process.communicate(timeout=60)
    said = (seen + rest).decode()
    assert process.returncode == 130, said
    assert "\nstopping: committing what is done" in said  # not glued onto the bar's line
    plain = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", said)
    kept = re.search(
        r"^rerun the same command to resume: the store keeps its (\d+) samples$", plain, re.M
    )
    assert kept and "Traceback" not in plain, plain
    with open_store(tmp_path / "s.zarr", "r") as store:
        assert len(store) == int(kept[1]) < 400


def test_stats_shows_the_stores_provenance_above_its_table(tmp_path):
    from store_crash_writer import make_sample

    hs = make_sample(0, layers=[1, 3, 5])
    t, k, h = hs.aux_hidden_states.shape
    hs.meta = DumpMeta(
        rid="r-s0", input_ids=hs.input_ids.tolist(), num_tokens=t, layer_ids=hs.layer_ids,
        final_norm="pre_norm", hidden_size=h, dtype="bfloat16", aux_shape=(t, k, h),
        final_shape=(t, h), producer=ProducerInfo(name="sglang-hsdump", version="0.3"),
        model_path="org/model",
    )  # fmt: skip
    with open_store(tmp_path / "s.zarr", "a") as store:
        store.write(hs)
    result = runner.invoke(cli_app, ["stats", str(tmp_path / "s.zarr")])
    assert result.exit_code == 0, result.output
    provenance = result.output.split("non-finite", 1)[0]  # printed above the table
    assert "model: org/model" in provenance and "producer: sglang-hsdump 0.3" in provenance
    assert "layer ids: 1, 3, 5 (transformers hidden_states[i])" in provenance
    assert "SGLang API layer ids: 0, 2, 4" in provenance
    assert "final state: pre-norm" in provenance


def test_stats_says_which_provenance_a_hand_built_store_lacks(tmp_path):
    from store_crash_writer import make_sample

    with open_store(tmp_path / "s.zarr", "a") as store:
        store.write(make_sample(1, layers=[0, 2]))
    result = runner.invoke(cli_app, ["stats", str(tmp_path / "s.zarr")])
    assert result.exit_code == 0, result.output
    assert "model: unknown (not recorded)" in result.output
    assert "final state: unknown (not recorded)" in result.output
    sglang = "SGLang API layer ids: 1 (transformers' minus one; layer 0, the embeddings, has none)"
    assert sglang in result.output


def test_extract_waits_for_dumps_with_the_watcher_named_by_the_flag(
    model_dir, tmp_path, monkeypatch
):
    async def unused(*args):
        raise AssertionError("the watcher of HSDUMP_WATCHER waited, not the one of --watcher")

    monkeypatch.setenv("HSDUMP_WATCHER", "poll")
    monkeypatch.setattr(PollingWatcher, "wait", unused)
    dataset = _dataset(tmp_path / "d.jsonl", *_good(2))
    result = _extract(model_dir, tmp_path, dataset, "--watcher", "watchfiles", "--workers", "1")
    assert result.exit_code == 0, result.output
    assert _ids(tmp_path) == ["s0", "s1"]


def test_a_malformed_setting_stops_extract_with_one_line_naming_it(fake, tmp_path, monkeypatch):
    monkeypatch.setenv("HSDUMP_DUMP_BUDGET_BYTES", "2GB")
    result = _extract_from(fake, tmp_path, _dataset(tmp_path / "d.jsonl", *_good(1)))
    assert result.exit_code == 2, result.output
    assert "error: HSDUMP_DUMP_BUDGET_BYTES is '2GB', expected a whole number of bytes" in (
        result.output
    )
    assert "Traceback" not in result.output


@pytest.mark.skipif(
    small_page_tmpfs("/dev/shm") is None, reason="/dev/shm here is not a tmpfs with 4 KB pages"
)
def test_a_dump_root_on_a_tmpfs_with_small_pages_is_warned_about_once_in_one_line(tmp_path):
    dataset = _dataset(tmp_path / "d.jsonl", *_good(2))
    with tempfile.TemporaryDirectory(dir="/dev/shm") as shm:
        with FakeServer(Path(shm) / "dumps", hidden_size=8) as server:
            first = _extract_from(server, tmp_path, dataset)
            again = _extract_from(server, tmp_path / "again", dataset)
    assert first.exit_code == 0 and again.exit_code == 0, first.output + again.output
    (line,) = [line for line in first.output.splitlines() if "4 KB pages" in line]
    assert f"the dump root {server.dump_dir} lies on the tmpfs /dev/shm" in line
    assert line.endswith("docs/sglang.md#put-the-dump-root-on-a-tmpfs-with-huge-pages shows")
    assert "4 KB pages" not in again.output  # another process, the same root: said already


def test_a_dump_root_off_tmpfs_gets_no_page_warning(fake, tmp_path):
    assert small_page_tmpfs(fake.dump_dir) is None  # the premise: tmp_path is not a tmpfs here
    result = _extract_from(fake, tmp_path, _dataset(tmp_path / "d.jsonl", *_good(1)))
    assert result.exit_code == 0 and "4 KB pages" not in result.output


def test_a_rerun_with_nothing_to_extract_removes_late_dumps_of_exited_runs_only(fake, tmp_path):
    """A dump published after its request timed out and its run exited is removed by the next
    run, even one that starts no client; a live client's dump is kept."""
    import anyio

    from hsdump import DumpTimeout, HiddenStateClient, Sample

    dataset = _dataset(tmp_path / "d.jsonl", *_good(2))
    published, dump = threading.Event(), fake.engine.dump

    def dump_and_tell(rid, ids, *fault):
        path = dump(rid, ids, *fault)
        if fault and fault[0].kind == "response_first":
            published.set()
        return path

    def extract(*extra):
        return _extract_from(fake, tmp_path, dataset, *extra)

    async def runs_beside_a_live_client():
        async with HiddenStateClient(fake.url, dump_dir=fake.dump_dir, dump_timeout=0.1) as live:
            fake.inject(Fault("no_dump"))
            with pytest.raises(DumpTimeout):
                await live.extract(Sample("x", [1, 2, 3]))
            waited_for = fake.engine.dump(fake.received[-1].rid, [1, 2, 3])
            fake.engine.dump = dump_and_tell
            fake.inject(Fault(), Fault("response_first", delay=4.0))  # the run's probe, then s0
            first = await anyio.to_thread.run_sync(extract, "--dump-timeout", "1", "--retries", "1")
            assert first.exit_code == 0 and _ids(tmp_path) == ["s0", "s1"], first.output
            assert await anyio.to_thread.run_sync(published.wait, 30)
            dumps = [p for p in fake.dump_dir.iterdir() if p.name.startswith("req_")]
            (late,) = set(dumps) - {waited_for}  # s0's first try, left behind by its run
            rerun = await anyio.to_thread.run_sync(extract)
            assert rerun.exit_code == 0 and "nothing to extract" in rerun.output, rerun.output
            assert not late.exists() and waited_for.exists()

    anyio.run(runs_beside_a_live_client)


def test_a_run_without_shard_warns_while_another_run_writes_the_store(fake, tmp_path):
    """Two unsharded runs each extract every sample: the second one says so at its start."""
    lines = [{"id": f"t{i}", "input_ids": [1, 2, 3 + i]} for i in range(3)]
    runs = [_dataset(tmp_path / f"d{i}.jsonl", *lines[i : i + 1]) for i in range(3)]
    with open_store(tmp_path / "s.zarr", "a", writer_id="other"):  # another run, mid-way
        unsharded = _extract_from(fake, tmp_path, runs[0], "--writer-id", "mine")
        sharded = _extract_from(fake, tmp_path, runs[1], "--shard", "0/1")
    alone = _extract_from(fake, tmp_path, runs[2], "--writer-id", "mine")
    assert [unsharded.exit_code, sharded.exit_code, alone.exit_code] == [0, 0, 0]
    said = " ".join(unsharded.output.split())
    store = tmp_path / "s.zarr"
    assert f"another run is writing {store} now (live writers hold part-other)" in said
    assert "--shard I/N" in said
    assert "another run" not in sharded.output and "another run" not in alone.output
