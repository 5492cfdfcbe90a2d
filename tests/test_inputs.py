"""The dataset ``hsdump extract`` reads: valid lines become samples, each bad line a failure naming
its line and reason, and the rest is extracted."""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path
from typing import Any, NamedTuple

import pytest
from typer.testing import CliRunner

from hsdump import open_store
from hsdump.testing import FakeServer, Fault, cli_app

LIMITS = {"vocab_size": 100, "max_req_input_len": 8}
runner = CliRunner()


class Extracted(NamedTuple):
    """What a run of ``hsdump extract`` left: its exit code and output, the stored samples (ids,
    mask) by id, and the failures file's records."""

    code: int
    output: str
    stored: dict[str, tuple[list[int], list[int] | None]]
    failures: list[dict[str, Any]]


@pytest.fixture
def server(tmp_path: Path):  # type: ignore[no-untyped-def]
    with FakeServer(tmp_path / "dumps", hidden_size=8, server_info=LIMITS) as running:
        yield running


def _write(path: Path, *lines: object) -> Path:
    path.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines))
    return path


def _extract(
    server: FakeServer | None, dataset: Path | str, *extra: str, out: Path | None = None
) -> Extracted:
    """``hsdump extract`` of ``dataset`` into ``out`` (beside the dataset when None), from
    ``server`` (the built-in reference server when None)."""
    out = out or Path(f"{dataset}.zarr")
    args = ["extract", str(dataset), "--out", str(out), "--workers", "1", "--retries", "0"]
    if server is not None:
        args += ["--server-url", server.url, "--dump-dir", str(server.dump_dir)]
    result = runner.invoke(cli_app, [*args, *extra])
    failures = out.with_name(f"{out.name}.failures.jsonl")
    records = (
        [json.loads(x) for x in failures.read_text().splitlines()] if failures.exists() else []
    )
    stored = {}
    if out.exists():
        with open_store(out, "r") as store:
            for sid in store:
                hs = store[sid]
                mask = None if hs.loss_mask is None else hs.loss_mask.tolist()
                stored[sid] = (hs.input_ids.tolist(), mask)
    return Extracted(result.exit_code, result.output, stored, records)


def _sent(server: FakeServer) -> list[list[int]]:
    """The token ids of the samples the server was sent, in order (the client's probe left out)."""
    return [r.input_ids for r in server.received if r.input_ids != [0]]


def test_valid_lines_become_samples_in_file_order_with_their_line_numbers(server, tmp_path):
    server.engine.fault_for = lambda rid, ids: Fault("http_400") if ids != [0] else None
    path = _write(
        tmp_path / "d.jsonl", {"id": "b", "input_ids": [1, 2]}, "", {"id": 7, "input_ids": [3]}
    )
    run = _extract(server, path)
    assert run.code == 1 and _sent(server) == [[1, 2], [3]]
    lines = {r["id"]: r["line"] for r in run.failures}
    assert lines == {"b": 1, "7": 3} and {r["error"] for r in run.failures} == {
        "ServerResponseError"
    }


def test_loss_mask_is_kept_with_its_sample(server, tmp_path):
    path = _write(tmp_path / "d.jsonl", {"id": "a", "input_ids": [1, 2], "loss_mask": [0, 1]})
    run = _extract(server, path)
    assert run.code == 0 and run.stored == {"a": ([1, 2], [0, 1])}


def _one_bad_line(run: Extracted, path: Path, number: int, reason: str) -> dict[str, Any]:
    """The run stored the good lines, and failed the bad one alone, naming it."""
    (record,) = run.failures
    assert run.code == 1 and run.output.count("bad line") == 1
    assert (record["line"], record["error"], record["attempts"]) == (number, "InputError", 0)
    assert f"{path}:{number}:" in record["message"] and reason in record["message"]
    return record


@pytest.mark.parametrize(
    ("line", "reason"),
    [
        ("{not json", "not valid JSON"),
        ("[1, 2]", "expected a JSON object"),
        ({"input_ids": [1]}, 'no "id"'),
        ({"id": "", "input_ids": [1]}, 'no "id"'),
        ({"id": "x", "input_ids": []}, "non-empty list"),
        ({"id": "x", "input_ids": [1, "2"]}, "'2'"),
        ({"id": "x", "input_ids": [1, 2.5]}, "2.5"),
        ({"id": "x", "input_ids": [1, -3]}, "-3"),
        ({"id": "x", "input_ids": [1, True]}, "True"),
        ({"id": "x", "input_ids": [1, 100]}, "outside the model's vocabulary"),
        ({"id": "x", "input_ids": [1] * 9}, "longer than the server's context of 8"),
        ({"id": "x", "input_ids": [1, 2], "loss_mask": [1]}, "loss_mask has 1 entries"),
        ({"id": "x"}, 'no "input_ids"'),
        ({"id": "x", "text": "hello"}, "--tokenizer"),
    ],
)
def test_a_bad_line_is_reported_with_its_number_and_reason_and_the_rest_is_extracted(
    server, tmp_path, line, reason
):
    path = _write(
        tmp_path / "d.jsonl", {"id": "ok1", "input_ids": [1]}, line, {"id": "ok2", "input_ids": [2]}
    )
    run = _extract(server, path)
    assert sorted(run.stored) == ["ok1", "ok2"]
    record = _one_bad_line(run, path, 2, reason)
    assert record["message"].count("[sample") <= 1  # the reason's own context is not repeated


@pytest.mark.parametrize(
    ("mask", "reason"),
    [
        ([0, 256], "holds 256 at position 1"),
        ([-1, 1], "holds -1 at position 0"),
        ([1, 2], "holds 2 at position 1"),
        ([0.5, 1], "holds 0.5 at position 0"),
        ([1.0, 1], "holds 1.0 at position 0"),
        ([1, "1"], "holds '1' at position 1"),
        ("01", "must be a list of 0/1"),
        ({"0": 1, "1": 1}, "must be a list of 0/1"),
        (1, "must be a list of 0/1"),
    ],
)
def test_a_loss_mask_of_anything_but_0_and_1_rejects_its_line_alone(server, tmp_path, mask, reason):
    path = _write(
        tmp_path / "d.jsonl",
        {"id": "ok1", "input_ids": [1, 2], "loss_mask": [0, 1]},
        {"id": "x", "input_ids": [1, 2], "loss_mask": mask},
        {"id": "ok2", "input_ids": [1, 2]},
    )
    run = _extract(server, path)
    assert run.stored == {"ok1": ([1, 2], [0, 1]), "ok2": ([1, 2], None)}
    assert _one_bad_line(run, path, 2, reason)["id"] == "x"


def test_a_byte_that_is_not_utf8_rejects_its_line_alone(server, tmp_path):
    path = tmp_path / "d.jsonl"
    good = [json.dumps({"id": f"ok{i}", "input_ids": [i + 1]}).encode() for i in range(4)]
    path.write_bytes(b"\n".join([*good[:2], b'{"id": "x\xff", "input_ids": [1]}', *good[2:]]))
    run = _extract(server, path)
    assert sorted(run.stored) == ["ok0", "ok1", "ok2", "ok3"]
    _one_bad_line(run, path, 3, "not valid UTF-8 (byte 0xff at column 10)")


def test_json_nested_too_deeply_rejects_its_line_alone(server, tmp_path):
    deep = '{"id": "x", "input_ids": ' + "[" * 100_000 + "]" * 100_000 + "}"
    path = _write(tmp_path / "d.jsonl", {"id": "ok1", "input_ids": [1]}, deep)
    run = _extract(server, path)
    assert sorted(run.stored) == ["ok1"]
    _one_bad_line(run, path, 2, "JSON nested too deeply")


def test_a_json_line_cut_short_is_reported_at_the_column_where_it_ends(server, tmp_path):
    cut = '{"id": "x", "input_ids": [1, 2, 3'  # 33 characters: column 34 is where a "," was due
    path = _write(tmp_path / "d.jsonl", {"id": "ok1", "input_ids": [1]}, cut)
    run = _extract(server, path)
    _one_bad_line(run, path, 2, "not valid JSON (Expecting ',' delimiter at column 34)")


def test_every_bad_line_is_printed_in_one_format(server, tmp_path):
    path = _write(
        tmp_path / "d.jsonl",
        {"id": "[b]x", "input_ids": [1]},
        {"id": "s2", "input_ids": [500]},  # a bad line with an id
        "{not json",  # one without
        {"id": "[b]x", "input_ids": [2]},
    )
    run = _extract(server, path)
    printed = [line for line in run.output.splitlines() if line.startswith("bad line")]
    assert [line.split(": ", 1)[0] for line in printed] == [
        f"bad line {path}:{number}" for number in (2, 3, 4)
    ]
    assert "duplicate id '[b]x'" in printed[2]  # printed as it is, not taken for markup


def test_a_duplicate_id_is_rejected_naming_the_first_line(server, tmp_path):
    path = _write(
        tmp_path / "d.jsonl", {"id": "a", "input_ids": [1]}, {"id": "a", "input_ids": [2]}
    )
    run = _extract(server, path)
    assert run.stored == {"a": ([1], None)}
    assert _one_bad_line(run, path, 2, "first on line 1")["id"] == "a"


def test_a_bad_line_names_its_sample_id_when_it_has_one(server, tmp_path):
    path = _write(tmp_path / "d.jsonl", {"id": "s9", "input_ids": [500]})
    run = _extract(server, path)
    assert _one_bad_line(run, path, 1, "vocabulary")["id"] == "s9" and run.stored == {}


def test_a_server_that_states_no_limits_leaves_the_lines_unchecked(tmp_path):
    path = _write(tmp_path / "d.jsonl", {"id": "big", "input_ids": [10**6] * 3000})
    with FakeServer(tmp_path / "dumps", hidden_size=8) as server:
        run = _extract(server, path)
    assert run.code == 0 and run.failures == [] and run.stored == {"big": ([10**6] * 3000, None)}


def test_sglang_limits_come_from_its_scheduler_and_the_local_model_config(tmp_path):
    (tmp_path / "model").mkdir()
    config = {"text_config": {"vocab_size": 50}}
    (tmp_path / "model" / "config.json").write_text(json.dumps(config))
    info = {"model_path": str(tmp_path / "model"), "internal_states": [{"max_req_input_len": 4}]}
    path = _write(
        tmp_path / "d.jsonl",
        {"id": "ok", "input_ids": [49, 49, 49, 49]},
        {"id": "far", "input_ids": [50]},
        {"id": "long", "input_ids": [1] * 5},
    )
    with FakeServer(tmp_path / "dumps", hidden_size=8, server_info=info) as server:
        run = _extract(server, path)
    assert sorted(run.stored) == ["ok"]
    reasons = {r["id"]: r["message"] for r in run.failures}
    assert "vocabulary" in reasons["far"] and "context of 4" in reasons["long"]


def test_a_remote_model_path_leaves_the_vocabulary_unchecked(tmp_path):
    info = {"model_path": "moonshotai/Kimi-K2.5", "context_length": 4}
    path = _write(
        tmp_path / "d.jsonl",
        {"id": "far", "input_ids": [163_839, 200_000]},
        {"id": "long", "input_ids": [1] * 5},
    )
    with FakeServer(tmp_path / "dumps", hidden_size=8, server_info=info) as server:
        run = _extract(server, path)
    assert sorted(run.stored) == ["far"]
    assert [(r["id"], "context of 4" in r["message"]) for r in run.failures] == [("long", True)]


@pytest.mark.slow
def test_the_bundled_dataset_is_extracted_whole_with_the_built_in_model(tmp_path):
    run = _extract(None, "bundled", out=tmp_path / "s.zarr")
    assert run.code == 0, run.output
    assert run.failures == [] and "bad line" not in run.output
    lengths = [len(ids) for ids, _ in run.stored.values()]
    data = resources.files("hsdump") / "data" / "sample.jsonl"
    assert len(lengths) == sum(1 for line in data.read_text().splitlines() if line.strip())
    assert len(lengths) >= 24 and min(lengths) >= 16 and max(lengths) <= 400
    assert len(set(lengths)) > 20


def test_a_directory_without_a_tokenizer_is_a_one_line_error(server, tmp_path):
    path = _write(tmp_path / "d.jsonl", {"id": "t", "text": "hello world"})
    run = _extract(server, path, "--tokenizer", str(tmp_path))
    assert run.code == 2 and "error: cannot load a tokenizer" in run.output
    assert "Traceback" not in run.output and run.stored == {}
