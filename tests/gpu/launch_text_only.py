"""``python3 tests/gpu/launch_text_only.py <sglang args>``: the plugin's launcher, multimodal off.

A multimodal model (Kimi-K2.5's ``KimiK25ForConditionalGeneration``) makes SGLang load the
model's processor, which a random checkpoint built here lacks. With multimodal off, SGLang serves
the same model class on token ids, as a text-only deployment does. SGLang's command line can only
turn ``--enable-multimodal`` on, so this sets it off before the arguments are resolved.
"""

from __future__ import annotations

import argparse
from typing import Any

from sglang.srt.server_args import ServerArgs

from sglang_patch.launch_server import main

_from_cli_args = ServerArgs.from_cli_args.__func__  # type: ignore[attr-defined]


def _text_only(cls: type[ServerArgs], args: argparse.Namespace) -> Any:
    args.enable_multimodal = False
    return _from_cli_args(cls, args)


ServerArgs.from_cli_args = classmethod(_text_only)  # type: ignore[method-assign,assignment]

if __name__ == "__main__":
    main()
