"""hsdump's SpecForge export and `SpecForgeCollate`, against the real specforge==0.2.0.

Skipped unless SpecForge is importable: `nox -s interop` installs it.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from hsdump import ExportError, HiddenStateDataset, SpecForgeCollate, export_store, open_store

preprocessing = pytest.importorskip("specforge.data.preprocessing")
eagle3_data = pytest.importorskip("specforge.algorithms.eagle3.data")
offline_reader = pytest.importorskip("specforge.runtime.data_plane.offline_reader")
feature_store = pytest.importorskip("specforge.runtime.data_plane.feature_store")
feature_dataloader = pytest.importorskip("specforge.runtime.data_plane.feature_dataloader")

MAX_LEN = 20  # below the longest samples: truncation is part of what is compared


@pytest.fixture(scope="module")
def export(post_norm: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("specforge") / "data"
    summary = export_store(post_norm, out, format="specforge")
    assert summary.layer_ids == [1, 3, 4]  # SGLang's ids: transformers' [2, 4, 5] minus one
    return out


def _sample_of(path: str, export: Path) -> str:
    """The store's sample id of an exported file (data_{idx}.ckpt is sample_ids[idx])."""
    order = json.loads((export / "hsdump-export.json").read_text())["sample_ids"]
    return str(order[int(Path(path).name.removeprefix("data_").removesuffix(".ckpt"))])


def _assert_bit_equal(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert sorted(k for k, v in got.items() if v is not None) == sorted(want)
    for key, value in want.items():
        assert got[key].dtype == value.dtype and got[key].shape == value.shape, key
        assert torch.equal(got[key].view(torch.uint8), value.view(torch.uint8)), key


def test_each_exported_file_reads_back_in_offline_eagle3_dataset(
    export: Path, post_norm: Path
) -> None:
    paths = preprocessing.list_local_files(str(export))
    dataset = preprocessing.OfflineEagle3Dataset(paths, max_len=MAX_LEN)
    assert len(dataset) == 12
    with open_store(post_norm, "r") as store:
        for i, path in enumerate(paths):
            item, hs = dataset[i], store.get(_sample_of(path, export))
            n = min(hs.num_tokens, MAX_LEN)
            assert torch.equal(item["input_ids"][0], hs.input_ids[:n])
            want_mask = hs.loss_mask[:n].long()
            want_mask[-1] = 0
            assert torch.equal(item["loss_mask"][0], want_mask)
            assert torch.equal(item["hidden_state"][0], hs.aux_hidden_states[:n].flatten(1))
            assert torch.equal(item["target"][0], hs.final_hidden_state[:n])


def test_adapter_batches_equal_offline_eagle3_dataset_batches(
    export: Path, post_norm: Path
) -> None:
    paths = preprocessing.list_local_files(str(export))
    theirs = preprocessing.OfflineEagle3Dataset(paths, max_len=MAX_LEN)
    ours = HiddenStateDataset(post_norm, sample_ids=[_sample_of(p, export) for p in paths])
    collate, their_collate = SpecForgeCollate(ours, max_len=MAX_LEN), _their_collator()
    for batch in ([0, 1, 2], [3, 6], [5], list(range(12))):
        want = their_collate([theirs[i] for i in batch])
        _assert_bit_equal(collate([ours[i] for i in batch]), want)


def test_adapter_batches_equal_the_feature_dataloader_path_of_specforge_train(
    export: Path, post_norm: Path
) -> None:
    """OfflineManifestReader -> LocalFeatureStore -> FeatureDataLoader, with EAGLE-3's
    normalizer and collator, as `specforge train` builds it for data.hidden_states_path."""
    reader = eagle3_data.build_offline_reader(
        str(export), run_id="offline", ttt_length=7, max_len=MAX_LEN
    )
    refs = reader.read()
    loader = feature_dataloader.FeatureDataLoader(
        feature_store.LocalFeatureStore(),
        refs=refs,
        batch_size=4,
        collate_fn=eagle3_data.build_offline_collator(),
        per_sample_transform=eagle3_data.build_offline_normalizer(MAX_LEN),
    )
    ids = [_sample_of(ref.feature_store_uri.removeprefix("file://"), export) for ref in refs]
    ours = HiddenStateDataset(post_norm, sample_ids=ids)
    collate = SpecForgeCollate(ours, max_len=MAX_LEN)
    batches = list(loader)
    assert len(batches) == 3
    for number, batch in enumerate(batches):
        items = [ours[i] for i in range(4 * number, 4 * number + 4)]
        _assert_bit_equal(collate(items), batch.tensors)


def test_the_adapter_refuses_a_pre_norm_store_naming_the_setting(pre_norm: Path) -> None:
    with pytest.raises(ExportError, match=r"only lm_head.*HSDUMP_FINAL_NORM=post_norm"):
        SpecForgeCollate(HiddenStateDataset(pre_norm))


def _their_collator() -> object:
    from specforge.data.utils import DataCollatorWithPadding

    return DataCollatorWithPadding()
