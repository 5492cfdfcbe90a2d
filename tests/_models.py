"""The tiny random Llama that the end-to-end and model-check tests build from a config."""

from __future__ import annotations

TINY = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 6,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 512,
    "max_position_embeddings": 512,
}
