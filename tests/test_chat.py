"""Chat lines (``"messages"`` with ``--tokenizer``) are stored with an assistant-only loss mask
from the chat template, token by token; a template hsdump cannot read refuses its line; and
``hsdump stats`` shows the masked fraction."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from hsdump import open_store
from hsdump.testing import FakeServer, cli_app

runner = CliRunner()

SPECIAL = [
    "<|im_start|>", "<|im_end|>",
    "<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>",
    "<|im_system|>", "<|im_user|>", "<|im_assistant|>", "<|im_middle|>",
]  # fmt: skip
WORDS = ["<unk>", *SPECIAL, "system", "user", "assistant", "be", "kind", "hi", "hello", "bye", ":"]

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n"
    "{% if m.role == 'assistant' %}{% generation %}{{ m.content }}<|im_end|>{% endgeneration %}"
    "{% else %}{{ m.content }}<|im_end|>{% endif %}\n{% endfor %}"
)
CHATML_PLAIN = CHATML.replace("{% generation %}", "").replace("{% endgeneration %}", "")
LLAMA3 = (
    "{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m.role }}<|end_header_id|>\n\n"
    "{{ m.content }}<|eot_id|>{% endfor %}"
)
KIMI = (
    "{% for m in messages %}<|im_{{ m.role }}|>{{ m.role }}<|im_middle|>{{ m.content }}<|im_end|>"
    "{% endfor %}"
)
UNKNOWN = "{% for m in messages %}{{ m.role }} : {{ m.content }} {% endfor %}"
OTHER_MARKED = (
    "{% for m in messages %}{{ m.role }} : {% if m.role == 'assistant' %}{% generation %}"
    "{{ m.content }}{% endgeneration %}{% else %}{{ m.content }}{% endif %} {% endfor %}"
)

CHAT = [
    {"role": "system", "content": "be kind"},
    {"role": "user", "content": "hi"},
    {"role": "assistant", "content": "hello hello"},
    {"role": "user", "content": "bye"},
    {"role": "assistant", "content": "bye"},
]


def _tokenizer(directory: Path, template: str) -> Path:
    """A word-level tokenizer over `WORDS` with ``template``, saved as a tokenizer directory."""
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    core.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL])
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core, unk_token="<unk>", bos_token="<|begin_of_text|>"
    )
    tokenizer.chat_template = template
    tokenizer.save_pretrained(directory)
    return directory


def _extract(tmp_path: Path, template: str, *lines: dict[str, Any]) -> tuple[Any, Path]:
    """``hsdump extract --tokenizer`` of ``lines`` from a fake server; the result and the store."""
    tokenizer = _tokenizer(tmp_path / "tokenizer", template)
    dataset = tmp_path / "d.jsonl"
    dataset.write_text("".join(json.dumps(line) + "\n" for line in lines))
    out = tmp_path / "s.zarr"
    with FakeServer(tmp_path / "dumps", hidden_size=8) as server:
        result = runner.invoke(cli_app, [
            "extract", str(dataset), "--out", str(out), "--tokenizer", str(tokenizer),
            "--server-url", server.url, "--dump-dir", str(server.dump_dir),
            "--workers", "1", "--retries", "0",
        ])  # fmt: skip
    return result, out


def _stored(out: Path) -> dict[str, tuple[list[str], list[int] | None]]:
    """Each stored sample's tokens (as words) and loss mask."""
    with open_store(out, "r") as store:
        samples = {sid: store[sid] for sid in store}
        return {
            sid: (
                [WORDS[i] for i in hs.input_ids.tolist()],
                None if hs.loss_mask is None else hs.loss_mask.tolist(),
            )
            for sid, hs in samples.items()
        }


def _failures(out: Path) -> list[dict[str, Any]]:
    path = out.with_name(f"{out.name}.failures.jsonl")
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


# Each token of CHAT as the template renders it, with 1 where the assistant speaks.
CHATML_MASKED = [
    ("<|im_start|>", 0), ("system", 0), ("be", 0), ("kind", 0), ("<|im_end|>", 0),
    ("<|im_start|>", 0), ("user", 0), ("hi", 0), ("<|im_end|>", 0),
    ("<|im_start|>", 0), ("assistant", 0), ("hello", 1), ("hello", 1), ("<|im_end|>", 1),
    ("<|im_start|>", 0), ("user", 0), ("bye", 0), ("<|im_end|>", 0),
    ("<|im_start|>", 0), ("assistant", 0), ("bye", 1), ("<|im_end|>", 1),
]  # fmt: skip
LLAMA3_MASKED = [
    ("<|begin_of_text|>", 0),
    ("<|start_header_id|>", 0), ("system", 0), ("<|end_header_id|>", 0),
    ("be", 0), ("kind", 0), ("<|eot_id|>", 0),
    ("<|start_header_id|>", 0), ("user", 0), ("<|end_header_id|>", 0), ("hi", 0), ("<|eot_id|>", 0),
    ("<|start_header_id|>", 0), ("assistant", 0), ("<|end_header_id|>", 0),
    ("hello", 1), ("hello", 1), ("<|eot_id|>", 1),
    ("<|start_header_id|>", 0), ("user", 0), ("<|end_header_id|>", 0),
    ("bye", 0), ("<|eot_id|>", 0),
    ("<|start_header_id|>", 0), ("assistant", 0), ("<|end_header_id|>", 0),
    ("bye", 1), ("<|eot_id|>", 1),
]  # fmt: skip
KIMI_MASKED = [
    ("<|im_system|>", 0), ("system", 0), ("<|im_middle|>", 0), ("be", 0), ("kind", 0),
    ("<|im_end|>", 0), ("<|im_user|>", 0), ("user", 0), ("<|im_middle|>", 0), ("hi", 0),
    ("<|im_end|>", 0), ("<|im_assistant|>", 0), ("assistant", 0), ("<|im_middle|>", 0),
    ("hello", 1), ("hello", 1), ("<|im_end|>", 1),
    ("<|im_user|>", 0), ("user", 0), ("<|im_middle|>", 0), ("bye", 0), ("<|im_end|>", 0),
    ("<|im_assistant|>", 0), ("assistant", 0), ("<|im_middle|>", 0), ("bye", 1), ("<|im_end|>", 1),
]  # fmt: skip
OTHER_MARKED_MASKED = [
    ("system", 0), (":", 0), ("be", 0), ("kind", 0), ("user", 0), (":", 0), ("hi", 0),
    ("assistant", 0), (":", 0), ("hello", 1), ("hello", 1), ("user", 0), (":", 0), ("bye", 0),
    ("assistant", 0), (":", 0), ("bye", 1),
]  # fmt: skip


@pytest.mark.parametrize(
    ("template", "expected"),
    [
        (CHATML, CHATML_MASKED),
        (CHATML_PLAIN, CHATML_MASKED),
        (LLAMA3, LLAMA3_MASKED),
        (KIMI, KIMI_MASKED),
        (OTHER_MARKED, OTHER_MARKED_MASKED),
    ],
    ids=["chatml-generation", "chatml-rule", "llama3-rule", "kimi-rule", "other-generation"],
)
def test_a_chat_is_stored_with_a_mask_of_1_on_the_assistants_tokens_only(
    tmp_path, template, expected
):
    result, out = _extract(tmp_path, template, {"id": "c", "messages": CHAT})
    assert result.exit_code == 0, result.output
    tokens, mask = _stored(out)["c"]
    assert list(zip(tokens, mask or [], strict=True)) == expected


def test_a_template_of_no_known_family_refuses_its_line_and_the_others_are_stored(tmp_path):
    lines = ({"id": "t", "text": "hi hello"}, {"id": "c", "messages": CHAT})
    result, out = _extract(tmp_path, UNKNOWN, *lines, {"id": "i", "input_ids": [1]})
    assert result.exit_code == 1
    (failure,) = _failures(out)
    assert (failure["id"], failure["line"], failure["error"]) == ("c", 2, "InputError")
    assert f"{tmp_path / 'd.jsonl'}:2: cannot tell the assistant's tokens" in failure["message"]
    assert "{% generation %}" in failure["message"] and "d.jsonl:2:" in result.output
    # A text line is plain text: stored without a mask, which reads back as all ones.
    assert _stored(out) == {"t": (["hi", "hello"], None), "i": (["<|im_start|>"], None)}


@pytest.mark.parametrize(
    ("line", "reason"),
    [
        ({"id": "c", "messages": CHAT[:2]}, 'no "assistant" turn'),
        ({"id": "c", "messages": CHAT, "loss_mask": [1] * 22}, 'has "messages" and "loss_mask"'),
        ({"id": "c", "messages": "hi"}, '"messages" must be a list'),
        ({"id": "c", "messages": []}, 'no "assistant" turn'),
    ],
)
def test_a_chat_without_a_mask_to_give_is_refused_with_its_line(tmp_path, line, reason):
    result, out = _extract(tmp_path, CHATML, {"id": "ok", "input_ids": [2]}, line)
    assert result.exit_code == 1 and list(_stored(out)) == ["ok"]
    (failure,) = _failures(out)
    assert failure["line"] == 2 and reason in failure["message"]


def test_a_template_that_renders_turns_off_its_familys_rule_is_refused(tmp_path):
    template = CHATML_PLAIN.replace("<|im_start|>{{ m.role }}\n", "<|im_start|>{{ m.role }} ")
    result, out = _extract(tmp_path, template, {"id": "c", "messages": CHAT})
    assert result.exit_code == 1 and _stored(out) == {}
    (failure,) = _failures(out)
    assert "the ChatML rule found 0 assistant turns in the rendered chat" in failure["message"]


def test_stats_shows_the_masked_fraction_of_the_tokens(tmp_path):
    lines = ({"id": "c", "messages": CHAT}, {"id": "t", "text": "hi hello"})
    result, out = _extract(tmp_path, CHATML, *lines)
    assert result.exit_code == 0, result.output
    shown = runner.invoke(cli_app, ["stats", str(out)])
    assert shown.exit_code == 0, shown.output
    trained = 5 + 2  # the chat's assistant tokens, and every token of the text line
    assert f"loss mask: {17 / 24:.1%} of the tokens masked (0: not trained on), 7 trained on" in (
        shown.output
    )
    as_json = runner.invoke(cli_app, ["stats", str(out), "--json"])
    summary = json.loads(as_json.stdout)
    assert as_json.exit_code == 0 and summary["store"] == str(out)
    assert (summary["samples"], summary["tokens"], summary["trained_tokens"]) == (2, 24, trained)
    assert summary["masked_fraction"] == pytest.approx(17 / 24)
    assert [layer["layer"] for layer in summary["layers"]][-1] == "final"
    assert summary["provenance"]["hidden_size"] == 8
