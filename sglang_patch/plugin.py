"""The SGLang plugin: entry point ``sglang.srt.plugins`` ``hsdump = sglang_patch.plugin:register``.

SGLang's ``load_plugins()`` runs `register` in every server process, the scheduler
processes included, then applies the registered hooks. The plugin is inert unless
``HSDUMP_DUMP_DIR`` is set, so installing it changes nothing for other servers.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from sglang_patch._config import dump_enabled

__all__ = ["HOOKS", "SUPPORTED_VERSIONS", "Hook", "install", "register"]

logger = logging.getLogger(__name__)

#: SGLang releases whose hooked functions were checked (tests/test_sglang_patch_source.py).
SUPPORTED_VERSIONS = ("0.5.17", "0.5.23")

_ALLOW_UNTESTED = "HSDUMP_ALLOW_UNTESTED_SGLANG"


class Hook:
    """One hook: the dotted SGLang target, the hook type's name, and the function's name here.

    Args:
        target: Dotted path of the SGLang function or method.
        kind: ``"AFTER"`` or ``"AROUND"`` (a ``HookType`` member name).
        function: Name of the hook function in `sglang_patch.hooks`.
    """

    def __init__(self, target: str, kind: str, function: str):
        self.target, self.kind, self.function = target, kind, function

    def __repr__(self) -> str:
        return f"Hook({self.target!r}, {self.kind!r}, {self.function!r})"


HOOKS = (
    Hook(
        "sglang.srt.model_executor.model_runner_components.attention_backend_setup"
        ".configure_aux_hidden_state_capture",
        "AFTER",
        "after_configure_capture",
    ),
    Hook(
        "sglang.srt.layers.logits_processor.LogitsProcessor._get_hidden_states_to_store",
        "AROUND",
        "around_hidden_states_to_store",
    ),
    Hook(
        "sglang.srt.managers.tp_worker.TpModelWorker.forward_batch_generation",
        "AROUND",
        "around_forward_batch_generation",
    ),
    Hook("sglang.srt.managers.scheduler.Scheduler.__init__", "AFTER", "after_scheduler_init"),
)

_registered = False


def register() -> None:
    """Register the dump hooks with SGLang's ``HookRegistry`` (when ``HSDUMP_DUMP_DIR`` is set)."""
    global _registered
    if _registered or not dump_enabled():
        return
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    from sglang_patch import hooks

    problem = version_problem(_sglang_version())
    if problem is not None:
        # load_plugins() swallows exceptions raised here; the scheduler hook raises it instead.
        hooks.STATE.startup_errors.append(problem)
    for hook in HOOKS:
        HookRegistry.register(hook.target, getattr(hooks, hook.function), HookType[hook.kind])
    _registered = True
    logger.info("hsdump: plugin registered (dump root %s)", os.environ.get("HSDUMP_DUMP_DIR"))


def install() -> None:
    """Register and apply the hooks in this process, for launchers that bypass entry points."""
    register()
    from sglang.srt.plugins.hook_registry import HookRegistry

    HookRegistry.apply_hooks()


def version_problem(version: str, *, allow_untested: bool | None = None) -> str | None:
    """Why SGLang ``version`` cannot be used, or None when it is supported."""
    if allow_untested is None:
        allow_untested = os.environ.get(_ALLOW_UNTESTED, "") not in ("", "0")
    if version in SUPPORTED_VERSIONS or allow_untested:
        return None
    return (
        f"SGLang {version} is not a version this plugin was checked against "
        f"({', '.join(SUPPORTED_VERSIONS)}): install one of those, or set {_ALLOW_UNTESTED}=1 "
        "to try anyway (start-up checks still verify the hooks took effect)"
    )


def _sglang_version() -> Any:
    import sglang

    return getattr(sglang, "__version__", "unknown")
