"""hsdump's speculators export and `SpeculatorsCollate`, against the real speculators==0.9.0.

Skipped unless speculators is importable: `nox -s interop` installs it. Its trainer runs on CPU
here with two device patches: the model and batches go to "cpu" instead of the local rank's
accelerator, and the step timer's accelerator synchronisation is skipped.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file
from torch.utils.data import DataLoader

from hsdump import ExportError, HiddenStateDataset, SpeculatorsCollate, export_store, open_store

hs_connectors = pytest.importorskip("hs_connectors")
sp_data = pytest.importorskip("speculators.train.data")
sp_dataloader = pytest.importorskip("speculators.train.dataloader")
sp_sampler = pytest.importorskip("speculators.train.distributed_batch_sampler")
from speculators.models.eagle3.data import shift_batch  # noqa: E402

pytestmark = [
    # speculators' loaders pin memory and autocast for CUDA; on CPU torch says it skips both.
    pytest.mark.filterwarnings("ignore:'pin_memory' argument is set as true:UserWarning"),
    pytest.mark.filterwarnings("ignore:CUDA is not available:UserWarning"),
    # speculators' progress bar, which it silences itself at import (pytest undoes that).
    pytest.mark.filterwarnings("ignore::tqdm.TqdmExperimentalWarning"),
]

TOTAL_SEQ_LEN = 48  # below the sum of a few samples: packing cuts and drops items
DOCS = Path(__file__).resolve().parents[2] / "docs" / "training.md"


@pytest.fixture(scope="module")
def export(pre_norm: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("speculators") / "data"
    summary = export_store(pre_norm, out, format="speculators")
    assert summary.layer_ids == [2, 4, 5]  # vLLM counts as transformers does
    return out


def _order(export: Path) -> list[str]:
    return list(json.loads((export / "hsdump-export.json").read_text())["sample_ids"])


def _assert_bit_equal(got: dict[str, Any], want: dict[str, Any]) -> None:
    assert sorted(got) == sorted(want)
    for key, value in want.items():
        if not isinstance(value, torch.Tensor):
            assert got[key] == value, key
            continue
        assert got[key].dtype == value.dtype and got[key].shape == value.shape, key
        assert torch.equal(got[key].view(torch.uint8), value.view(torch.uint8)), key


def test_each_exported_file_reads_back_in_file_transfer_and_arrow_dataset(
    export: Path, pre_norm: Path
) -> None:
    transfer = hs_connectors.FileTransfer(export / "hidden_states")
    dataset = sp_data.ArrowDataset(max_len=64, datapath=str(export), on_missing="raise")
    order = _order(export)
    assert len(dataset) == len(order) == 12
    with open_store(pre_norm, "r") as store:
        for idx, sample_id in enumerate(order):
            hs = store.get(sample_id)
            raw = transfer.get_cached(idx)
            assert torch.equal(raw["token_ids"], hs.input_ids)
            assert torch.equal(raw["hidden_states"][:, :-1], hs.aux_hidden_states)
            assert torch.equal(raw["hidden_states"][:, -1], hs.final_hidden_state)
            item = dataset[idx]
            assert torch.equal(item["loss_mask"], hs.loss_mask.long())
            assert torch.equal(item["hidden_states"], hs.aux_hidden_states.flatten(1))
            assert torch.equal(item["verifier_last_hidden_states"], hs.final_hidden_state)


def test_adapter_batches_equal_the_trainers_loader_batches(export: Path, pre_norm: Path) -> None:
    """create_train_val_loaders (ArrowDataset, multipack sampler, CollateFn with shift_batch)
    against a DataLoader over the store with the same sampler and `SpeculatorsCollate`."""
    theirs = dict(zip(("train", "val"), _their_loaders(str(export)), strict=True))
    ours = dict(zip(("train", "val"), _our_loaders(pre_norm, _order(export), seed=0), strict=True))
    packed = 0
    for split in ("train", "val"):
        got, want = list(ours[split]), list(theirs[split])
        assert len(got) == len(want) > 0
        for our_batch, their_batch in zip(got, want, strict=True):
            _assert_bit_equal(our_batch, their_batch)
            packed += int(their_batch["document_ids"].max()) >= 1
    assert packed  # some batches hold several items


def test_packing_that_cuts_an_item_matches_collate_fn(export: Path, pre_norm: Path) -> None:
    dataset = sp_data.ArrowDataset(max_len=64, datapath=str(export), on_missing="raise")
    collate_fn = sp_data.CollateFn(TOTAL_SEQ_LEN, 256, preprocess=shift_batch)
    ours = HiddenStateDataset(pre_norm, sample_ids=_order(export))
    collate = SpeculatorsCollate(ours, total_seq_len=TOTAL_SEQ_LEN)
    # 39 + 32 shifted rows (the second is cut); 16 + 4 + 8 + 23 (the last is cut); one row
    for batch in ([6, 2], [0, 1, 3, 4], [5], [2, 5, 8]):
        want = collate_fn([dataset[i] for i in batch])
        _assert_bit_equal(collate([ours[i] for i in batch]), want)


def test_the_docs_token_frequencies_equal_the_exports(
    export: Path, pre_norm: Path, tmp_path: Path, monkeypatch: Any
) -> None:
    (code,) = [b for b in _docs_blocks() if "bincount" in b]
    (tmp_path / "work").mkdir()
    monkeypatch.chdir(tmp_path)
    exec(code.replace('"hs.zarr"', repr(str(pre_norm))), {"vocab_size": 2048})
    want = torch.load(export / "token_freq.pt", weights_only=True)
    assert torch.load(tmp_path / "work" / "token_freq.pt", weights_only=True) == want


def test_one_training_step_from_the_store_equals_one_from_the_export(
    export: Path, pre_norm: Path, verifier: tuple[object, Path], tmp_path: Path
) -> None:
    """`python -m speculators.train` on the export, and the docs' script that runs it with its
    loaders reading the store: the same weights and validation losses come out."""
    (script,) = [b for b in _docs_blocks() if "train_from_store.py" in b]
    (tmp_path / "train_from_store.py").write_text(script)
    (tmp_path / "work").mkdir()
    flags = _train_flags(verifier[1])
    from_export = _train(["speculators.train", "--data-path", str(export), *flags], tmp_path / "e")
    script_args = [str(tmp_path / "train_from_store.py"), str(pre_norm)]
    work = [
        "--data-path",
        str(tmp_path / "work"),
        "--token-freq-path",
        str(export / "token_freq.pt"),
    ]
    from_store = _train([*script_args, *work, *flags], tmp_path / "s")
    assert from_export["metrics"] == from_store["metrics"]
    assert from_export["metrics"]["loss_epoch"] > 0
    assert from_export["weights"].keys() == from_store["weights"].keys()
    for name, weight in from_export["weights"].items():
        assert torch.equal(weight, from_store["weights"][name]), name


@pytest.mark.skipif(
    not os.environ.get("HSDUMP_SGLANG_STORE"),
    reason="HSDUMP_SGLANG_STORE names no store that real SGLang wrote (tests/gpu/run.sh pre_llama)",
)
def test_a_store_real_sglang_wrote_exports_into_speculators_readers(tmp_path: Path) -> None:
    """The store of `tests/gpu/run.sh pre_llama` (SGLang with HSDUMP_FINAL_NORM=pre_norm)."""
    store = Path(os.environ["HSDUMP_SGLANG_STORE"])
    export_store(store, tmp_path / "data", format="speculators")
    transfer = hs_connectors.FileTransfer(tmp_path / "data" / "hidden_states")
    dataset = sp_data.ArrowDataset(
        max_len=1 << 16, datapath=str(tmp_path / "data"), on_missing="raise"
    )
    order = _order(tmp_path / "data")
    with open_store(store, "r") as opened:
        provenance = opened.provenance
        assert provenance is not None and provenance.producer_name == "sglang_patch"
        assert provenance.final_norm == "pre_norm" and len(order) == len(opened) > 0
        for idx, sample_id in enumerate(order):
            hs, raw, item = opened.get(sample_id), transfer.get_cached(idx), dataset[idx]
            assert torch.equal(raw["token_ids"], hs.input_ids)
            assert torch.equal(raw["hidden_states"][:, :-1], hs.aux_hidden_states)
            assert torch.equal(item["verifier_last_hidden_states"], hs.final_hidden_state)
    SpeculatorsCollate(HiddenStateDataset(store), total_seq_len=TOTAL_SEQ_LEN)  # accepts it


def test_the_adapter_refuses_a_post_norm_store_naming_the_setting(post_norm: Path) -> None:
    with pytest.raises(ExportError, match=r"verifier's norm.*HSDUMP_FINAL_NORM=pre_norm"):
        SpeculatorsCollate(HiddenStateDataset(post_norm), total_seq_len=TOTAL_SEQ_LEN)


def _their_loaders(data_path: str) -> tuple[DataLoader, DataLoader]:
    return sp_dataloader.create_train_val_loaders(
        data_path=data_path,
        total_seq_len=TOTAL_SEQ_LEN,
        hidden_states_dtype=torch.bfloat16,
        vllm_endpoint="http://127.0.0.1:9/v1",
        on_missing="raise",
        verifier_name_or_path="unused",
        request_timeout=1.0,
        max_retries=0,
        generation_validation_retries=0,
        max_consecutive_generation_failures=1,
        hidden_size=256,
        num_target_layers=3,
        num_workers=0,
        prefetch_factor=1,
        preprocess=shift_batch,
        seed=0,
    )


def _our_loaders(store: Path, order: list[str], *, seed: int) -> tuple[DataLoader, DataLoader]:
    """What the docs' recipe builds: the trainer's split (0.9) and sampler; the training
    batches shuffled with the run's seed, the validation ones with 0."""
    split = int(len(order) * 0.9)
    return _our_loader(store, order[:split], seed=seed), _our_loader(store, order[split:], seed=0)


def _our_loader(store: Path, ids: list[str], *, seed: int) -> DataLoader:
    dataset = HiddenStateDataset(store, sample_ids=ids)
    sampler = sp_sampler.MultipackDistributedBatchSamplerV2(
        batch_max_length=TOTAL_SEQ_LEN, lengths=dataset.lengths, num_replicas=1, rank=0, seed=seed
    )
    collate = SpeculatorsCollate(dataset, total_seq_len=TOTAL_SEQ_LEN)
    return DataLoader(dataset, batch_sampler=sampler, collate_fn=collate)


# speculators' trainer on the CPU: the model and batches go to "cpu" instead of the local rank's
# accelerator, and the step timer does not synchronise one. Then the module or script runs.
_ON_CPU = """
import runpy, sys, torch
import speculators.train.trainer as trainer
trainer.get_local_rank = lambda: "cpu"
torch.accelerator.synchronize = lambda device=None: None
target = sys.argv.pop(1)
sys.argv[0] = target
if target.endswith(".py"):
    runpy.run_path(target, run_name="__main__")
else:
    runpy.run_module(target, run_name="__main__", alter_sys=True)
"""


def _train_flags(verifier: Path) -> list[str]:
    return [
        "--verifier-name-or-path", str(verifier),
        "--total-seq-len", str(TOTAL_SEQ_LEN), "--max-steps", "1", "--epochs", "1",
        "--loss-implementation", "eager", "--draft-attn-impl", "sdpa",
        "--on-missing", "raise", "--num-workers", "0", "--target-layer-ids", "2", "4", "5",
        "--draft-vocab-size", "256", "--mask-token-id", "0", "--hidden-states-dtype", "bfloat16",
    ]  # fmt: skip


def _train(args: list[str], out: Path) -> dict[str, Any]:
    """One step and a validation pass; single-threaded, so both runs sum in the same order."""
    save = ["--save-path", str(out / "ckpt"), "--log-dir", str(out / "logs")]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    run = subprocess.run(
        [sys.executable, "-c", _ON_CPU, *args, *save], env=env, capture_output=True, text=True
    )
    assert run.returncode == 0, run.stderr[-3000:]
    checkpoint = out / "ckpt" / "0"
    return {
        "metrics": json.loads((checkpoint / "val_metrics.json").read_text()),
        "weights": load_file(checkpoint / "model.safetensors"),
    }


def _docs_blocks() -> list[str]:
    """The python blocks of docs/training.md's speculators section."""
    text = DOCS.read_text()
    start = text.index("\n## speculators\n")
    section = text[start : text.index("\n## ", start + 1)]
    return re.findall(r"```python\n(.*?)```", section, flags=re.S)
