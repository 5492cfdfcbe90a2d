"""The functions hooked into SGLang, and the start-up checks of each scheduler process.

Four targets (`HOOKS`, which `sglang_patch.plugin` registers):

* ``configure_aux_hidden_state_capture`` (AFTER): turns on EAGLE-3 aux-layer capture on the model
  before CUDA graphs are captured, and records the layers it actually captures.
* ``LogitsProcessor._get_hidden_states_to_store`` (AROUND): under full capture, appends the
  final hidden state to the packed aux states, so one ``[T, (K+1)*H]`` tensor flows through
  SGLang's own (graph-safe, trimmed) output path. That is the post-norm lm_head input; with
  ``HSDUMP_FINAL_NORM=pre_norm`` the model has appended its final norm's input itself
  (`sglang_patch._prenorm`).
* ``TpModelWorker.forward_batch_generation`` (AROUND): after each prefill forward, stages the rows
  of opted-in requests (the `Dumper`).
* ``Scheduler.__init__`` (AFTER): checks versions, flags and parallelism, starts the dumper on
  the writing rank, writes the producer manifest and logs that the dump is active.

An exception raised here at start-up stops the scheduler, so the server fails to start with the
message instead of serving requests that are never dumped.
"""

from __future__ import annotations

import atexit
import inspect
import logging
import os
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hsdump._protocol import (
    Capabilities,
    ProducerInfo,
    ProducerManifest,
    small_page_warning,
    write_manifest,
)
from sglang_patch._config import PluginConfig, load_config
from sglang_patch._prenorm import capture_pre_norm

__all__ = [
    "HOOKS",
    "STATE",
    "Hook",
    "after_configure_capture",
    "after_scheduler_init",
    "around_forward_batch_generation",
    "around_hidden_states_to_store",
    "find_capture_module",
    "remove_stale_tmp_dirs",
]

logger = logging.getLogger(__name__)

PRODUCER_NAME = "sglang_patch"
_PREFILL_MODES = frozenset({"EXTEND", "MIXED"})


@dataclass
class _State:
    config: PluginConfig | None = None
    layer_ids: tuple[int, ...] | None = None
    hidden_size: int = 0
    startup_errors: list[str] = field(default_factory=list)
    dumper: Any = None


#: What the hooks of this process learned: the settings, the captured layers, start-up problems
#: found before the scheduler existed, and the dumper of the writing rank.
STATE = _State()


def find_capture_module(model: Any) -> Any:
    """The submodule holding ``layers_to_capture`` (``model.model`` for most architectures)."""
    modules = model.modules() if hasattr(model, "modules") else [model]
    for module in modules:
        if isinstance(getattr(module, "layers_to_capture", None), list | tuple):
            return module
    raise RuntimeError(
        f"{type(model).__name__} has no layers_to_capture: this architecture cannot capture "
        "EAGLE-3 aux hidden states in SGLang"
    )


def configure_capture(model: Any, requested: tuple[int, ...] | None) -> tuple[int, ...]:
    """Make ``model`` capture aux layers; returns the ids it captures (transformers convention).

    ``layers_to_capture`` holds decoder-layer *input* indices, which is exactly the transformers
    ``hidden_states`` index. ``set_eagle3_layers_to_capture`` takes "output of layer" ids and adds
    1 in most models but not always (DeepSeek only when the first id is 1), so the effective list
    is read back and, if it differs from what was asked, set directly (safe: graphs are captured
    after this).
    """
    module = find_capture_module(model)
    # Read on the capture module: wrappers (Kimi-K2.5's language_model) keep the flag inside.
    already = bool(module.layers_to_capture)
    if not already:
        if not hasattr(model, "set_eagle3_layers_to_capture"):
            raise RuntimeError(
                f"{type(model).__name__} has no set_eagle3_layers_to_capture: SGLang cannot "
                "capture aux hidden states for this architecture"
            )
        model.set_eagle3_layers_to_capture(
            None if requested is None else [i - 1 for i in requested]
        )
    effective = tuple(int(i) for i in module.layers_to_capture)
    if requested is not None and effective != requested:
        if already:
            raise RuntimeError(
                f"the server already captures layers {list(effective)} (from its own "
                f"--return-aux-hidden-state-layer-ids / EAGLE-3 flags) but HSDUMP_LAYER_IDS asks "
                f"for {list(requested)}: make them agree or unset HSDUMP_LAYER_IDS"
            )
        module.layers_to_capture = list(requested)
        effective = requested
    _check_layer_range(model, effective)
    return effective


def _check_layer_range(model: Any, layer_ids: tuple[int, ...]) -> None:
    config = getattr(model, "config", None)
    n = getattr(getattr(config, "text_config", config), "num_hidden_layers", None)
    if not layer_ids:
        raise RuntimeError("the model captures no aux layers")
    if n is not None and not all(1 <= i < n for i in layer_ids):
        raise RuntimeError(
            f"aux layer ids {list(layer_ids)} must lie in [1, {n - 1}] for a model with {n} "
            "decoder layers (id i is the input of layer i; the final state is dumped separately)"
        )


def after_configure_capture(result: Any, *args: Any, **kwargs: Any) -> Any:
    """AFTER ``configure_aux_hidden_state_capture``: turn on and record aux-layer capture."""
    model: Any = kwargs.get("model", args[0] if args else None)
    try:
        config = STATE.config = load_config()
        STATE.layer_ids = configure_capture(model, config.layer_ids)
        if config.final_norm == "pre_norm":
            capture_pre_norm(find_capture_module(model))
        text_config = getattr(model.config, "text_config", model.config)
        STATE.hidden_size = int(text_config.hidden_size)
    except (RuntimeError, ValueError) as exc:
        raise RuntimeError(f"hsdump: cannot dump hidden states: {exc}") from exc
    return result


def around_hidden_states_to_store(
    original: Any,
    processor: Any,
    hidden_states: Any,
    hidden_states_before_norm: Any,
    aux_hidden_states: Any,
    *args: Any,
    **kwargs: Any,
) -> Any:
    """AROUND ``LogitsProcessor._get_hidden_states_to_store``: append the final hidden state."""
    stored = original(
        processor, hidden_states, hidden_states_before_norm, aux_hidden_states, *args, **kwargs
    )
    metadata = kwargs.get("logits_metadata", args[-1] if args else None)
    if stored is None or aux_hidden_states is None or not _full_capture(metadata):
        return stored
    if STATE.config is not None and STATE.config.final_norm == "pre_norm":
        return stored  # the model appended its final norm's input to the aux states
    import torch

    # hidden_states is the lm_head input: the post-norm final state of every token.
    return torch.cat([stored, hidden_states.to(stored.dtype)], dim=-1)


def _full_capture(metadata: Any) -> bool:
    mode = getattr(metadata, "capture_hidden_mode", None)
    return bool(mode is not None and mode.is_full())


def around_forward_batch_generation(original: Any, worker: Any, *args: Any, **kwargs: Any) -> Any:
    """AROUND ``TpModelWorker.forward_batch_generation``: stage opted-in prefill rows."""
    result = original(worker, *args, **kwargs)
    dumper, batch = STATE.dumper, kwargs.get("batch", args[0] if args else None)
    if dumper is None or batch is None or _mode_name(batch) not in _PREFILL_MODES:
        return result
    try:
        dumper.on_forward(batch, getattr(result, "logits_output", None))
    except Exception:  # a dump failure must never take the server down
        logger.exception("hsdump: staging the hidden states of a prefill batch failed")
    return result


def _mode_name(batch: Any) -> str:
    mode = getattr(batch, "forward_mode", None)
    return getattr(mode, "name", "")


def after_scheduler_init(result: Any, scheduler: Any, *args: Any, **kwargs: Any) -> Any:
    """AFTER ``Scheduler.__init__``: check the setup, start the dumper, announce the producer."""
    from sglang.srt.runtime_context import get_parallel

    parallel = get_parallel()
    problems = list(STATE.startup_errors) + _setup_problems(scheduler.server_args, parallel)
    if problems:
        raise RuntimeError("hsdump: cannot dump hidden states: " + "; ".join(problems))
    config = STATE.config or load_config()
    writes = parallel.attn_tp_rank == 0 and getattr(parallel, "attn_cp_rank", 0) == 0
    if writes:
        _start_dumper(scheduler, config, parallel)
    logger.info(
        "hsdump: dump active on tp rank %d: layers %s + final (%s) into %s; %s",
        parallel.tp_rank,
        list(STATE.layer_ids or ()),
        config.final_norm,
        config.dump_dir,
        STATE.dumper.describe() if writes else "attention-TP rank 0 of this group writes",
    )
    return result


def _setup_problems(server_args: Any, parallel: Any) -> list[str]:
    from sglang.srt.model_executor.forward_batch_info import get_server_return_hidden_states_mode

    problems = [f"the hook on {target} was not applied" for target in _unapplied_hooks()]
    if STATE.layer_ids is None:
        problems.append("aux-layer capture was never configured (the capture hook did not run)")
    # 0.5.17 reads the mode from server_args; 0.5.23 from the runtime context.
    takes_args = bool(inspect.signature(get_server_return_hidden_states_mode).parameters)
    mode = get_server_return_hidden_states_mode(*([server_args] if takes_args else []))
    if not mode.is_full():
        problems.append("start the server with --enable-return-hidden-states (full capture)")
    if getattr(parallel, "pp_size", 1) != 1:
        problems.append("pipeline parallelism is not supported: use --pp-size 1 (TP/EP instead)")
    if getattr(parallel, "attn_cp_size", 1) != 1:
        problems.append("attention context parallelism is not supported: use --attn-cp-size 1")
    if getattr(server_args, "enable_pdmux", False):
        problems.append("--enable-pdmux is not supported")
    return problems


def _unapplied_hooks() -> list[str]:
    from sglang.srt.plugins.hook_registry import HookRegistry

    # apply_hooks() only logs a target it cannot patch; a missing hook must stop the server.
    patched = getattr(HookRegistry, "_patched", None)
    if patched is None:
        return []
    return [hook.target for hook in HOOKS if hook.target not in patched]


def _start_dumper(scheduler: Any, config: PluginConfig, parallel: Any) -> None:
    import sglang
    import torch

    from sglang_patch._dumper import Dumper, torch_dtype_name
    from sglang_patch._writer import DumpFormat

    producer = ProducerInfo(name=PRODUCER_NAME, version=f"sglang-{sglang.__version__}")
    fmt = DumpFormat(
        layer_ids=tuple(STATE.layer_ids or ()),
        hidden_size=STATE.hidden_size,
        final_norm=config.final_norm,
        dtype=torch_dtype_name(scheduler.tp_worker.model_runner.dtype),
        producer=producer,
        model_path=str(scheduler.server_args.model_path),
        rank=parallel.tp_rank,
    )
    config.dump_dir.mkdir(parents=True, exist_ok=True)
    remove_stale_tmp_dirs(config.dump_dir)
    warning = small_page_warning(config.dump_dir)
    if warning is not None:
        logger.warning("hsdump: %s", warning)
    STATE.dumper = Dumper(config, fmt, pin=torch.cuda.is_available())
    manifest = write_manifest(config.dump_dir, _manifest(fmt))
    atexit.register(_shutdown, manifest)


def _manifest(fmt: Any) -> ProducerManifest:
    return ProducerManifest(
        producer=fmt.producer,
        rank=fmt.rank,
        layer_ids=list(fmt.layer_ids),
        final_norm=fmt.final_norm,
        hidden_size=fmt.hidden_size,
        dtype=fmt.dtype,
        model_path=fmt.model_path,
        capabilities=Capabilities(
            chunked_prefill_assembly=True,
            prefix_cache_guard=True,
            row_moments=True,
        ),
    )


def _shutdown(manifest: Path) -> None:
    if STATE.dumper is not None:
        STATE.dumper.close()
    manifest.unlink(missing_ok=True)


def remove_stale_tmp_dirs(root: Path, *, min_age_s: float = 60.0) -> int:
    """Delete ``.tmp-req_*`` dirs left by dead processes of this host; returns how many."""
    removed = 0
    for path in root.glob(".tmp-req_*"):
        pid = _tmp_pid(path.name)
        try:
            old = time.time() - path.stat().st_mtime > min_age_s
        except OSError:
            continue
        if pid is not None and old and not _pid_alive(pid):
            shutil.rmtree(path, ignore_errors=True)
            removed += 1
    return removed


def _tmp_pid(name: str) -> int | None:
    parts = name.rsplit("-", 2)  # .tmp-req_<rid>-<pid>-<hex>
    return int(parts[1]) if len(parts) == 3 and parts[1].isdigit() else None


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


@dataclass(frozen=True)
class Hook:
    """One hook: the dotted SGLang target, the hook type's name, and the function hooked in.

    Attributes:
        target: Dotted path of the SGLang function or method.
        kind: ``"AFTER"`` or ``"AROUND"`` (a ``HookType`` member name).
        function: The hook function (one of this module's).
    """

    target: str
    kind: str
    function: Callable[..., Any]


#: What `sglang_patch.plugin.register` hands SGLang's ``HookRegistry``; the targets are checked
#: against each supported release's source (tests/test_sglang_patch_source.py).
HOOKS = (
    Hook(
        "sglang.srt.model_executor.model_runner_components.attention_backend_setup"
        ".configure_aux_hidden_state_capture",
        "AFTER",
        after_configure_capture,
    ),
    Hook(
        "sglang.srt.layers.logits_processor.LogitsProcessor._get_hidden_states_to_store",
        "AROUND",
        around_hidden_states_to_store,
    ),
    Hook(
        "sglang.srt.managers.tp_worker.TpModelWorker.forward_batch_generation",
        "AROUND",
        around_forward_batch_generation,
    ),
    Hook("sglang.srt.managers.scheduler.Scheduler.__init__", "AFTER", after_scheduler_init),
)
