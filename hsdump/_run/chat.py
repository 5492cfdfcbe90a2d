"""Token ids and an assistant-only loss mask for a chat, from the tokenizer's chat template.

Drafters are trained on what the assistant says, so a ``messages`` line gets a mask of 1 on the
assistant's tokens and 0 on everything else (system and user turns, role headers). The mask
comes from the first of these that applies:

1. The template marks the assistant's text with ``{% generation %}``: transformers' own
   ``return_assistant_tokens_mask``.
2. The template belongs to a family whose assistant turn has a known shape (`FAMILIES`, the rule
   SpecForge uses): in the rendered chat, each assistant turn runs from after its header through
   its end-of-turn token, and the tokens overlapping it (by their character offsets) get 1.
3. Otherwise the line is refused. A mask of all ones would train the drafter on the prompt too.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from hsdump._exceptions import InputError

__all__ = ["FAMILIES", "TemplateFamily", "tokenize_chat"]

_GENERATION = re.compile(r"\{%-?\s*generation\s*-?%\}")  # transformers' own test


@dataclass(frozen=True)
class TemplateFamily:
    """How one family of chat templates renders an assistant turn.

    Attributes:
        name: The family's name, for messages.
        header: The text that opens an assistant turn (not trained on).
        end: The end-of-turn token that closes it (trained on: the model must learn to stop).
    """

    name: str
    header: str
    end: str

    def marks(self, template: str) -> bool:
        """Whether ``template`` belongs to this family (it writes both of its markers)."""
        opening = self.header.split("assistant")[0]
        return opening in template and self.end in template

    def spans(self, text: str) -> list[tuple[int, int]]:
        """The character spans of the assistant turns in a rendered chat."""
        pattern = re.escape(self.header) + "(.*?" + re.escape(self.end) + ")"
        return [m.span(1) for m in re.finditer(pattern, text, re.DOTALL)]


#: The template families whose assistant turns are found without ``{% generation %}``.
FAMILIES = (
    TemplateFamily("ChatML", "<|im_start|>assistant\n", "<|im_end|>"),
    TemplateFamily("Llama 3", "<|start_header_id|>assistant<|end_header_id|>\n\n", "<|eot_id|>"),
    TemplateFamily("Kimi K2", "<|im_assistant|>assistant<|im_middle|>", "<|im_end|>"),
)


def tokenize_chat(tokenizer: Any, messages: Any) -> tuple[list[int], list[int]]:
    """The token ids of ``messages`` rendered by the tokenizer's chat template, and their loss
    mask: 1 on the assistant's tokens, 0 elsewhere.

    Raises:
        InputError: The template cannot render the messages, or marks no assistant turn that
            hsdump can find, or the messages have no assistant turn.
    """
    if not isinstance(messages, list) or not all(isinstance(m, Mapping) for m in messages):
        raise InputError('"messages" must be a list of {"role": ..., "content": ...} objects')
    turns = sum(1 for m in messages if m.get("role") == "assistant")
    if not turns:
        raise InputError(
            'the messages have no "assistant" turn, so nothing would be trained on: '
            'give each conversation at least one {"role": "assistant", ...} message'
        )
    template = _template(tokenizer)
    if _GENERATION.search(template):
        return _generation_mask(tokenizer, messages)
    return _family_mask(tokenizer, messages, template, turns)


def _template(tokenizer: Any) -> str:
    try:
        template = tokenizer.get_chat_template()
    except ValueError as exc:
        raise InputError(f"the tokenizer has no chat template for messages: {exc}") from exc
    return str(template)


def _render(tokenizer: Any, messages: list[Any], **options: Any) -> Any:
    from jinja2 import TemplateError

    try:
        return tokenizer.apply_chat_template(messages, **options)
    except (TemplateError, ValueError, TypeError, KeyError) as exc:
        raise InputError(f"the chat template cannot render the messages: {exc}") from exc


def _generation_mask(tokenizer: Any, messages: list[Any]) -> tuple[list[int], list[int]]:
    out = _render(
        tokenizer, messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
    )
    mask = [int(bool(x)) for x in out["assistant_masks"]]
    if not any(mask):
        raise InputError(
            "the chat template's {% generation %} blocks mark no token of the assistant turns "
            "(empty, or never reached for these messages): fix the template's blocks"
        )
    return list(out["input_ids"]), mask


def _family_mask(
    tokenizer: Any, messages: list[Any], template: str, turns: int
) -> tuple[list[int], list[int]]:
    family = next((f for f in FAMILIES if f.marks(template)), None)
    if family is None:
        known = ", ".join(f.name for f in FAMILIES)
        raise InputError(
            "cannot tell the assistant's tokens: the tokenizer's chat template has no "
            f"{{% generation %}} blocks and is not of a known family ({known}). Add "
            "{% generation %}...{% endgeneration %} around the assistant's text in the template "
            'of the tokenizer directory, or give "input_ids" and "loss_mask" instead'
        )
    text = _render(tokenizer, messages, tokenize=False)
    spans = family.spans(text)
    if len(spans) != turns:
        raise InputError(
            f"the {family.name} rule found {len(spans)} assistant turns in the rendered chat, the "
            f"messages have {turns}: the template renders turns another way. Add "
            '{% generation %} blocks to it, or give "input_ids" and "loss_mask" instead'
        )
    try:
        encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    except NotImplementedError as exc:  # slow (Python) tokenizers have no offsets
        raise InputError(f"the assistant's tokens need a fast tokenizer's offsets: {exc}") from exc
    return list(encoded["input_ids"]), _overlapping(encoded["offset_mapping"], spans)


def _overlapping(offsets: Sequence[Sequence[int]], spans: list[tuple[int, int]]) -> list[int]:
    """1 for each token that overlaps a span, as transformers marks ``{% generation %}`` text."""
    return [int(any(end > a and start < b for a, b in spans)) for start, end in offsets]
