"""The whole job on a real model: dataset in, a store of the right hidden states out."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import anyio
import httpx
import pytest
import torch
from _models import TINY

from hsdump import (
    HiddenStateClient,
    ReferenceServer,
    Sample,
    open_store,
    run_extraction,
    verify_store,
)
from hsdump.testing import build_default_model

LENGTHS = (1, 7, 33, 128, 300)


@pytest.fixture(scope="module")
def model():
    return build_default_model(seed=11, **TINY)


@pytest.fixture(scope="module")
def model_dir(model, tmp_path_factory):
    path = tmp_path_factory.mktemp("model")
    model.save_pretrained(path)
    return path


def _samples(seed: int = 0, lengths=LENGTHS) -> list[Sample]:
    gen = torch.Generator().manual_seed(seed)
    return [
        Sample(f"s{i}", torch.randint(0, 512, (n,), generator=gen).tolist())
        for i, n in enumerate(lengths)
    ]


async def _extract_into(path, server, samples, **client_options):
    async with HiddenStateClient(server.url, dump_dir=server.dump_dir, **client_options) as client:
        with open_store(path, "a") as store:
            return await run_extraction(samples, client=client, store=store)


def _bf16_close(stored: torch.Tensor, expected: torch.Tensor) -> bool:
    return torch.allclose(stored.float(), expected.to(torch.bfloat16).float(), atol=1e-2, rtol=1e-2)


def _forward(model, ids):
    """An independent forward pass: every hidden state, and the last layer's output before norm."""
    captured = []
    hook = model.model.layers[-1].register_forward_hook(
        lambda module, args, output: captured.append(
            output[0] if isinstance(output, tuple) else output
        )
    )
    try:
        with torch.no_grad():
            hidden = model(torch.tensor([ids]), output_hidden_states=True).hidden_states
    finally:
        hook.remove()
    return hidden, captured[0][0]


def test_every_stored_layer_is_the_transformers_hidden_state_it_claims_to_be(model, tmp_path):
    with ReferenceServer(model, dump_dir=tmp_path / "dumps", device="cpu") as server:
        summary = anyio.run(_extract_into, tmp_path / "s.zarr", server, _samples())
    assert summary.ok and summary.samples_done == len(LENGTHS)
    with open_store(tmp_path / "s.zarr", "r") as store:
        for sample in _samples():
            stored = store[sample.id]
            hidden, pre_norm = _forward(model, sample.input_ids)
            assert stored.input_ids.tolist() == sample.input_ids
            assert stored.layer_ids == [2, 3] and len(hidden) == 7
            for k, layer in enumerate(stored.layer_ids):
                matches = [
                    i for i in range(6) if _bf16_close(stored.aux_hidden_states[:, k], hidden[i][0])
                ]
                assert matches == [layer], f"{sample.id}: stored layer {layer} matches {matches}"
            assert _bf16_close(stored.final_hidden_state, hidden[-1][0])
            assert not _bf16_close(stored.final_hidden_state, pre_norm)


def test_a_second_client_sending_its_own_requests_changes_nothing_in_the_store(model, tmp_path):
    ours, theirs = _samples(seed=1), _samples(seed=2)  # the same sample ids, other tokens

    async def both(server):
        async def intruder():
            async with HiddenStateClient(server.url, dump_dir=server.dump_dir) as other:
                for sample in theirs * 2:
                    await other.extract(sample)
            async with httpx.AsyncClient() as http:  # plain traffic, not opted in
                body = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 2}}
                await http.post(f"{server.url}/generate", json=body, timeout=30)

        async with anyio.create_task_group() as group:
            group.start_soon(intruder)
            await _extract_into(tmp_path / "busy.zarr", server, ours)

    with ReferenceServer(model, dump_dir=tmp_path / "dumps", device="cpu") as server:
        anyio.run(both, server)
        anyio.run(_extract_into, tmp_path / "quiet.zarr", server, ours)
    _assert_same_store(tmp_path / "busy.zarr", tmp_path / "quiet.zarr", [s.id for s in ours])


def _assert_same_store(path_a, path_b, ids):
    with open_store(path_a, "r") as a, open_store(path_b, "r") as b:
        assert sorted(a) == sorted(b) == sorted(ids)
        for sample_id in ids:
            x, y = a[sample_id], b[sample_id]
            assert torch.equal(x.input_ids, y.input_ids)
            assert torch.equal(x.aux_hidden_states, y.aux_hidden_states)
            assert torch.equal(x.final_hidden_state, y.final_hidden_state)


def _cli(model_dir, dataset, store, dumps) -> list[str]:
    args = ["extract", str(dataset), "--out", str(store), "--model", str(model_dir)]
    return [
        sys.executable,
        "-m",
        "hsdump",
        *args,
        "--dump-dir",
        str(dumps),
        "--shard-tokens",
        "64",
        "-v",
    ]


@pytest.mark.slow
def test_sigkill_mid_run_then_rerun_gives_the_store_of_an_uninterrupted_run(model_dir, tmp_path):
    lengths = [16 + (i * 37) % 120 for i in range(24)]
    dataset = tmp_path / "d.jsonl"
    samples = _samples(3, lengths)
    lines = [json.dumps({"id": s.id, "input_ids": s.input_ids}) for s in samples]
    dataset.write_text("\n".join(lines) + "\n")
    # A commit at each shard, so that the kill finds some committed and some not.
    env = {**os.environ, "COLUMNS": "200", "HSDUMP_COMMIT_INTERVAL_S": "0"}

    with subprocess.Popen(
        _cli(model_dir, dataset, tmp_path / "k.zarr", tmp_path / "d1"),
        stderr=subprocess.PIPE, text=True, env=env,
    ) as victim:  # fmt: skip
        written = 0
        for line in victim.stderr:  # type: ignore[union-attr]
            written += "wrote sample" in line
            if written == 10:
                victim.send_signal(signal.SIGKILL)
                break
    assert victim.returncode == -signal.SIGKILL
    with open_store(tmp_path / "k.zarr", "r") as partial:
        assert 0 < len(partial) < len(samples), "the kill should land mid-run"

    rerun = subprocess.run(
        _cli(model_dir, dataset, tmp_path / "k.zarr", tmp_path / "d2"),
        env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert rerun.returncode == 0, rerun.stderr
    assert f"{len(partial)} skipped" in " ".join(rerun.stderr.split())
    with ReferenceServer(model_dir, dump_dir=tmp_path / "d3", device="cpu") as server:
        assert anyio.run(_extract_into, tmp_path / "c.zarr", server, samples).ok
    assert verify_store(tmp_path / "k.zarr").clean
    _assert_same_store(tmp_path / "k.zarr", tmp_path / "c.zarr", [s.id for s in samples])
