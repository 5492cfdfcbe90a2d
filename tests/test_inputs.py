"""Reading a JSONL dataset: valid lines become samples, each bad line an error naming it."""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path

import pytest

from hsdump._exceptions import ConfigError, InputError
from hsdump._run.inputs import InputLimits, load_tokenizer, read_dataset
from hsdump._servers.reference import DEFAULT_CONFIG

LIMITS = InputLimits(vocab_size=100, max_tokens=8)


def _write(path: Path, *lines: object) -> Path:
    path.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines))
    return path


def test_valid_lines_become_samples_in_file_order_with_their_line_numbers(tmp_path):
    path = _write(
        tmp_path / "d.jsonl", {"id": "b", "input_ids": [1, 2]}, "", {"id": 7, "input_ids": [3]}
    )
    dataset = read_dataset(path, limits=LIMITS)
    assert [s.id for s in dataset.samples] == ["b", "7"] and dataset.bad_lines == []
    assert dataset.line_numbers == {"b": 1, "7": 3} and dataset.num_tokens == 3


def test_loss_mask_is_kept_with_its_sample(tmp_path):
    path = _write(tmp_path / "d.jsonl", {"id": "a", "input_ids": [1, 2], "loss_mask": [0, 1]})
    assert read_dataset(path).samples[0].loss_mask == [0, 1]


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
def test_a_bad_line_is_reported_with_its_number_and_reason_and_the_rest_is_read(
    tmp_path, line, reason
):
    path = _write(
        tmp_path / "d.jsonl", {"id": "ok1", "input_ids": [1]}, line, {"id": "ok2", "input_ids": [2]}
    )
    dataset = read_dataset(path, limits=LIMITS)
    assert [s.id for s in dataset.samples] == ["ok1", "ok2"]
    (bad,) = dataset.bad_lines
    assert bad.line == 2 and f"{path}:2:" in str(bad.error) and reason in str(bad.error)
    assert str(bad.error).count("[sample") <= 1  # the reason's own context is not repeated


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
def test_a_loss_mask_of_anything_but_0_and_1_rejects_its_line_alone(tmp_path, mask, reason):
    path = _write(
        tmp_path / "d.jsonl",
        {"id": "ok1", "input_ids": [1, 2], "loss_mask": [0, 1]},
        {"id": "x", "input_ids": [1, 2], "loss_mask": mask},
        {"id": "ok2", "input_ids": [1, 2]},
    )
    dataset = read_dataset(path)
    assert [s.id for s in dataset.samples] == ["ok1", "ok2"]
    (bad,) = dataset.bad_lines
    assert (bad.line, bad.sample_id) == (2, "x")
    assert f"{path}:2:" in str(bad.error) and reason in str(bad.error)


def test_a_byte_that_is_not_utf8_rejects_its_line_alone(tmp_path):
    path = tmp_path / "d.jsonl"
    good = [json.dumps({"id": f"ok{i}", "input_ids": [i]}).encode() for i in range(4)]
    path.write_bytes(b"\n".join([*good[:2], b'{"id": "x\xff", "input_ids": [1]}', *good[2:]]))
    dataset = read_dataset(path)
    assert [s.id for s in dataset.samples] == ["ok0", "ok1", "ok2", "ok3"]
    (bad,) = dataset.bad_lines
    assert bad.line == 3 and f"{path}:3: not valid UTF-8 (byte 0xff at column 10)" in str(bad.error)


def test_json_nested_too_deeply_rejects_its_line_alone(tmp_path):
    deep = '{"id": "x", "input_ids": ' + "[" * 100_000 + "]" * 100_000 + "}"
    path = _write(tmp_path / "d.jsonl", {"id": "ok1", "input_ids": [1]}, deep)
    dataset = read_dataset(path)
    assert [s.id for s in dataset.samples] == ["ok1"]
    (bad,) = dataset.bad_lines
    assert bad.line == 2 and f"{path}:2: JSON nested too deeply" in str(bad.error)


def test_a_duplicate_id_is_rejected_naming_the_first_line(tmp_path):
    path = _write(
        tmp_path / "d.jsonl", {"id": "a", "input_ids": [1]}, {"id": "a", "input_ids": [2]}
    )
    dataset = read_dataset(path)
    assert [s.input_ids for s in dataset.samples] == [[1]]
    (bad,) = dataset.bad_lines
    assert (bad.line, bad.sample_id) == (2, "a") and "first on line 1" in str(bad.error)


def test_a_bad_line_names_its_sample_id_when_it_has_one(tmp_path):
    path = _write(tmp_path / "d.jsonl", {"id": "s9", "input_ids": [500]})
    assert read_dataset(path, limits=LIMITS).bad_lines[0].error.sample_id == "s9"


def test_a_missing_dataset_file_is_an_input_error(tmp_path):
    with pytest.raises(InputError, match="cannot read the dataset"):
        read_dataset(tmp_path / "missing.jsonl")


def test_limits_come_from_the_server_info_fields():
    limits = InputLimits.from_server_info({"vocab_size": 50, "max_req_input_len": 10})
    assert limits == InputLimits(vocab_size=50, max_tokens=10)
    assert InputLimits.from_server_info({}) == InputLimits()


def test_sglang_limits_come_from_its_scheduler_and_the_local_model_config(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"text_config": {"vocab_size": 163840}}))
    info = {"model_path": str(tmp_path), "internal_states": [{"max_req_input_len": 131072}]}
    assert InputLimits.from_server_info(info) == InputLimits(163840, 131072)


def test_a_remote_model_path_leaves_the_vocabulary_unchecked():
    info = {"model_path": "moonshotai/Kimi-K2.5", "context_length": 4096}
    assert InputLimits.from_server_info(info) == InputLimits(None, 4096)


def test_the_bundled_dataset_is_valid_for_the_built_in_model():
    data = resources.files("hsdump") / "data" / "sample.jsonl"
    with resources.as_file(data) as path:
        limits = InputLimits(
            DEFAULT_CONFIG["vocab_size"], DEFAULT_CONFIG["max_position_embeddings"]
        )
        dataset = read_dataset(path, limits=limits)
    lengths = [len(s.input_ids) for s in dataset.samples]
    assert dataset.bad_lines == [] and len(lengths) >= 24
    assert min(lengths) >= 16 and max(lengths) <= 400 and len(set(lengths)) > 20


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["<unk>", "<s>", "hello", "world", "user", "assistant", ":", "hi"]
    core = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, unk_token="<unk>", bos_token="<s>")
    tokenizer.chat_template = "{% for m in messages %}{{ m.role }} : {{ m.content }} {% endfor %}"
    directory = tmp_path_factory.mktemp("tokenizer")
    tokenizer.save_pretrained(directory)
    return directory


def test_text_and_chat_messages_are_tokenized_with_a_local_tokenizer(tmp_path, tokenizer_dir):
    chat = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello world"}]
    path = _write(
        tmp_path / "d.jsonl", {"id": "t", "text": "hello world"}, {"id": "m", "messages": chat}
    )
    dataset = read_dataset(path, tokenizer=load_tokenizer(tokenizer_dir))
    by_id = {s.id: list(s.input_ids) for s in dataset.samples}
    assert by_id["t"][-2:] == [2, 3] and by_id["m"] == [4, 6, 7, 5, 6, 2, 3]


def test_a_directory_without_a_tokenizer_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="cannot load a tokenizer"):
        load_tokenizer(tmp_path)
