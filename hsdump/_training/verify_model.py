"""Recomputing stored samples with transformers: are the stored states the model's states?

A checksum says the bytes are the ones written; it cannot see a server that wrote the wrong
states (zeros, the neighbouring layer, a chunked prefill that lost its first chunk). This module
reruns a few stored samples through the model, in fp32 and on the same tokens, and compares each
stored layer with that reference. A stored layer is never bit-identical to it: the server computed
in bf16 (other kernels, other summation order) and stored bf16. So the difference is judged against
the noise floor, the same metric between a transformers bf16 forward and the fp32 forward: a layer
passes when ``stored <= factor * floor + epsilon``.

The metric of a layer on one sample is ``max |x - reference| / max |reference|`` over its tokens
and channels; a layer's reported difference and floor are the largest over the checked samples.
"""

from __future__ import annotations

import os
import random
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from pydantic import BaseModel, ConfigDict

from hsdump._exceptions import ConfigError
from hsdump._protocol import FinalNorm

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedModel

    from hsdump._store.provenance import Provenance
    from hsdump._types import HiddenStates

__all__ = ["LayerVerdict", "ModelVerifyReport", "verify_against_model"]

DEFAULT_SAMPLES = 4
#: A stored layer may differ from fp32 by this many noise floors (SGLang's bf16 kernels are not
#: transformers', so its error is of the floor's size, not equal to it)...
DEFAULT_FACTOR = 1.5
#: ...plus this much: the floor of an embedding layer is bf16 rounding alone, or zero.
DEFAULT_EPSILON = 1e-3
#: Names the reference server's built-in model, rebuilt from its config and seed.
BUILTIN = "builtin"


class LayerVerdict(BaseModel):
    """How one stored layer compares with the model's.

    Attributes:
        layer: ``hidden_states[i]`` for an aux layer, ``final (post_norm)`` or ``final
            (pre_norm)`` for the final state.
        stored_diff: The largest relative difference between stored and fp32 states.
        noise_floor: The largest relative difference between bf16 and fp32 forwards.
        limit: The most ``stored_diff`` may be: ``factor * noise_floor + epsilon``.
        worst_sample: The sample with the largest ``stored_diff``.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    layer: str
    stored_diff: float
    noise_floor: float
    limit: float
    worst_sample: str

    @property
    def passed(self) -> bool:
        """True when the stored difference is within the limit."""
        return self.stored_diff <= self.limit


class ModelVerifyReport(BaseModel):
    """The result of `verify_against_model`.

    Attributes:
        sample_ids: The samples recomputed.
        layers: One verdict per stored layer: the aux layers in store order, then the final state.
        factor: The multiple of the noise floor allowed.
        epsilon: The margin added to it.
        device: Where the model ran.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    sample_ids: list[str]
    layers: list[LayerVerdict]
    factor: float
    epsilon: float
    device: str

    @property
    def passed(self) -> bool:
        """True when every layer passes."""
        return all(layer.passed for layer in self.layers)


def verify_against_model(
    store: str | os.PathLike[str] | Any,
    model: str | os.PathLike[str],
    *,
    samples: int = DEFAULT_SAMPLES,
    seed: int = 0,
    device: str | None = None,
    factor: float = DEFAULT_FACTOR,
    epsilon: float = DEFAULT_EPSILON,
    progress: Callable[[str], Any] | None = None,
) -> ModelVerifyReport:
    """Recompute ``samples`` random stored samples with the model and judge every stored layer.

    Args:
        store: The store (a path or anything `hsdump.open_store` takes).
        model: The model the server ran: a local transformers model directory, or ``"builtin"``
            for the reference server's built-in model (`hsdump.testing.build_default_model`).
        samples: How many committed samples to recompute (all of them when fewer).
        seed: Seeds the choice of samples.
        device: ``"cpu"`` or ``"cuda"``; a GPU when one is present, else the CPU.
        factor: A layer passes when its difference is at most ``factor`` noise floors...
        epsilon: ...plus ``epsilon``.
        progress: Called with a line before each stage.

    Raises:
        ConfigError: The model or the device cannot be used, or does not fit the store (hidden
            size, layer ids, vocabulary), or the store is empty.
        StoreError: The store cannot be opened or read.
    """
    from hsdump._store.store import open_store

    if samples < 1:
        raise ConfigError(f"samples must be at least 1, got {samples}")
    say = progress or (lambda _line: None)
    model_dir = _check_model(model)
    with open_store(store, "r") as opened:
        where, prov = opened.where, opened.provenance
        ids = sorted(opened)
        if prov is None or not ids:
            raise ConfigError(f"the store at {where} holds no samples: nothing to verify")
        chosen = random.Random(seed).sample(ids, min(samples, len(ids)))
        stored = [opened.get(sid, verify=True) for sid in chosen]
    final_norm = _final_norm(prov, where)
    device = _pick_device(device)
    say(f"loading {_name(model_dir)} on {device}")
    lm = _load_fp32(model_dir, device)
    _check_fits(lm, prov, stored, where, model_dir)
    layers = [f"hidden_states[{i}]" for i in prov.layer_ids] + [f"final ({final_norm})"]
    say(f"fp32 forward of {len(stored)} samples")
    reference = [_states(lm, hs, prov.layer_ids, final_norm) for hs in stored]
    diffs = [_diffs(_stack_stored(hs), ref) for hs, ref in zip(stored, reference, strict=True)]
    say(f"bf16 forward of {len(stored)} samples (the noise floor)")
    import torch

    lm = cast("Any", lm).to(torch.bfloat16)  # the weights rounded, as a bf16 checkpoint holds
    floors = [
        _diffs(_states(lm, hs, prov.layer_ids, final_norm), ref)
        for hs, ref in zip(stored, reference, strict=True)
    ]
    verdicts = [
        _verdict(name, [d[k] for d in diffs], [f[k] for f in floors], chosen, factor, epsilon)
        for k, name in enumerate(layers)
    ]
    return ModelVerifyReport(
        sample_ids=chosen, layers=verdicts, factor=factor, epsilon=epsilon, device=device
    )


def _check_model(model: str | os.PathLike[str]) -> Path | None:
    """The model's directory, or None for the built-in model."""
    if isinstance(model, str) and model == BUILTIN:
        return None
    path = Path(model)
    if not (path / "config.json").is_file():
        found = "no such directory" if not path.exists() else "no config.json in it"
        raise ConfigError(
            f"cannot verify against {os.fspath(path)!r}: {found}. Pass --against the local "
            "transformers model directory the server ran (config.json and weights), or "
            f"{BUILTIN} for the reference server's built-in model"
        )
    return path


def _name(model_dir: Path | None) -> str:
    return "the built-in model" if model_dir is None else f"the model at {model_dir}"


def _final_norm(prov: Provenance, where: str) -> FinalNorm:
    if prov.final_norm not in ("post_norm", "pre_norm"):
        raise ConfigError(
            f"the store at {where} records final_norm={prov.final_norm!r}: its final state cannot "
            "be recomputed without knowing whether it is post_norm or pre_norm"
        )
    return cast("FinalNorm", prov.final_norm)


def _pick_device(device: str | None) -> str:
    import torch

    from hsdump._servers.reference import default_device

    device = device or default_device()
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError(f"device {device!r} was asked for, but torch sees no GPU: use cpu")
    if not (device == "cpu" or device.startswith("cuda")):
        raise ConfigError(f"device must be cpu or cuda, got {device!r}")
    return device


def _load_fp32(model_dir: Path | None, device: str) -> PreTrainedModel:
    import torch

    from hsdump._servers.reference import build_default_model, inference_model, load_model

    if model_dir is None:
        return inference_model(cast("Any", build_default_model()).float(), device)
    return inference_model(load_model(model_dir, device, torch.float32), device)


def _check_fits(
    lm: PreTrainedModel,
    prov: Provenance,
    stored: list[HiddenStates],
    where: str,
    model_dir: Path | None,
) -> None:
    """Refuse a model that cannot have produced the store, before any forward pass."""
    config = lm.config
    hidden, layers, vocab = config.hidden_size, config.num_hidden_layers, config.vocab_size
    problems = []
    if prov.hidden_size != hidden:
        problems.append(f"hidden size {prov.hidden_size} stored, {hidden} in the model")
    if bad := [i for i in prov.layer_ids if not 0 <= i <= layers]:
        problems.append(f"layer ids {bad} stored, the model has hidden_states[0..{layers}]")
    for hs in stored:
        if int(hs.input_ids.max()) >= vocab:
            problems.append(f"sample {hs.sample_id!r} has token ids beyond the vocabulary {vocab}")
            break
    if problems:
        raise ConfigError(
            f"{_name(model_dir)} does not fit the store at {where}: "
            f"{'; '.join(problems)}. Pass --against the model the server ran"
        )


def _states(
    lm: PreTrainedModel, hs: HiddenStates, layer_ids: list[int], final_norm: FinalNorm
) -> torch.Tensor:
    """``[T, K+1, H]`` on the CPU: the aux states, then the final state, as the server dumps."""
    import torch

    from hsdump._servers.reference import capture_states

    aux, final = capture_states(lm, hs.input_ids.tolist(), layer_ids, final_norm)
    return torch.cat([aux, final[:, None]], dim=1).cpu()


def _stack_stored(hs: HiddenStates) -> torch.Tensor:
    import torch

    return torch.cat([hs.aux_hidden_states, hs.final_hidden_state[:, None]], dim=1)


def _diffs(states: torch.Tensor, reference: torch.Tensor) -> list[float]:
    """Per layer, ``max |states - reference| / max |reference|`` (inf where the reference is 0)."""
    error = (states.float() - reference.float()).abs().amax(dim=(0, 2))
    scale = reference.float().abs().amax(dim=(0, 2))
    return [_ratio(float(e), float(s)) for e, s in zip(error, scale, strict=True)]


def _ratio(error: float, scale: float) -> float:
    if scale > 0:
        return error / scale
    return 0.0 if error == 0 else float("inf")


def _verdict(
    layer: str,
    diffs: list[float],
    floors: list[float],
    sample_ids: list[str],
    factor: float,
    epsilon: float,
) -> LayerVerdict:
    worst = max(range(len(diffs)), key=diffs.__getitem__)
    floor = max(floors)
    return LayerVerdict(
        layer=layer,
        stored_diff=diffs[worst],
        noise_floor=floor,
        limit=factor * floor + epsilon,
        worst_sample=sample_ids[worst],
    )
