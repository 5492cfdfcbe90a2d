"""Stores for the interop tests: written through the public API from a tiny seeded Llama.

The final norm's weights are drawn at random, so a pre-norm state never equals a post-norm one.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from hsdump import DumpMeta, HiddenStates, ProducerInfo, open_store
from hsdump.testing import build_default_model

LENGTHS = [17, 5, 33, 9, 24, 2, 40, 12, 28, 7, 19, 31]
LAYERS = 8
LAYER_IDS = [2, LAYERS // 2, LAYERS - 3]  # SGLang's EAGLE-3 default, in transformers' ids


@pytest.fixture(scope="session")
def verifier(tmp_path_factory: pytest.TempPathFactory) -> tuple[object, Path]:
    """The model and the directory it is saved in (speculators reads its norm and lm_head)."""
    model = build_default_model(seed=7, num_hidden_layers=LAYERS)
    with torch.no_grad():
        norm = model.model.norm.weight
        norm.copy_(torch.empty_like(norm).uniform_(0.25, 2.0, generator=_rng(11)))
    path = tmp_path_factory.mktemp("verifier")
    model.save_pretrained(path)
    return model, path


@pytest.fixture(scope="session")
def post_norm(verifier: tuple[object, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_store(verifier[0], tmp_path_factory.mktemp("post") / "s.zarr", "post_norm")


@pytest.fixture(scope="session")
def pre_norm(verifier: tuple[object, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_store(verifier[0], tmp_path_factory.mktemp("pre") / "s.zarr", "pre_norm")


def write_store(model: object, path: Path, final_norm: str) -> Path:
    """The states the SGLang plugin would dump for a few prompts, with random loss masks."""
    from hsdump._servers.reference import capture_states

    rng = _rng(3)
    with open_store(path, "w") as store:
        for i, t in enumerate(LENGTHS):
            ids = torch.randint(0, 2048, (t,), generator=rng)
            aux, final = capture_states(model, ids.tolist(), LAYER_IDS, final_norm)  # type: ignore[arg-type]
            aux, final = aux.to(torch.bfloat16), final.to(torch.bfloat16)
            mask = (torch.rand(t, generator=rng) < 0.7).to(torch.uint8)
            store.write(
                HiddenStates(
                    sample_id=f"s{i:02d}",
                    input_ids=ids,
                    aux_hidden_states=aux,
                    final_hidden_state=final,
                    layer_ids=LAYER_IDS,
                    loss_mask=mask,
                    meta=_meta(f"s{i:02d}", ids, aux, final_norm),
                )
            )
    return path


def _meta(rid: str, ids: torch.Tensor, aux: torch.Tensor, final_norm: str) -> DumpMeta:
    t, k, h = aux.shape
    return DumpMeta(
        rid=rid,
        input_ids=ids.tolist(),
        num_tokens=t,
        layer_ids=LAYER_IDS,
        final_norm=final_norm,  # type: ignore[arg-type]
        hidden_size=h,
        dtype="bfloat16",
        aux_shape=(t, k, h),
        final_shape=(t, h),
        producer=ProducerInfo(name="interop-test", version="1"),
        model_path="tiny-llama",
    )


def _rng(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)
