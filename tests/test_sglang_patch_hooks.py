"""The hooks wired through SGLang's real ``HookRegistry`` into stand-in SGLang modules.

SGLang does not run without a GPU, but its ``hook_registry.py`` is pure Python: it is taken from
the 0.5.17 wheel (downloaded as in test_sglang_patch_source.py) and placed in a small stand-in
``sglang`` package whose hooked functions have the real signatures (checked there). Each test runs
in a fresh interpreter, since the registry patches modules process-wide.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import numpy as np
import pytest
from test_sglang_patch_source import _download

from hsdump.testing import read_dump

REPO = Path(__file__).resolve().parents[1]

STANDINS = {
    "sglang/__init__.py": "__version__ = '{version}'\n",
    "sglang/srt/__init__.py": "",
    "sglang/srt/plugins/__init__.py": "",
    "sglang/srt/managers/__init__.py": "",
    "sglang/srt/layers/__init__.py": "",
    "sglang/srt/model_executor/__init__.py": "",
    "sglang/srt/model_executor/model_runner_components/__init__.py": "",
    "sglang/srt/runtime_context.py": """
        from types import SimpleNamespace
        PARALLEL = SimpleNamespace(
            attn_tp_rank=0, attn_cp_rank=0, attn_cp_size=1, tp_rank=0, pp_size=1)
        def get_parallel():
            return PARALLEL
    """,
    "sglang/srt/model_executor/forward_batch_info.py": """
        import enum
        class CaptureHiddenMode(enum.IntEnum):
            NULL = 0
            LAST = 1
            FULL = 2
            def is_full(self):
                return self == CaptureHiddenMode.FULL
        def get_server_return_hidden_states_mode(server_args):
            full = server_args.enable_return_hidden_states
            return CaptureHiddenMode.FULL if full else CaptureHiddenMode.NULL
    """,
    "sglang/srt/model_executor/model_runner_components/attention_backend_setup.py": """
        def configure_aux_hidden_state_capture(*, model, eagle_use_aux_hidden_state,
                eagle_aux_hidden_state_layer_ids, dflash_use_aux_hidden_state,
                dflash_target_layer_ids, is_dspark):
            if eagle_use_aux_hidden_state:
                model.set_eagle3_layers_to_capture(eagle_aux_hidden_state_layer_ids)
    """,
    "sglang/srt/layers/logits_processor.py": """
        import torch
        class LogitsProcessor:
            def _get_hidden_states_to_store(self, hidden_states, hidden_states_before_norm,
                    aux_hidden_states, pruned_states, pruned_states_before_norm,
                    aux_pruned_states, sample_indices, logits_metadata):
                if aux_hidden_states is not None and logits_metadata.capture_hidden_mode.is_full():
                    if isinstance(aux_hidden_states, torch.Tensor):  # SGLang's packer
                        return aux_hidden_states
                    return torch.cat(aux_hidden_states, dim=-1)
                return None
    """,
    "sglang/srt/managers/tp_worker.py": """
        from types import SimpleNamespace
        from sglang.srt.layers.logits_processor import LogitsProcessor
        class TpModelWorker:
            def __init__(self, run):
                self.run = run  # batch -> (final [T, H], aux list of [T, H], metadata)
            def forward_batch_generation(self, batch, forward_batch=None, **kwargs):
                final, aux, metadata = self.run(batch)
                stored = LogitsProcessor()._get_hidden_states_to_store(
                    final, None, aux, None, None, None, None, metadata)
                return SimpleNamespace(logits_output=SimpleNamespace(hidden_states=stored))
    """,
    "sglang/srt/managers/scheduler.py": """
        from types import SimpleNamespace
        import torch
        class Scheduler:
            def __init__(self, server_args):
                self.server_args = server_args
                self.tp_worker = SimpleNamespace(model_runner=SimpleNamespace(dtype=torch.float32))
    """,
}

# Runs in the child: builds a Llama-like model, starts a "scheduler", runs prefill batches.
DRIVER = """
import json, logging, os, sys, types
from pathlib import Path
import torch
logging.basicConfig(level=logging.INFO)
from types import SimpleNamespace
from sglang.srt.plugins.hook_registry import HookRegistry
import sglang_patch.plugin as plugin
from sglang.srt.runtime_context import PARALLEL
from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode

SCENARIO = json.loads(sys.argv[1])
H, N = 8, 8
for key, value in SCENARIO.get("parallel", {}).items():
    setattr(PARALLEL, key, value)

class FusedNorm(torch.nn.Module):  # SGLang's RMSNorm given a residual: adds into it in place
    def forward(self, x, residual=None):
        if residual is None:
            return x * 2
        residual.add_(x)
        return residual * 2, residual

class Inner(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.layers_to_capture = []
        if not SCENARIO.get("no_norm"):
            self.norm = FusedNorm()
    def forward(self, aux, pre_norm):  # as a decoder stack ends: the final norm, then the outputs
        half = pre_norm / 2  # the last layer's output and its residual sum to the pre-norm state
        post_norm, _ = self.norm(half, half.clone()) if hasattr(self, "norm") else (half, 0)
        return post_norm, (torch.cat(aux, dim=-1) if SCENARIO.get("packed") else list(aux))

class Model(torch.nn.Module):
    def __init__(self, deepseek):
        super().__init__()
        self.model, self.deepseek = Inner(), deepseek
        self.config = SimpleNamespace(hidden_size=H, num_hidden_layers=N)
        self.capture_aux_hidden_states = False
    def set_eagle3_layers_to_capture(self, layer_ids=None):
        self.capture_aux_hidden_states = True
        if layer_ids is None:
            self.model.layers_to_capture = [2, N // 2, N - 3]
        elif self.deepseek and layer_ids[0] != 1:  # DeepSeek's conditional +1
            self.model.layers_to_capture = list(layer_ids)
        else:
            self.model.layers_to_capture = [i + 1 for i in layer_ids]

plugin.register()
HookRegistry.apply_hooks()
from sglang.srt.model_executor.model_runner_components import attention_backend_setup as abs_
from sglang.srt.managers.scheduler import Scheduler
from sglang.srt.managers.tp_worker import TpModelWorker

core = model = Model(SCENARIO.get("deepseek", False))
if SCENARIO.get("wrapped"):  # like Kimi-K2.5: a multimodal wrapper around the language model
    class Wrapper(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.language_model = core
            self.config = SimpleNamespace(text_config=core.config)
        def set_eagle3_layers_to_capture(self, layer_ids=None):
            self.language_model.set_eagle3_layers_to_capture(layer_ids)
    model = Wrapper()
server_layers = SCENARIO.get("server_layers")  # the server's own EAGLE-3 capture settings
abs_.configure_aux_hidden_state_capture(model=model, eagle_use_aux_hidden_state=bool(server_layers),
    eagle_aux_hidden_state_layer_ids=server_layers, dflash_use_aux_hidden_state=False,
    dflash_target_layer_ids=None, is_dspark=False)
Scheduler(SimpleNamespace(enable_return_hidden_states=SCENARIO.get("full", True), model_path="m"))
layers = list(core.model.layers_to_capture)

def states(n, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(n, H, generator=g) for _ in range(len(layers) + 1)]

def run(batch):
    total = sum(batch.extend_lens) + 2  # two padding rows
    aux_and_final = states(total, batch.seed)
    post_norm, aux = core.model(aux_and_final[:-1], aux_and_final[-1])
    metadata = SimpleNamespace(capture_hidden_mode=CaptureHiddenMode.FULL)
    return post_norm, aux, metadata

class Req:
    def __init__(self, rid, n):
        self.rid, self.origin_input_ids, self.output_ids = rid, list(range(n)), []

worker = TpModelWorker(run)
mode = SimpleNamespace(name="EXTEND")
a, b, c = Req("hsdump-a", 5), Req("plain", 3), Req("hsdump-c", 4)
batch = SimpleNamespace(reqs=[a, b, c], extend_lens=[5, 3, 4], prefix_lens=[0, 0, 0],
                        decoding_reqs=None, forward_mode=mode, seed=1)
if SCENARIO.get("break_dumper"):
    import sglang_patch.hooks as hooks
    hooks.STATE.dumper.on_forward = lambda *a: 1 / 0
result = worker.forward_batch_generation(batch)
import sglang_patch.hooks as hooks
if hooks.STATE.dumper is not None:
    hooks.STATE.dumper.writer.drain()
expected = states(14, 1)
producers = Path(os.environ["HSDUMP_DUMP_DIR"], "_producers")
print(json.dumps({
    "layers": layers,
    "width": list(result.logits_output.hidden_states.shape),
    "a_final": (expected[-1][:5] * 2).tolist(),
    "a_pre_norm": expected[-1][:5].tolist(),
    "c_aux": [e[8:12].tolist() for e in expected[:-1]],
    "manifests": [p.read_text() for p in producers.glob("*.json")],
}))
"""


@pytest.fixture(scope="module")
def hook_registry_source() -> bytes:
    with zipfile.ZipFile(_download("0.5.17")) as wheel:
        return wheel.read("sglang/srt/plugins/hook_registry.py")


def run_server(tmp_path: Path, source: bytes, scenario: dict, *, version: str = "0.5.17", env=None):
    """Build the stand-in tree, run the driver in a fresh interpreter; returns (proc, output)."""
    for rel, text in STANDINS.items():
        path = tmp_path / "site" / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text).replace("{version}", version))
    (tmp_path / "site/sglang/srt/plugins/hook_registry.py").write_bytes(source)
    dump = tmp_path / "dump"
    child_env = {
        **os.environ,
        "PYTHONPATH": f"{tmp_path / 'site'}{os.pathsep}{REPO}",
        "HSDUMP_DUMP_DIR": str(dump),
        **(env or {}),
    }
    proc = subprocess.run(
        [sys.executable, "-c", DRIVER, json.dumps(scenario)],
        capture_output=True,
        text=True,
        env=child_env,
        timeout=60,
    )
    output = json.loads(proc.stdout.strip().splitlines()[-1]) if proc.returncode == 0 else None
    return proc, output, dump


def published(dump: Path) -> list[str]:
    return sorted(p.name for p in dump.glob("req_*"))


def test_a_prefill_is_dumped_through_sglangs_hook_registry(tmp_path, hook_registry_source) -> None:
    proc, out, dump = run_server(tmp_path, hook_registry_source, {})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert out["layers"] == [2, 4, 5] and out["width"] == [14, 4 * 8]
    assert published(dump) == ["req_hsdump-a", "req_hsdump-c"]
    a, c = read_dump(dump / "req_hsdump-a"), read_dump(dump / "req_hsdump-c")
    a_final, c_aux = a.final_hidden_state.numpy(), c.aux_hidden_states.numpy()
    np.testing.assert_array_equal(a_final, np.array(out["a_final"], np.float32))
    np.testing.assert_array_equal(c_aux.transpose(1, 0, 2), np.array(out["c_aux"], np.float32))
    assert a.meta.layer_ids == [2, 4, 5] and a.meta.producer.version == "sglang-0.5.17"
    (text,) = out["manifests"]  # read while the server ran: it is removed when the server exits
    manifest = json.loads(text)
    caps = manifest["capabilities"]
    assert caps["chunked_prefill_assembly"] and caps["prefix_cache_guard"] and caps["row_moments"]
    assert manifest["layer_ids"] == [2, 4, 5] and manifest["dtype"] == "float32"
    assert manifest["final_norm"] == a.meta.final_norm == "post_norm"
    assert not list((dump / "_producers").iterdir())
    assert "hsdump: dump active on tp rank 0" in proc.stderr


@pytest.mark.parametrize(
    "scenario", [{}, {"wrapped": True}, {"packed": True}, {"wrapped": True, "packed": True}]
)
def test_the_pre_norm_final_state_is_dumped_when_asked(tmp_path, hook_registry_source, scenario):
    env = {"HSDUMP_FINAL_NORM": "pre_norm"}
    proc, out, dump = run_server(tmp_path, hook_registry_source, scenario, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    a = read_dump(dump / "req_hsdump-a")
    expected = np.array(out["a_pre_norm"], np.float32)
    np.testing.assert_array_equal(a.final_hidden_state.numpy(), expected)
    assert a.meta.final_norm == "pre_norm"
    assert json.loads(out["manifests"][0])["final_norm"] == "pre_norm"
    assert "+ final (pre_norm)" in proc.stderr


def test_requested_layers_are_recorded_as_the_model_captures_them(tmp_path, hook_registry_source):
    env = {"HSDUMP_LAYER_IDS": "3,5,6"}  # DeepSeek would keep [2,4,5] as is: corrected to ask
    proc, out, dump = run_server(tmp_path, hook_registry_source, {"deepseek": True}, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert out["layers"] == [3, 5, 6]
    assert read_dump(dump / "req_hsdump-a").meta.layer_ids == [3, 5, 6]


def test_only_attention_tp_rank_zero_writes(tmp_path, hook_registry_source) -> None:
    scenario = {"parallel": {"attn_tp_rank": 1, "tp_rank": 1}}
    proc, _, dump = run_server(tmp_path, hook_registry_source, scenario)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert published(dump) == [] and not (dump / "_producers").exists()
    assert "attention-TP rank 0 of this group writes" in proc.stderr


@pytest.mark.parametrize(
    ("scenario", "version", "env", "message"),
    [
        ({"full": False}, "0.5.17", {}, "--enable-return-hidden-states"),
        ({}, "0.4.0", {}, "not a version this plugin was checked against"),
        ({}, "0.5.17", {"HSDUMP_LAYER_IDS": "2,9"}, "must lie in [1, 7]"),
        ({"parallel": {"pp_size": 2}}, "0.5.17", {}, "--pp-size 1"),
        ({}, "0.5.17", {"HSDUMP_FINAL_NORM": "prenorm"}, "HSDUMP_FINAL_NORM='prenorm' is neither"),
        ({"no_norm": True}, "0.5.17", {"HSDUMP_FINAL_NORM": "pre_norm"}, "has no final norm"),
    ],
)
def test_a_server_that_cannot_dump_fails_at_start_up(
    tmp_path, hook_registry_source, scenario, version, env, message
) -> None:
    proc, _, dump = run_server(tmp_path, hook_registry_source, scenario, version=version, env=env)
    assert proc.returncode != 0 and message in proc.stderr
    assert published(dump) == []


def test_a_failing_dumper_never_breaks_the_forward(tmp_path, hook_registry_source) -> None:
    proc, out, _ = run_server(tmp_path, hook_registry_source, {"break_dumper": True})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert out["width"] == [14, 32]
    assert "staging the hidden states of a prefill batch failed" in proc.stderr


def test_a_wrapped_language_model_is_found_and_captured(tmp_path, hook_registry_source) -> None:
    proc, out, dump = run_server(tmp_path, hook_registry_source, {"wrapped": True})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert out["layers"] == [2, 4, 5] and published(dump) == ["req_hsdump-a", "req_hsdump-c"]


def test_layers_the_server_already_captures_are_kept(tmp_path, hook_registry_source) -> None:
    scenario = {"server_layers": [0, 2, 5]}  # llama adds 1: captures [1, 3, 6]
    proc, out, dump = run_server(tmp_path, hook_registry_source, scenario)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert read_dump(dump / "req_hsdump-a").meta.layer_ids == out["layers"] == [1, 3, 6]


def test_layer_ids_that_disagree_with_the_servers_capture_stop_it(tmp_path, hook_registry_source):
    env = {"HSDUMP_LAYER_IDS": "2,4,5"}
    proc, _, _ = run_server(tmp_path, hook_registry_source, {"server_layers": [0, 2, 5]}, env=env)
    assert proc.returncode != 0 and "already captures layers [1, 3, 6]" in proc.stderr
