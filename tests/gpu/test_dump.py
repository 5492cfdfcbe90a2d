"""The server side alone on a GPU: opted-in /generate requests, their dumps read with the protocol
module, every layer compared with transformers; and the prefix-cache guard when radix is on."""

from __future__ import annotations

import random
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
from _gpu import GpuServer, LayerDiffs, reference_forward

# Warnings of the GPU machine's torch and transformers are reported, not failures: what these
# checks judge is the states.
pytestmark = [pytest.mark.gpu, pytest.mark.timeout(600), pytest.mark.filterwarnings("default")]

# Around and across the tiny model's 256-token chunks, sent eight at a time: several a batch.
LENGTHS = [1, 5, 255, 256, 257, 600, 1100, 40, 90, 130, 170, 210]


def generate(url: str, ids: list[int], rid: str, extra_key: str | None) -> dict[str, Any]:
    body: dict[str, Any] = {
        "rid": rid,
        "input_ids": ids,
        "sampling_params": {"max_new_tokens": 0, "temperature": 0},
    }
    if extra_key:
        body["extra_key"] = extra_key
    response = httpx.post(f"{url}/generate", json=body, timeout=120)
    response.raise_for_status()
    return response.json()


def wait_dump(root: Path, rid: str, timeout: float = 60) -> Path:
    from hsdump.testing import request_dir  # after the skip: hsdump is not imported on CPU

    path = request_dir(root, rid)
    deadline = time.monotonic() + timeout
    while not ((path / "done").exists() or (path / "error").exists()):
        if time.monotonic() > deadline:
            raise TimeoutError(f"no dump for {rid} in {root}")
        time.sleep(0.01)
    return path


@pytest.fixture(scope="module")
def probe(gpu_server: GpuServer, reference_model: Any) -> dict[str, Any]:
    """Send the prompts at once, read each dump and compare its layers with the reference."""
    from hsdump.testing import read_dump

    rng = random.Random(3)
    jobs = [
        ([rng.randrange(1024) for _ in range(n)], f"hsdump-probe-{i}-{uuid.uuid4().hex[:6]}")
        for i, n in enumerate(LENGTHS)
    ]
    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(lambda j: generate(gpu_server.url, *j, uuid.uuid4().hex), jobs))
    diffs, mismatched, layer_ids = LayerDiffs(), [], None
    for (ids, rid), answer in zip(jobs, answers, strict=True):
        dump = read_dump(wait_dump(gpu_server.dump_dir, rid))
        if dump.meta.input_ids != ids or answer["meta_info"]["id"] != rid:
            mismatched.append(rid)
        hidden, finals = reference_forward(reference_model, ids)
        layer_ids = dump.meta.layer_ids
        for k, lid in enumerate(layer_ids):
            diffs.add(f"hs[{lid}]", dump.aux_hidden_states[:, k], hidden[lid][0])
        diffs.add(
            f"final ({dump.meta.final_norm})",
            dump.final_hidden_state,
            finals[gpu_server.final_norm],
        )
    result = {"layer_ids": layer_ids, "per_layer": diffs.per_layer, "mismatched": mismatched}
    gpu_server.record("probe", result)
    return {**result, "far_off": diffs.far_off()}


def test_dumps_carry_their_requests_token_ids_and_rids(probe: dict[str, Any]) -> None:
    assert probe["mismatched"] == []


def test_every_dumped_layer_matches_transformers(probe: dict[str, Any]) -> None:
    assert probe["far_off"] == []


def test_the_dumped_layers_are_the_configured_ones(
    gpu_server: GpuServer, probe: dict[str, Any]
) -> None:
    if gpu_server.layers is None:
        pytest.skip("the stage takes the model's default layers (GPU_CHECK_LAYERS unset)")
    assert probe["layer_ids"] == gpu_server.layers


def test_a_request_with_cached_prefix_tokens_is_published_as_an_error(
    gpu_server: GpuServer,
) -> None:
    """The same prompt twice without an extra_key: the second hits the radix cache, and its
    states would lack the cached prefix, so the plugin publishes an error marker instead."""
    if not gpu_server.radix:
        pytest.skip("the server's radix cache is off (GPU_CHECK_RADIX unset)")
    rng = random.Random()  # a prompt of its own each run: the first request must miss the cache
    ids = [rng.randrange(1024) for _ in range(300)]
    first, second = (f"hsdump-radix-{i}-{uuid.uuid4().hex[:6]}" for i in (1, 2))
    generate(gpu_server.url, ids, first, None)
    answer = generate(gpu_server.url, ids, second, None)
    marker = wait_dump(gpu_server.dump_dir, second)
    assert (wait_dump(gpu_server.dump_dir, first) / "done").exists()
    if not answer["meta_info"].get("cached_tokens"):
        pytest.skip("the second request missed the radix cache: the guard was not exercised")
    assert (marker / "error").exists(), "a request with cached prefix tokens was dumped"
