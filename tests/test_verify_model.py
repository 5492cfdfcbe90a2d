"""``hsdump verify STORE --against MODEL_DIR``: stored states recomputed with transformers."""

from __future__ import annotations

import re

import anyio
import pytest
import torch
from _models import TINY
from typer.testing import CliRunner

from hsdump import (
    DumpMeta,
    HiddenStateClient,
    HiddenStates,
    ProducerInfo,
    ReferenceServer,
    Sample,
    open_store,
    run_extraction,
)
from hsdump.testing import build_default_model, cli_app

runner = CliRunner()


def _samples() -> list[Sample]:
    gen = torch.Generator().manual_seed(0)
    return [
        Sample(f"s{i}", torch.randint(0, 512, (n,), generator=gen).tolist())
        for i, n in enumerate((5, 40, 90))
    ]


async def _extract(path, server) -> None:
    async with HiddenStateClient(server.url, dump_dir=server.dump_dir) as client:
        with open_store(path, "w") as store:
            summary = await run_extraction(_samples(), client=client, store=store)
    assert summary.ok


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("model")
    build_default_model(seed=11, **TINY).save_pretrained(path)
    return path


def _store_of(model, tmp_path_factory):
    root = tmp_path_factory.mktemp("store")
    with ReferenceServer(model, dump_dir=root / "dumps", device="cpu") as server:
        anyio.run(_extract, root / "s.zarr", server)
    return root / "s.zarr"


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    return _store_of(build_default_model(seed=11, **TINY), tmp_path_factory)


@pytest.fixture(scope="module")
def builtin_store(tmp_path_factory):
    """A store from the reference server's built-in model, as `hsdump extract` makes one."""
    return _store_of(None, tmp_path_factory)


@pytest.fixture(scope="module")
def other_store(tmp_path_factory):
    """The same architecture and tokens, other weights."""
    return _store_of(build_default_model(seed=12, **TINY), tmp_path_factory)


def _verify(store, model_dir, *extra):
    args = ["verify", str(store), "--against", str(model_dir), "--device", "cpu", *extra]
    return runner.invoke(cli_app, [*args, "--samples", "3"])


def _verdicts(output: str) -> dict[str, str]:
    rows = re.findall(r"(hidden_states\[\d+\]|final \(\w+\)).*?(pass|FAIL)", output)
    return dict(rows)


def test_states_the_model_produced_pass_on_every_layer(store, model_dir):
    result = _verify(store, model_dir)
    assert result.exit_code == 0, result.output
    with open_store(store, "r") as opened:
        layers = opened.provenance.layer_ids
    expected = [f"hidden_states[{i}]" for i in layers] + ["final (post_norm)"]
    assert _verdicts(result.output) == dict.fromkeys(expected, "pass")
    assert "pass: every layer matches the model (3 samples on cpu)" in result.output


def test_states_of_another_model_fail_naming_each_layer(other_store, model_dir):
    result = _verify(other_store, model_dir)
    assert result.exit_code == 1, result.output
    verdicts = _verdicts(result.output)
    assert verdicts and set(verdicts.values()) == {"FAIL"}
    failed = re.search(r"FAIL: (.*) differ from the model", result.output)
    assert failed is not None and failed.group(1).split(", ") == list(verdicts)


def _with_meta(hs: HiddenStates, prov: dict) -> HiddenStates:
    """A stored sample as a server would hand it over again, provenance and all."""
    t, k, h = hs.aux_hidden_states.shape
    hs.meta = DumpMeta(
        rid=f"copy-{hs.sample_id}", input_ids=hs.input_ids.tolist(), num_tokens=t,
        layer_ids=hs.layer_ids, final_norm=prov["final_norm"], hidden_size=h, dtype=prov["dtype"],
        aux_shape=(t, k, h), final_shape=(t, h), model_path=prov["model_path"],
        producer=ProducerInfo(name=prov["producer_name"], version=prov["producer_version"]),
    )  # fmt: skip
    return hs


def test_a_layer_whose_second_prefill_chunk_is_zero_fails_alone(store, model_dir, tmp_path):
    with open_store(store, "r") as good, open_store(tmp_path / "bad.zarr", "w") as bad:
        for sid in sorted(good):
            hs = good[sid]
            if hs.num_tokens > 64:  # a chunked prefill that kept only the first 64-token chunk
                hs.aux_hidden_states = hs.aux_hidden_states.clone()
                hs.aux_hidden_states[64:, 1] = 0
                broken, damaged = f"hidden_states[{hs.layer_ids[1]}]", sid
            bad.write(_with_meta(hs, hs.attrs["provenance"]))
    result = _verify(tmp_path / "bad.zarr", model_dir)
    assert result.exit_code == 1, result.output
    assert [name for name, v in _verdicts(result.output).items() if v == "FAIL"] == [broken]
    assert re.search(rf"{re.escape(broken)} .*FAIL.* {damaged} ", result.output)
    assert f"FAIL: {broken} differ from the model" in result.output


def test_a_missing_model_directory_is_exit_2_naming_it(store, tmp_path):
    missing = tmp_path / "no-model"
    result = _verify(store, missing)
    assert result.exit_code == 2, result.output
    text = result.output.replace("\n", "")
    assert text.startswith("error: cannot verify against") and str(missing) in text
    assert "no such directory" in text and "Traceback" not in text
    assert "or builtin for the reference server's built-in model" in text


def test_builtin_names_the_reference_servers_model(builtin_store, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # an empty directory: "builtin" is no path
    result = _verify(builtin_store, "builtin")
    assert result.exit_code == 0, result.output
    assert "loading the built-in model on cpu" in result.output
    assert set(_verdicts(result.output).values()) == {"pass"}


def test_builtin_against_a_store_of_another_model_fails(other_store):
    result = _verify(other_store, "builtin")
    assert result.exit_code == 2, result.output
    text = result.output.replace("\n", "")
    assert "the built-in model does not fit the store" in text
    assert "hidden size 64 stored, 256 in the model" in text


def test_a_model_of_another_hidden_size_is_exit_2(store, tmp_path):
    build_default_model(seed=11, **{**TINY, "hidden_size": 32}).save_pretrained(tmp_path)
    result = _verify(store, tmp_path)
    assert result.exit_code == 2, result.output
    assert "hidden size 64 stored, 32 in the model" in result.output.replace("\n", "")
