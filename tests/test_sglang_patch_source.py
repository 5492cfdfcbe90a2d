"""Every SGLang function and attribute the plugin relies on exists, with the expected signature, in
the source of each supported SGLang release (read statically with ast; sglang is never imported).

The wheels come from PyPI (``pip download --no-deps``) into a cache directory
(``$HSDUMP_SGLANG_SRC_CACHE``, default ``~/.cache/hsdump/sglang-src``); the tests skip, saying
why, only when the download fails.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
import zipfile
from functools import cache
from pathlib import Path

import pytest

from sglang_patch.hooks import HOOKS
from sglang_patch.plugin import SUPPORTED_VERSIONS

CACHE = Path(
    os.environ.get("HSDUMP_SGLANG_SRC_CACHE", Path.home() / ".cache" / "hsdump" / "sglang-src")
)
SRT = "sglang/srt/"


class Source:
    """Files of one SGLang wheel, parsed on demand."""

    def __init__(self, wheel: Path):
        self.zip = zipfile.ZipFile(wheel)

    @cache  # noqa: B019 (one Source per version for the whole session)
    def tree(self, path: str) -> ast.Module:
        return ast.parse(self.zip.read(path))

    def module_path(self, dotted: str) -> tuple[str, list[str]]:
        """Split ``a.b.c.Class.method`` into the file that exists and the names inside it."""
        parts = dotted.split(".")
        files = set(self.zip.namelist())
        for cut in range(len(parts), 0, -1):
            for path in ("/".join(parts[:cut]) + ".py", "/".join(parts[:cut]) + "/__init__.py"):
                if path in files:
                    return path, parts[cut:]
        raise AssertionError(f"no module file for {dotted}")

    def find(self, dotted: str) -> ast.AST:
        path, names = self.module_path(dotted)
        node: ast.AST = self.tree(path)
        for name in names:
            node = next(
                (
                    child
                    for child in ast.iter_child_nodes(node)
                    if isinstance(child, ast.FunctionDef | ast.ClassDef) and child.name == name
                ),
                None,
            )
            assert node is not None, f"{dotted}: {name} not found in {path}"
        return node

    def attributes(self, dotted_class: str) -> set[str]:
        """Annotated class attributes, ``self.x = ...`` targets, methods and enum members."""
        cls = self.find(dotted_class)
        names = set()
        for node in ast.walk(cls):
            if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                names.add(node.target.id)
            elif isinstance(node, ast.Assign):
                names.update(t.id for t in node.targets if isinstance(t, ast.Name))
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                if isinstance(node.value, ast.Name) and node.value.id == "self":
                    names.add(node.attr)
            elif isinstance(node, ast.FunctionDef):
                names.add(node.name)
        return names


def _download(version: str) -> Path:
    target = CACHE / version
    found = sorted(target.glob(f"sglang-{version}-*.whl"))
    if found:
        return found[0]
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "-q",
           "--python-version", "3.11", "--platform", "manylinux_2_34_x86_64", "-d", str(target),
           f"sglang=={version}"]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    found = sorted(target.glob(f"sglang-{version}-*.whl"))
    if proc.returncode != 0 or not found:
        pytest.skip(f"could not download sglang=={version} from PyPI: {proc.stderr.strip()[-300:]}")
    return found[0]


@pytest.fixture(scope="module", params=SUPPORTED_VERSIONS)
def src(request: pytest.FixtureRequest) -> Source:
    return Source(_download(request.param))


def _params(fn: ast.FunctionDef) -> list[str]:
    return [a.arg for a in fn.args.posonlyargs + fn.args.args]


def test_every_hook_target_exists(src: Source) -> None:
    for hook in HOOKS:
        assert isinstance(src.find(hook.target), ast.FunctionDef), hook.target


def test_configure_capture_takes_the_model_by_keyword(src: Source) -> None:
    fn = src.find(HOOKS[0].target)
    assert "model" in [a.arg for a in fn.args.kwonlyargs]


def test_model_runner_configures_capture_with_a_model_keyword(src: Source) -> None:
    calls = [
        node
        for node in ast.walk(src.tree(SRT + "model_executor/model_runner.py"))
        if isinstance(node, ast.Call)
        and getattr(node.func, "id", "") == HOOKS[0].target.split(".")[-1]
    ]
    assert calls and all("model" in {k.arg for k in c.keywords} for c in calls)


def test_hidden_states_to_store_has_the_hooked_positional_order(src: Source) -> None:
    fn = src.find(HOOKS[1].target)
    assert _params(fn) == [
        "self", "hidden_states", "hidden_states_before_norm", "aux_hidden_states", "pruned_states",
        "pruned_states_before_norm", "aux_pruned_states", "sample_indices", "logits_metadata",
    ]  # fmt: skip


def test_hidden_states_to_store_is_called_with_metadata_last(src: Source) -> None:
    forward = src.find("sglang.srt.layers.logits_processor.LogitsProcessor.forward")
    calls = [
        n
        for n in ast.walk(forward)
        if isinstance(n, ast.Call) and getattr(n.func, "attr", "") == "_get_hidden_states_to_store"
    ]
    assert calls
    for call in calls:
        last = call.args[-1] if call.args else None
        named = {k.arg for k in call.keywords}
        assert getattr(last, "id", None) == "logits_metadata" or "logits_metadata" in named


def test_forward_batch_generation_takes_the_schedule_batch_first(src: Source) -> None:
    assert _params(src.find(HOOKS[2].target))[:2] == ["self", "batch"]


def test_schedule_batch_and_req_have_the_fields_the_planner_reads(src: Source) -> None:
    batch = src.attributes("sglang.srt.managers.schedule_batch.ScheduleBatch")
    assert {"reqs", "extend_lens", "prefix_lens", "decoding_reqs", "forward_mode"} <= batch
    req = src.attributes("sglang.srt.managers.schedule_batch.Req")
    assert {"rid", "origin_input_ids", "output_ids"} <= req
    modes = src.attributes("sglang.srt.model_executor.forward_batch_info.ForwardMode")
    assert {"EXTEND", "MIXED"} <= modes


def test_outputs_carry_hidden_states_and_the_scheduler_its_worker(src: Source) -> None:
    out = src.attributes("sglang.srt.layers.logits_processor.LogitsProcessorOutput")
    assert "hidden_states" in out
    assert "logits_output" in src.attributes("sglang.srt.managers.utils.GenerationBatchResult")
    assert {"tp_worker", "server_args"} <= src.attributes("sglang.srt.managers.scheduler.Scheduler")
    runner = src.attributes("sglang.srt.model_executor.model_runner.ModelRunner")
    assert "dtype" in runner


def test_parallel_context_exposes_the_ranks_the_plugin_reads(src: Source) -> None:
    assert isinstance(src.find("sglang.srt.runtime_context.get_parallel"), ast.FunctionDef)
    # 0.5.17 has a property per name; 0.5.23 resolves names dynamically from string tables.
    module = src.tree(SRT + "runtime_context.py")
    strings = {n.value for n in ast.walk(module) if isinstance(n, ast.Constant)}
    names = src.attributes("sglang.srt.runtime_context.ParallelContext") | strings
    assert {"attn_tp_rank", "attn_cp_rank", "attn_cp_size", "tp_rank", "pp_size"} <= names


def test_capture_mode_helpers_exist(src: Source) -> None:
    fib = "sglang.srt.model_executor.forward_batch_info."
    assert isinstance(src.find(fib + "get_server_return_hidden_states_mode"), ast.FunctionDef)
    assert "is_full" in src.attributes(fib + "CaptureHiddenMode")


def test_llama_can_be_told_which_layers_to_capture(src: Source) -> None:
    fn = src.find("sglang.srt.models.llama.LlamaForCausalLM.set_eagle3_layers_to_capture")
    assert _params(fn)[:2] == ["self", "layer_ids"]
    assert "layers_to_capture" in src.attributes("sglang.srt.models.llama.LlamaModel")


def test_hook_registry_api_matches(src: Source) -> None:
    reg = "sglang.srt.plugins.hook_registry."
    assert _params(src.find(reg + "HookRegistry.register"))[:4] == [
        "cls",
        "target",
        "hook",
        "hook_type",
    ]
    assert {"apply_hooks", "_patched"} <= src.attributes(reg + "HookRegistry")
    assert {"AFTER", "AROUND"} <= src.attributes(reg + "HookType")


def test_scheduler_processes_load_plugins(src: Source) -> None:
    fn = src.find("sglang.srt.managers.scheduler.run_scheduler_process")
    called = {getattr(n.func, "id", "") for n in ast.walk(fn) if isinstance(n, ast.Call)}
    assert "load_plugins" in called


def test_launcher_entry_points_exist(src: Source) -> None:
    launch = src.find("sglang.srt.entrypoints.http_server.launch_server")
    assert "run_scheduler_process_func" in _params(launch)
    assert isinstance(src.find("sglang.srt.server_args.prepare_server_args"), ast.FunctionDef)
    assert isinstance(src.find("sglang.srt.plugins.load_plugins"), ast.FunctionDef)
