"""The reference server: SGLang's conventions on a real transformers model, over real HTTP."""

from __future__ import annotations

import uuid
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch

from hsdump._client.loading import read_dump
from hsdump._exceptions import ConfigError
from hsdump._protocol import read_manifests, request_dir
from hsdump._servers.reference import ReferenceServer, build_default_model, default_layer_ids

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


def _bf16(bits: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.array(bits)).view(torch.bfloat16).float()


def _dumps(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir() if p.name.startswith("req_"))


def test_dump_holds_hidden_states_of_the_requested_layers_and_the_post_norm_final(model, server):
    ids = [5, 17, 300, 42, 8, 99, 1, 0, 511]
    rid = f"hsdump-{uuid.uuid4().hex}"
    assert _generate(server, ids, rid).json()["meta_info"]["id"] == rid
    dump = read_dump(request_dir(server.dump_dir, rid))
    with torch.no_grad():
        expected = model(torch.tensor([ids]), output_hidden_states=True).hidden_states
    assert dump.meta.input_ids == ids and dump.meta.final_norm == "post_norm"
    for k, layer in enumerate(server.layer_ids):
        torch.testing.assert_close(_bf16(dump.aux[:, k]), expected[layer][0], atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(_bf16(dump.final), expected[-1][0], atol=1e-2, rtol=1e-2)


def test_each_aux_layer_differs_from_its_neighbours_beyond_bf16_rounding(model, server):
    ids = list(range(1, 40))
    rid = f"hsdump-{uuid.uuid4().hex}"
    _generate(server, ids, rid)
    aux = _bf16(read_dump(request_dir(server.dump_dir, rid)).aux)
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
        (manifest,) = read_manifests(tmp_path)
        assert manifest.layer_ids == [0, 3] and manifest.final_norm == "post_norm"
        assert manifest.hidden_size == 64 and manifest.dtype == "bfloat16"
    assert list((tmp_path / "_producers").iterdir()) == []


@pytest.mark.parametrize(("layers", "expected"), [(8, [2, 4, 5]), (32, [2, 16, 29]), (4, [1, 2])])
def test_default_layers_follow_sglang_eagle3_convention(layers, expected):
    assert default_layer_ids(layers) == expected


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
    assert torch.equal(_bf16(dump.final), final.to(torch.bfloat16).float())


def test_a_directory_without_a_model_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="cannot load a causal LM"):
        ReferenceServer(tmp_path, dump_dir=tmp_path / "d", device="cpu")


def test_the_built_in_model_is_the_same_for_the_same_seed():
    first, second = (build_default_model(seed=3, **TINY) for _ in range(2))
    pairs = zip(first.parameters(), second.parameters(), strict=True)
    assert all(torch.equal(a, b) for a, b in pairs)
