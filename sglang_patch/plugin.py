"""The SGLang plugin: entry point ``sglang.srt.plugins`` ``hsdump = sglang_patch.plugin:register``.

SGLang's ``load_plugins()`` runs `register` in every server process, the scheduler
processes included, then applies the registered hooks (`sglang_patch.hooks.HOOKS`). The plugin is
inert unless ``HSDUMP_DUMP_DIR`` is set, so installing it changes nothing for other servers.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from sglang_patch._config import allow_untested_sglang, dump_enabled

__all__ = ["SUPPORTED_VERSIONS", "install", "register", "version_problem"]

logger = logging.getLogger(__name__)

#: SGLang releases whose hooked functions were checked (tests/test_sglang_patch_source.py).
SUPPORTED_VERSIONS = ("0.5.17", "0.5.23")

_registered = False


def register() -> None:
    """Register the dump hooks with SGLang's ``HookRegistry`` (when ``HSDUMP_DUMP_DIR`` is set)."""
    global _registered
    if _registered or not dump_enabled():
        return
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    # Imported here: a server that does not dump never loads the dump path.
    from sglang_patch import hooks

    problem = version_problem(_sglang_version())
    if problem is not None:
        # load_plugins() swallows exceptions raised here; the scheduler hook raises it instead.
        hooks.STATE.startup_errors.append(problem)
    for hook in hooks.HOOKS:
        HookRegistry.register(hook.target, hook.function, HookType[hook.kind])
    _registered = True
    logger.info("hsdump: plugin registered (dump root %s)", os.environ.get("HSDUMP_DUMP_DIR"))


def install() -> None:
    """Register and apply the hooks in this process, for launchers that bypass entry points."""
    register()
    from sglang.srt.plugins.hook_registry import HookRegistry

    HookRegistry.apply_hooks()


def version_problem(version: str) -> str | None:
    """Why SGLang ``version`` cannot be used, or None when it is supported (or
    ``HSDUMP_ALLOW_UNTESTED_SGLANG`` asks to try it)."""
    if version in SUPPORTED_VERSIONS or allow_untested_sglang():
        return None
    return (
        f"SGLang {version} is not a version this plugin was checked against "
        f"({', '.join(SUPPORTED_VERSIONS)}): install one of those, or set "
        "HSDUMP_ALLOW_UNTESTED_SGLANG=1 to try anyway (start-up checks still verify the hooks "
        "took effect)"
    )


def _sglang_version() -> Any:
    import sglang

    return getattr(sglang, "__version__", "unknown")
