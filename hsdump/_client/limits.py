"""What a server accepts, read once from its ``/server_info``, and the one check of a sample's ids.

The client checks every sample against these limits before sending it, and the dataset reader
checks every line against the same limits, so a bad sample is refused in one place by one rule
(the ids' own type, non-negative ints, is `Sample`'s check).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hsdump._exceptions import InputError

__all__ = ["InputLimits", "local_model_config"]


@dataclass(frozen=True)
class InputLimits:
    """What the server accepts; checked here so a bad sample never reaches it.

    Attributes:
        vocab_size: Token ids must lie in ``[0, vocab_size)``; unchecked when None.
        max_tokens: The longest prompt the server takes; unchecked when None.
    """

    vocab_size: int | None = None
    max_tokens: int | None = None

    @classmethod
    def from_server_info(cls, info: Mapping[str, Any]) -> InputLimits:
        """The limits a server reports in ``/server_info`` (absent fields are not checked).

        SGLang reports the longest prompt per scheduler (``internal_states``) and no vocabulary
        size; the vocabulary then comes from the model's ``config.json`` when ``model_path`` is a
        local directory (the usual case on the node next to the server).
        """
        states = info.get("internal_states") or [{}]
        scheduler = states[0] if isinstance(states[0], Mapping) else {}
        length = (
            info.get("max_req_input_len")
            or scheduler.get("max_req_input_len")
            or info.get("context_length")
        )
        vocab = info.get("vocab_size") or _local_vocab_size(info.get("model_path"))
        return cls(
            vocab_size=_positive(vocab),
            max_tokens=_positive(length),
        )

    def check(self, input_ids: Sequence[int], *, sample_id: str | None = None) -> None:
        """Raise unless every id lies in the vocabulary and the prompt fits the context.

        Raises:
            InputError: Naming the first id outside the vocabulary, or the length and the limit.
        """
        vocab, longest = self.vocab_size, self.max_tokens
        if vocab is not None and max(input_ids, default=0) >= vocab:
            position = next(i for i, t in enumerate(input_ids) if t >= vocab)
            raise InputError(
                f"token id {input_ids[position]} at position {position} is outside the model's "
                f"vocabulary [0, {vocab}): was it tokenized for another model?",
                sample_id=sample_id,
            )
        if longest is not None and len(input_ids) > longest:
            raise InputError(
                f"{len(input_ids)} tokens, longer than the server's context of {longest} tokens: "
                "split or truncate the sample (or raise the server's --context-length)",
                sample_id=sample_id,
            )


def local_model_config(model_path: object) -> dict[str, Any]:
    """The ``config.json`` of ``model_path`` when it is a local model directory, else ``{}``."""
    if not isinstance(model_path, str) or not model_path:
        return {}
    try:
        config = json.loads((Path(model_path) / "config.json").read_text())
    except (OSError, ValueError):
        return {}
    return config if isinstance(config, dict) else {}


def _local_vocab_size(model_path: object) -> int | None:
    """``vocab_size`` from a local model directory's config (or its ``text_config``), else None."""
    config = local_model_config(model_path)
    text = config.get("text_config")
    vocab = config.get("vocab_size") or (text.get("vocab_size") if isinstance(text, dict) else None)
    return vocab if isinstance(vocab, int) else None


def _positive(value: object) -> int | None:
    """``value`` as a positive int, or None when the server did not report a usable one."""
    try:
        number = int(value)  # type: ignore[call-overload]  # JSON: int, str or anything
    except (TypeError, ValueError):
        return None
    return number if number > 0 else None
