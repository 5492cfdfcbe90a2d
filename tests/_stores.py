"""Reading a whole store back for comparisons between runs."""

from __future__ import annotations

from pathlib import Path

import torch

from hsdump import open_store


def stored_bits(store: Path) -> dict[str, tuple[bytes, bytes, list[int]]]:
    """Every sample's stored bits and token ids; the store must hold each sample once."""
    with open_store(store, "r") as opened:
        assert not opened.duplicates
        return {
            sid: (
                hs.aux_hidden_states.view(torch.int16).numpy().tobytes(),
                hs.final_hidden_state.view(torch.int16).numpy().tobytes(),
                hs.input_ids.tolist(),
            )
            for sid in opened
            for hs in [opened[sid]]
        }
