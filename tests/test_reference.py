"""The reference server: SGLang's conventions on a real transformers model, over real HTTP."""

from __future__ import annotations

import json
import uuid
from pathlib import Path

import httpx
import pytest
import torch

from hsdump import ConfigError, ReferenceServer
from hsdump.testing import build_default_model, read_dump, request_dir

TINY = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 512,
    "max_position_embeddings": 128,
}


@pytest.fixture(scope="module")
def model():
    return build_default_model(seed=1, **TINY)


@pytest.fixture
def server(model, tmp_path):
    with ReferenceServer(model, dump_dir=tmp_path / "dumps", device="cpu") as running:
        yield running


def _generate(server: ReferenceServer, ids: list[int], rid: str | None = None) -> httpx.Response:
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": 0}, "extra_key": "k"}
    if rid is not None:
        body["rid"] = rid
    return httpx.post(f"{server.url}/generate", json=body, timeout=30)


def _dumps(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir() if p.name.startswith("req_"))


def test_dump_holds_hidden_states_of_the_requested_layers_and_the_post_norm_final(model, server):
    ids = [5, 17, 300, 42, 8, 99, 1, 0, 511]
    rid = f"hsdump-{uuid.uuid4().hex}"
    assert _generate(server, ids, rid).json()["meta_info"]["id"] == rid
    dump = read_dump(request_dir(server.dump_dir, rid))
    with torch.no_grad():
        expected = model(torch.tensor([ids]), output_hidden_states=True).hidden_states
    assert dump.meta is not None and dump.meta.final_norm == "post_norm"
    assert dump.input_ids.tolist() == ids and dump.aux_hidden_states.dtype == torch.bfloat16
    for k, layer in enumerate(server.layer_ids):
        aux = dump.aux_hidden_states[:, k].float()
        torch.testing.assert_close(aux, expected[layer][0], atol=1e-2, rtol=1e-2)
    final = dump.final_hidden_state.float()
    torch.testing.assert_close(final, expected[-1][0], atol=1e-2, rtol=1e-2)


def test_a_pre_norm_server_dumps_the_final_norms_input(model, tmp_path):
    ids = [5, 17, 300, 42, 8, 99, 1, 0, 511]
    seen = []  # the input of the final norm, taken by a hook of the test's own
    hook = model.model.norm.register_forward_hook(lambda _m, args, _o: seen.append(args[0][0]))
    try:
        with torch.no_grad():
            post_norm = model(torch.tensor([ids]), output_hidden_states=True).hidden_states[-1][0]
    finally:
        hook.remove()
    rid = f"hsdump-{uuid.uuid4().hex}"
    dumps = tmp_path / "dumps"
    with ReferenceServer(model, dump_dir=dumps, device="cpu", final_norm="pre_norm") as server:
        assert _generate(server, ids, rid).status_code == 200
        manifest = json.loads(next((dumps / "_producers").glob("*.json")).read_text())
    dump = read_dump(request_dir(dumps, rid))
    assert dump.meta is not None and dump.meta.final_norm == manifest["final_norm"] == "pre_norm"
    final = dump.final_hidden_state.float()
    torch.testing.assert_close(final, seen[0], atol=1e-2, rtol=1e-2)
    assert not torch.allclose(final, post_norm, atol=1e-2, rtol=1e-2)


def test_the_built_in_models_final_norm_is_not_all_ones():
    weight = build_default_model(seed=1, **TINY).model.norm.weight.detach()
    assert not torch.all(weight == 1) and float(weight.min()) >= 0.5


def test_each_aux_layer_differs_from_its_neighbours_beyond_bf16_rounding(model, server):
    ids = list(range(1, 40))
    rid = f"hsdump-{uuid.uuid4().hex}"
    _generate(server, ids, rid)
    aux = read_dump(request_dir(server.dump_dir, rid)).aux_hidden_states.float()
    with torch.no_grad():
        states = model(torch.tensor([ids]), output_hidden_states=True).hidden_states
    for k, layer in enumerate(server.layer_ids):
        for other in {layer - 1, layer + 1} - {layer}:
            assert not torch.allclose(aux[:, k], states[other][0], atol=1e-2, rtol=1e-2)


@pytest.mark.parametrize("rid", [None, "HEALTH_CHECK_1234", "other-client-7", "hsdump-../../etc"])
def test_requests_that_did_not_opt_in_leave_no_dump(server, rid):
    response = _generate(server, [1, 2, 3], rid)
    assert response.status_code == 200
    assert _dumps(server.dump_dir) == []


def test_warmup_with_new_tokens_decodes_and_dumps_nothing(server):
    body = {"input_ids": [10, 11, 12], "sampling_params": {"max_new_tokens": 4}}
    response = httpx.post(f"{server.url}/generate", json=body, timeout=30).json()
    assert len(response["output_ids"]) == 4 and _dumps(server.dump_dir) == []


def test_token_id_outside_the_vocabulary_is_refused_with_400(server):
    response = _generate(server, [1, 512], f"hsdump-{uuid.uuid4().hex}")
    assert response.status_code == 400 and "vocabulary" in response.json()["error"]["message"]
    assert _dumps(server.dump_dir) == []


def test_prompt_longer_than_the_context_is_refused_with_400(server):
    response = _generate(server, [1] * 129, f"hsdump-{uuid.uuid4().hex}")
    assert response.status_code == 400 and "context length" in response.json()["error"]["message"]


def test_text_prompt_is_refused_because_the_server_has_no_tokenizer(server):
    response = httpx.post(f"{server.url}/generate", json={"text": "hello"}, timeout=30)
    assert response.status_code == 400 and "input_ids" in response.json()["error"]["message"]


def test_server_info_reports_the_settings_the_client_checks(server):
    info = httpx.get(f"{server.url}/get_server_info", timeout=30).json()
    assert info["disable_radix_cache"] is True and info["chunked_prefill_size"] == -1
    assert (info["vocab_size"], info["max_req_input_len"]) == (512, 128)
    assert info["hidden_size"] == TINY["hidden_size"]  # a client checks the manifest against these
    assert info["num_hidden_layers"] == TINY["num_hidden_layers"]
    assert info["model_path"] and info["version"]


def test_manifest_announces_the_producer_while_running_and_is_withdrawn_at_stop(model, tmp_path):
    with ReferenceServer(model, dump_dir=tmp_path, layer_ids=[0, 3], device="cpu"):
        (path,) = (tmp_path / "_producers").iterdir()
        manifest = json.loads(path.read_text())
        assert manifest["layer_ids"] == [0, 3] and manifest["final_norm"] == "post_norm"
        assert manifest["hidden_size"] == 64 and manifest["dtype"] == "bfloat16"
    assert list((tmp_path / "_producers").iterdir()) == []


@pytest.mark.parametrize(("layers", "expected"), [(8, [2, 4, 5]), (32, [2, 16, 29]), (4, [1, 2])])
def test_default_layers_follow_sglang_eagle3_convention(tmp_path, layers, expected):
    small = build_default_model(**{**TINY, "num_hidden_layers": layers})
    assert ReferenceServer(small, dump_dir=tmp_path, device="cpu").layer_ids == expected


@pytest.mark.parametrize("layer_ids", [[4], [-1], []])
def test_layer_ids_outside_the_model_are_a_config_error(model, tmp_path, layer_ids):
    with pytest.raises(ConfigError, match="hidden_states indices"):
        ReferenceServer(model, dump_dir=tmp_path, layer_ids=layer_ids, device="cpu")


def test_a_model_directory_serves_the_same_weights_as_the_model_saved_there(model, tmp_path):
    model.save_pretrained(tmp_path / "model")
    ids, rid = [3, 1, 4, 1, 5, 9, 2, 6], f"hsdump-{uuid.uuid4().hex}"
    with ReferenceServer(tmp_path / "model", dump_dir=tmp_path / "d", device="cpu") as loaded:
        _generate(loaded, ids, rid)
        dump = read_dump(request_dir(loaded.dump_dir, rid))
    with torch.no_grad():
        final = model(torch.tensor([ids]), output_hidden_states=True).hidden_states[-1][0]
    assert torch.equal(dump.final_hidden_state, final.to(torch.bfloat16))


def test_a_directory_without_a_model_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="cannot load a causal LM"):
        ReferenceServer(tmp_path, dump_dir=tmp_path / "d", device="cpu")


def test_a_server_given_no_model_serves_the_same_built_in_model_each_time(tmp_path):
    ids, dumps = [3, 1, 4, 1, 5, 9, 2, 6], []
    for run in ("a", "b"):
        with ReferenceServer(dump_dir=tmp_path / run, device="cpu") as built_in:
            rid = f"hsdump-{uuid.uuid4().hex}"
            assert _generate(built_in, ids, rid).status_code == 200
            dumps.append(read_dump(request_dir(built_in.dump_dir, rid)))
    first, second = dumps
    assert torch.equal(first.aux_hidden_states, second.aux_hidden_states)
    assert torch.equal(first.final_hidden_state, second.final_hidden_state)
