"""Exports, read back the way each trainer's reader reads them, and compared with the store.

The trainers' readers are reproduced below, key and shape checks included, each citing its
source (sgl-project/SpecForge at a6b6b02, 0.2.0, and vllm-project/speculators at c05b95b), so that
the default suite needs neither trainer; tests/interop (`nox -s interop`) runs the real ones.
"""

from __future__ import annotations

import json
import os
import resource
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from store_crash_writer import make_sample
from typer.testing import CliRunner

from hsdump import DumpMeta, ExportError, HiddenStates, ProducerInfo, export_store, open_store
from hsdump.testing import cli_app

N = 6


def _with_norm(hs: HiddenStates, final_norm: str, model: str = "org/model") -> HiddenStates:
    t, k, h = hs.aux_hidden_states.shape
    hs.meta = DumpMeta(
        rid=f"r-{hs.sample_id}",
        input_ids=hs.input_ids.tolist(),
        num_tokens=t,
        layer_ids=hs.layer_ids,
        final_norm=final_norm,  # type: ignore[arg-type]
        hidden_size=h,
        dtype="bfloat16",
        aux_shape=(t, k, h),
        final_shape=(t, h),
        producer=ProducerInfo(name="test", version="1"),
        model_path=model,
    )
    return hs


def _store(path: Path, final_norm: str | None, numbers: range = range(N)) -> Path:
    with open_store(path, "a", shard_tokens=256, chunk_tokens=16) as store:
        for i in numbers:
            hs = make_sample(i)
            store.write(_with_norm(hs, final_norm) if final_norm else hs, if_exists="skip")
    return path


@pytest.fixture(scope="module")
def post_norm(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _store(tmp_path_factory.mktemp("post") / "s.zarr", "post_norm")


@pytest.fixture(scope="module")
def pre_norm(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _store(tmp_path_factory.mktemp("pre") / "s.zarr", "pre_norm")


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16)


def _exported_ids(out: Path) -> list[str]:
    return list(json.loads((out / "hsdump-export.json").read_text())["sample_ids"])


def _want(sample_id: str) -> HiddenStates:
    return make_sample(int(sample_id.removeprefix("s")))


def _want_mask(hs: HiddenStates) -> torch.Tensor:
    return (
        hs.loss_mask if hs.loss_mask is not None else torch.ones(hs.num_tokens, dtype=torch.uint8)
    )


# -- SpecForge's reader ----------------------------------------------------------------------


def specforge_list_local_files(path: Path) -> list[str]:
    """specforge/data/preprocessing.py: list_local_files (suffixes default)."""
    suffixes = [".ckpt", ".ckpt.gz"]
    datapaths = [os.path.join(root, f) for root, _, files in os.walk(path) for f in files]
    datapaths = [f for f in datapaths if any(f.endswith(s) for s in suffixes)]
    datapaths.sort()
    return datapaths


def specforge_load(path: str) -> dict[str, torch.Tensor]:
    """specforge/runtime/data_plane/feature_store.py: load_feature_file, then the key and tensor
    checks of specforge/runtime/data_plane/offline_reader.py: _inspect_feature_file."""
    raw = torch.load(path, weights_only=False, mmap=True)
    keys = ("input_ids", "loss_mask", "hidden_state", "aux_hidden_state")  # _OFFLINE_EAGLE3_KEYS
    missing = [key for key in keys if key not in raw]
    if missing:
        raise KeyError(f"{path} missing required offline feature keys {missing}")
    for key in keys:
        assert hasattr(raw[key], "shape") and hasattr(raw[key], "dtype"), key
    return raw


def specforge_normalize(raw: dict[str, torch.Tensor], max_len: int) -> dict[str, torch.Tensor]:
    """specforge/algorithms/eagle3/data.py: normalize_offline_sample."""
    hidden_state = raw["aux_hidden_state"].squeeze(0)[:max_len].unsqueeze(0)
    target = raw["hidden_state"].squeeze(0)[:max_len].unsqueeze(0)
    input_ids = raw["input_ids"][:max_len].unsqueeze(0)
    loss_mask = raw["loss_mask"][:max_len].clone().unsqueeze(0)
    if loss_mask.numel() > 0:
        loss_mask[0, -1] = 0
    return {
        "attention_mask": torch.ones_like(loss_mask, dtype=torch.long),
        "loss_mask": loss_mask,
        "target": target,
        "hidden_state": hidden_state,
        "input_ids": input_ids,
    }


def test_specforge_export_reads_back_as_specforge_reads_it(post_norm: Path, tmp_path: Path) -> None:
    out = tmp_path / "sf"
    summary = export_store(post_norm, out, format="specforge")
    assert summary.complete and summary.written == N and summary.layer_ids == [1, 4, 6]

    files = specforge_list_local_files(out)
    assert len(files) == N
    order = _exported_ids(out)
    for path in files:
        assert Path(path).parent.name == "rows_0-2000"
        sample_id = order[int(Path(path).stem.removeprefix("data_"))]
        want = _want(sample_id)
        raw = specforge_load(path)
        t, k, h = want.aux_hidden_states.shape
        assert raw["input_ids"].dtype == raw["loss_mask"].dtype == torch.int64
        assert raw["hidden_state"].shape == (1, t, h)
        assert raw["aux_hidden_state"].shape == (1, t, k * h)
        for tensor in raw.values():  # nothing beyond the tensor itself is stored
            assert tensor.untyped_storage().nbytes() == tensor.numel() * tensor.element_size()
        assert torch.equal(raw["input_ids"], want.input_ids)
        assert torch.equal(raw["loss_mask"], _want_mask(want).long())
        item = specforge_normalize(raw, max_len=2048)
        assert torch.equal(_bits(item["target"][0]), _bits(want.final_hidden_state))
        aux = want.aux_hidden_states.reshape(t, k * h)
        assert torch.equal(_bits(item["hidden_state"][0]), _bits(aux))


# -- speculators' reader ---------------------------------------------------------------------


def speculators_items(out: Path) -> Iterator[tuple[int, dict[str, torch.Tensor]]]:
    """src/speculators/train/data.py: ArrowDataset (__init__, _compute_approx_lengths and
    _get_raw_data), through hs_connectors/src/hs_connectors/transfer.py: FileTransfer.get_cached
    and src/speculators/data_generation/offline.py: check_hidden_states."""
    from datasets import load_from_disk
    from safetensors.torch import load_file

    data = load_from_disk(str(out))
    approx_lengths = list(data.with_format(None)["seq_len"])
    for index in range(len(data)):
        loaded_hs = load_file(out / "hidden_states" / f"hs_{index}.safetensors")
        missing = {"token_ids", "hidden_states"} - loaded_hs.keys()
        assert not missing, f"Hidden-state payload is missing keys: {missing}"
        tokens = data[index]["input_ids"].tolist()
        assert loaded_hs["token_ids"].tolist() == tokens
        assert loaded_hs["hidden_states"].shape[0] == len(tokens) == approx_lengths[index]
        assert torch.equal(loaded_hs["token_ids"], data[index]["input_ids"])
        yield (
            index,
            {
                "hidden_states": loaded_hs["hidden_states"][:, :-1].flatten(1),
                "input_ids": loaded_hs["token_ids"],
                "verifier_last_hidden_states": loaded_hs["hidden_states"][:, -1],
                "loss_mask": data[index]["loss_mask"],
            },
        )


def test_speculators_export_reads_back_as_speculators_reads_it(
    pre_norm: Path, tmp_path: Path
) -> None:
    out = tmp_path / "sp"
    summary = export_store(pre_norm, out, format="speculators")
    assert summary.complete and summary.written == N and summary.layer_ids == [2, 5, 7]

    order = _exported_ids(out)
    seen = 0
    for index, item in speculators_items(out):
        want = _want(order[index])
        assert item["hidden_states"].dtype == torch.bfloat16
        assert torch.equal(_bits(item["hidden_states"]), _bits(want.aux_hidden_states.flatten(1)))
        assert torch.equal(
            _bits(item["verifier_last_hidden_states"]), _bits(want.final_hidden_state)
        )
        assert torch.equal(item["input_ids"], want.input_ids)
        assert torch.equal(item["loss_mask"], _want_mask(want).long())
        seen += 1
    assert seen == N

    frequencies = torch.load(out / "token_freq.pt", weights_only=True)
    want_freq: dict[int, int] = {}
    for sample_id in order:
        hs = _want(sample_id)
        for token in hs.input_ids[_want_mask(hs).bool()].tolist():
            want_freq[token] = want_freq.get(token, 0) + 1
    assert frequencies == want_freq


# -- conventions -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("stored", "fmt", "message"),
    [
        ("post_norm", "speculators", r"verifier's norm.*before the norm.*post-norm.*cannot be"),
        ("pre_norm", "specforge", r"only lm_head.*post-norm.*holds it before the norm"),
        (None, "specforge", r"does not record whether its final state is post-norm"),
    ],
)
def test_a_final_state_the_trainer_cannot_use_is_refused_naming_the_difference(
    tmp_path: Path, stored: str | None, fmt: str, message: str
) -> None:
    store = _store(tmp_path / "s.zarr", stored, range(2))
    with pytest.raises(ExportError, match=message):
        export_store(store, tmp_path / "out", format=fmt)  # type: ignore[arg-type]
    assert not (tmp_path / "out").exists()


def test_a_store_without_a_record_exports_once_told_what_its_final_state_is(
    tmp_path: Path,
) -> None:
    store = _store(tmp_path / "s.zarr", None, range(2))
    summary = export_store(store, tmp_path / "out", format="specforge", final_norm="post_norm")
    assert summary.written == 2
    recorded = _store(tmp_path / "p.zarr", "post_norm", range(1))
    with pytest.raises(ExportError, match=r"'pre_norm' was given.*records 'post_norm'"):
        export_store(recorded, tmp_path / "o2", format="specforge", final_norm="pre_norm")


def test_specforge_refuses_other_than_three_aux_layers(tmp_path: Path) -> None:
    with open_store(tmp_path / "s.zarr", "a") as store:
        store.write(_with_norm(make_sample(1, layers=[2, 5]), "post_norm"))
    with pytest.raises(ExportError, match=r"three aux layers.*holds 2 \(layer_ids \[2, 5\]\)"):
        export_store(tmp_path / "s.zarr", tmp_path / "out", format="specforge")


# -- resume, atomicity, subsets --------------------------------------------------------------


def _files(out: Path) -> dict[str, int]:
    return {p.name: p.stat().st_ino for p in out.rglob("data_*.ckpt")}


def test_a_rerun_skips_complete_files_rewrites_a_missing_one_and_drops_partials(
    post_norm: Path, tmp_path: Path
) -> None:
    out = tmp_path / "sf"
    export_store(post_norm, out, format="specforge")
    before = _files(out)
    (out / "rows_0-2000" / "data_3.ckpt").unlink()
    leftover = out / "rows_0-2000" / "data_4.ckpt.1234.partial"
    leftover.write_bytes(b"half a file")

    summary = export_store(post_norm, out, format="specforge")
    assert (summary.written, summary.skipped) == (1, N - 1)
    after = _files(out)
    assert after.keys() == before.keys() and not leftover.exists()
    assert all(after[name] == before[name] for name in before if name != "data_3.ckpt")
    specforge_load(str(out / "rows_0-2000" / "data_3.ckpt"))


def test_a_failed_write_leaves_only_whole_files_and_a_rerun_completes(
    post_norm: Path, tmp_path: Path
) -> None:
    out = tmp_path / "sf"
    export_store(post_norm, out, format="specforge", sample_ids=["s0"])  # the manifest exists
    sizes = sorted(make_sample(i).nbytes for i in range(N))
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    previous = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit: EFBIG
    resource.setrlimit(resource.RLIMIT_FSIZE, (sizes[N // 2], hard))
    try:
        with pytest.raises(ExportError, match=r"writing the export in .*File too large.*rerun"):
            export_store(post_norm, out, format="specforge", sample_ids=[f"s{i}" for i in range(N)])
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, previous)
    assert not list(out.rglob("*.partial"))
    kept = specforge_list_local_files(out)
    assert 1 <= len(kept) < N
    for path in kept:
        specforge_load(path)

    summary = export_store(
        post_norm, out, format="specforge", sample_ids=[f"s{i}" for i in range(N)]
    )
    assert (summary.written, summary.skipped) == (N - len(kept), len(kept))


def test_an_export_killed_in_the_middle_of_a_file_leaves_no_partial_file_under_its_name(
    post_norm: Path, tmp_path: Path
) -> None:
    out = tmp_path / "sf"
    limit = sorted(make_sample(i).nbytes for i in range(N))[N // 2]

    # The child writes past the size limit inside a file and is killed there by SIGXFSZ (which
    # Python ignores unless told otherwise).
    code = (
        "import resource, signal, sys, hsdump\n"
        "signal.signal(signal.SIGXFSZ, signal.SIG_DFL)\n"
        "resource.setrlimit(resource.RLIMIT_FSIZE, (int(sys.argv[3]), resource.RLIM_INFINITY))\n"
        "hsdump.export_store(sys.argv[1], sys.argv[2], format='specforge')\n"
    )
    child = subprocess.run(
        [sys.executable, "-c", code, str(post_norm), str(out), str(limit)],
        capture_output=True,
        check=False,
    )
    assert child.returncode == -signal.SIGXFSZ, child.stderr.decode()[-2000:]
    kept = specforge_list_local_files(out)
    for path in kept:
        specforge_load(path)
    assert list(out.rglob("*.partial")), "the kill should land inside a file"

    summary = export_store(post_norm, out, format="specforge")
    assert (summary.written, summary.skipped) == (N - len(kept), len(kept))
    assert not list(out.rglob("*.partial"))


def test_an_export_of_listed_ids_keeps_their_order_and_a_rerun_may_only_append(
    tmp_path: Path,
) -> None:
    store = _store(tmp_path / "s.zarr", "pre_norm", range(3))
    out = tmp_path / "sp"
    export_store(store, out, format="speculators", sample_ids=["s2", "s0"])
    assert [_exported_ids(out)[i] for i, _ in speculators_items(out)] == ["s2", "s0"]

    with pytest.raises(ExportError, match=r"index 0 is sample 's2', this run puts 's0'"):
        export_store(store, out, format="speculators", sample_ids=["s0", "s2"])
    _store(store, "pre_norm", range(5))  # two more samples committed since
    summary = export_store(store, out, format="speculators")
    assert (summary.written, summary.skipped) == (3, 2)
    order = _exported_ids(out)
    assert order[:2] == ["s2", "s0"] and sorted(order) == [f"s{i}" for i in range(5)]
    for index, item in speculators_items(out):
        assert torch.equal(item["input_ids"], _want(order[index]).input_ids)


def test_a_directory_that_is_not_an_export_of_this_kind_is_refused(
    post_norm: Path, tmp_path: Path
) -> None:
    (tmp_path / "foreign").mkdir()
    (tmp_path / "foreign" / "data_0.ckpt").write_bytes(b"someone else's")
    with pytest.raises(ExportError, match=r"holds files but no hsdump-export.json"):
        export_store(post_norm, tmp_path / "foreign", format="specforge")
    export_store(post_norm, tmp_path / "sf", format="specforge", sample_ids=["s1"])
    with pytest.raises(ExportError, match=r"holds a specforge export, not speculators"):
        export_store(post_norm, tmp_path / "sf", format="speculators")
    with open_store(tmp_path / "other.zarr", "a") as other:
        other.write(_with_norm(make_sample(1), "post_norm", model="org/other-model"))
    with pytest.raises(ExportError, match=r"store with other settings \(differing: model_path\)"):
        export_store(tmp_path / "other.zarr", tmp_path / "sf", format="specforge")


# -- the command line ------------------------------------------------------------------------


def test_the_export_command_writes_listed_ids_and_names_the_layer_ids_to_train_with(
    post_norm: Path, tmp_path: Path
) -> None:
    ids = tmp_path / "ids.txt"
    ids.write_text("s4\n\n# a comment\ns1\n")
    out = tmp_path / "sf"
    result = CliRunner().invoke(
        cli_app, ["export", str(post_norm), str(out), "--format", "specforge", "--ids", str(ids)]
    )
    assert result.exit_code == 0, result.output
    assert "exported 2 samples" in result.output
    assert "model.aux_hidden_state_layer_ids [1, 4, 6]" in result.output
    assert _exported_ids(out) == ["s4", "s1"] and len(specforge_list_local_files(out)) == 2


def test_the_export_command_reports_a_refusal_or_a_bad_ids_file_in_one_line(
    post_norm: Path, tmp_path: Path
) -> None:
    runner = CliRunner()
    args = ["export", str(post_norm), str(tmp_path / "sp"), "--format", "speculators"]
    result = runner.invoke(cli_app, args)
    assert result.exit_code == 2 and "error:" in result.output and "post-norm" in result.output
    assert "Traceback" not in result.output

    ids = tmp_path / "ids.txt"
    ids.write_text("s1\ns2\ns1\n")
    result = runner.invoke(cli_app, [*args[:-1], "specforge", "--ids", str(ids)])
    assert result.exit_code == 2 and "ids.txt:3: sample id 's1' is listed twice" in result.output
