"""The server a GPU check runs against, and how far its hidden states are from transformers."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch


@dataclass(frozen=True)
class GpuServer:
    """A running SGLang server with the plugin, and what tests/gpu/run.sh started it with.

    Attributes:
        stage: run.sh's stage (``tiny_a``, ``tiny_b``, ``graphs_1b``), which names the records.
        url: the server's base URL.
        dump_dir: the plugin's dump root (``HSDUMP_DUMP_DIR``, which the server reads too).
        model: the model folder the server loaded, for the transformers reference.
        out: where the JSON records go (run.sh's ``$OUT``).
        radix: whether the server's radix cache is on.
        layers: the aux layer ids the stage configured, or None for the model's default.
        final_norm: the final state the server dumps (``HSDUMP_FINAL_NORM``, default post_norm).
        moe: whether the model routes tokens to experts (``GPU_CHECK_MOE=1``): a bf16 near-tie
            there picks another expert in SGLang than in transformers, so a token's state may
            differ by more than rounding, and only the noise-floor check of ``hsdump verify``
            judges the layers.
    """

    stage: str
    url: str
    dump_dir: Path
    model: Path
    out: Path
    radix: bool
    layers: list[int] | None
    final_norm: str = "post_norm"
    moe: bool = False

    @classmethod
    def from_env(cls) -> GpuServer | None:
        """The server run.sh names in ``GPU_CHECK_*`` and ``HSDUMP_DUMP_DIR``; None without one.

        Raises:
            KeyError: a server URL is given without its dump root or model.
        """
        url = os.environ.get("GPU_CHECK_URL")
        if not url:
            return None
        layers = os.environ.get("GPU_CHECK_LAYERS")
        return cls(
            stage=os.environ.get("GPU_CHECK_STAGE", "gpu"),
            url=url,
            dump_dir=Path(os.environ["HSDUMP_DUMP_DIR"]),
            model=Path(os.environ["GPU_CHECK_MODEL"]),
            out=Path(os.environ.get("OUT", "/tmp/out")),
            radix=os.environ.get("GPU_CHECK_RADIX") == "1",
            layers=[int(x) for x in layers.split(",")] if layers else None,
            final_norm=os.environ.get("HSDUMP_FINAL_NORM") or "post_norm",
            moe=os.environ.get("GPU_CHECK_MOE") == "1",
        )

    def record(self, kind: str, result: dict[str, object]) -> None:
        """Write ``result`` as ``$OUT/<kind>_<stage>.json``, the run's record of a check."""
        self.out.mkdir(parents=True, exist_ok=True)
        (self.out / f"{kind}_{self.stage}.json").write_text(json.dumps(result, indent=1))


def reference_forward(
    model: Any, ids: list[int]
) -> tuple[tuple[torch.Tensor, ...], dict[str, Any]]:
    """transformers' ``hidden_states`` for one prompt, and both final states.

    Returns:
        ``hidden_states`` (each ``[1, T, H]``) and ``{"post_norm": [T, H], "pre_norm": [T, H]}``:
        the lm_head input, and the final norm's input taken by a hook on ``model.model.norm``.
    """
    seen: list[torch.Tensor] = []
    hook = model.model.norm.register_forward_hook(lambda _m, args, _o: seen.append(args[0]))
    try:
        with torch.no_grad():
            hidden = model(torch.tensor([ids]).cuda(), output_hidden_states=True).hidden_states
    finally:
        hook.remove()
    return hidden, {"post_norm": hidden[-1][0], "pre_norm": seen[0][0]}


def other_norm(final_norm: str) -> str:
    """The convention the server was not asked for: a final state matching it is a mix-up."""
    return "pre_norm" if final_norm == "post_norm" else "post_norm"


@dataclass
class LayerDiffs:
    """The largest difference from the reference, and the reference's scale, per layer name."""

    per_layer: dict[str, dict[str, float]] = field(default_factory=dict)

    def add(self, name: str, got: torch.Tensor, want: torch.Tensor) -> None:
        """Fold one sample's ``got`` against its reference ``want`` (same shape) into ``name``."""
        entry = self.per_layer.setdefault(name, {"max_abs_diff": 0.0, "max_abs_ref": 0.0})
        diff = (got.float().cpu() - want.float().cpu()).abs().max().item()
        entry["max_abs_diff"] = max(entry["max_abs_diff"], diff)
        entry["max_abs_ref"] = max(entry["max_abs_ref"], want.abs().max().item())

    def far_off(self, *names: str) -> list[str]:
        """The layers (all, or ``names``) further from their reference than bf16 rounding explains.

        Two kernels' bf16 roundings stay within 5% of the layer's scale; a neighbouring layer is
        off by about its whole scale.
        """
        return [
            f"{name}: max abs diff {e['max_abs_diff']:.4g} (reference scale {e['max_abs_ref']:.3g})"
            for name, e in self.per_layer.items()
            if (not names or name in names)
            and e["max_abs_diff"] > 0.05 * max(1.0, e["max_abs_ref"])
        ]
