"""Random checkpoints for the GPU checks, built from a config with a seed on the GPU, in bf16.

    python3 tests/gpu/make_model.py llama DIR
        a tiny Llama (H=256, 8 layers, vocab 1024)
    python3 tests/gpu/make_model.py deepseek DIR
        DeepSeek-V3 / Kimi-K2.5's language model shape: MLA, 384 routed experts (8 a token) and
        one shared, sigmoid noaux_tc routing, H=2048, 8 layers
    python3 tests/gpu/make_model.py kimi25 DIR SRC
        SRC's DeepSeek-V3 weights as the language model of SGLang's
        KimiK25ForConditionalGeneration (a tiny MoonViT tower, left unloaded: text prompts only)

Every final norm is drawn from [0.5, 1.5): transformers initialises norms to ones, under which a
pre-norm/post-norm mix-up changes the data too little to be seen.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

DEEPSEEK = {
    "vocab_size": 32000,
    "hidden_size": 2048,
    "intermediate_size": 4096,
    "moe_intermediate_size": 128,
    "num_hidden_layers": 8,
    "num_attention_heads": 16,
    "num_key_value_heads": 16,
    "n_shared_experts": 1,
    "n_routed_experts": 384,
    "num_experts_per_tok": 8,
    "n_group": 1,
    "topk_group": 1,
    "first_k_dense_replace": 1,
    "kv_lora_rank": 512,
    "q_lora_rank": 1536,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "qk_nope_head_dim": 128,
    "routed_scaling_factor": 2.827,
    "topk_method": "noaux_tc",
    "scoring_func": "sigmoid",
    "moe_layer_freq": 1,
    "max_position_embeddings": 32768,
}
VISION = {  # MoonViT, as small as SGLang builds it
    "patch_size": 14,
    "init_pos_emb_height": 8,
    "init_pos_emb_width": 8,
    "num_attention_heads": 2,
    "num_hidden_layers": 1,
    "hidden_size": 64,
    "vt_hidden_size": 64,
    "intermediate_size": 128,
    "mm_hidden_size": 64,
}


def save(model: torch.nn.Module, path: Path) -> None:
    with torch.no_grad():
        norm = model.model.norm.weight
        norm.copy_(0.5 + torch.rand(norm.shape, device=norm.device, dtype=norm.dtype))
    model.save_pretrained(path)
    print("saved", path)


def llama(path: Path) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        hidden_size=256, intermediate_size=512, num_hidden_layers=8, num_attention_heads=4,
        num_key_value_heads=2, head_dim=64, vocab_size=1024, max_position_embeddings=4096,
    )  # fmt: skip
    save(LlamaForCausalLM(config).to(torch.bfloat16), path)


def deepseek(path: Path) -> None:
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    with torch.device("cuda"):
        save(DeepseekV3ForCausalLM(DeepseekV3Config(**DEEPSEEK)).to(torch.bfloat16), path)


def kimi25(path: Path, source: Path) -> None:
    """SRC's weights under ``language_model.``, with Kimi-K2.5's wrapper config."""
    from safetensors.torch import load_file, save_file

    path.mkdir(parents=True, exist_ok=True)
    text = json.loads((source / "config.json").read_text())
    config = {
        "architectures": ["KimiK25ForConditionalGeneration"],
        "model_type": "kimi_k25",
        "torch_dtype": "bfloat16",
        "text_config": text,
        "vision_config": {**VISION, "text_hidden_size": text["hidden_size"]},
    }
    (path / "config.json").write_text(json.dumps(config, indent=1))
    for shard in sorted(source.glob("*.safetensors")):
        tensors = load_file(shard)
        save_file({f"language_model.{k}": v for k, v in tensors.items()}, path / shard.name,
                  metadata={"format": "pt"})  # fmt: skip
    index = source / "model.safetensors.index.json"
    if index.exists():
        table = json.loads(index.read_text())
        table["weight_map"] = {f"language_model.{k}": v for k, v in table["weight_map"].items()}
        (path / index.name).write_text(json.dumps(table))
    print("saved", path)


if __name__ == "__main__":
    torch.manual_seed(0)
    kind, target = sys.argv[1], Path(sys.argv[2])
    if kind == "kimi25":
        kimi25(target, Path(sys.argv[3]))
    else:
        {"llama": llama, "deepseek": deepseek}[kind](target)
