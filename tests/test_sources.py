"""With ``HSDUMP_DUMP_READS=file`` the store reads a dump's rows from the dump file itself: no
page of the dump is mapped into the reading process, the stored bytes are the dump's, and a file
cut short under the store refuses its sample instead of crashing the process."""

from __future__ import annotations

import mmap
import os
from pathlib import Path

import numpy as np
import pytest
import torch
from store_crash_writer import HIDDEN, LAYERS, make_sample, open_test_store

from hsdump import DumpValidationError, HiddenStates
from hsdump._client.loading import read_dump, to_torch
from hsdump._mapped import populate_rows
from hsdump._protocol import AUX_FILE, DumpMeta, ProducerInfo, write_dump
from hsdump._store.sources import IOV_MAX, row_source


@pytest.fixture(autouse=True)
def _file_reads(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HSDUMP_DUMP_READS", "file")


def _bits(t: torch.Tensor) -> np.ndarray:
    return t.view(torch.int16).numpy()


def _publish(root: Path, hs: HiddenStates) -> Path:
    t = hs.num_tokens
    meta = DumpMeta(
        rid=f"hsdump-{hs.sample_id}", input_ids=hs.input_ids.tolist(), num_tokens=t,
        layer_ids=list(LAYERS), final_norm="post_norm", hidden_size=HIDDEN, dtype="bfloat16",
        aux_shape=(t, len(LAYERS), HIDDEN), final_shape=(t, HIDDEN),
        producer=ProducerInfo(name="test", version="1"),
    )  # fmt: skip
    aux, final = _bits(hs.aux_hidden_states).view(np.uint16), _bits(hs.final_hidden_state)
    return write_dump(root, meta, aux, final.view(np.uint16))


def _unchecked_from(path: Path, sample: HiddenStates) -> HiddenStates:
    """The sample as an extraction run hands it to the store: read unchecked from its dump."""
    dump = read_dump(path, check_values=False)
    return HiddenStates(
        sample.sample_id,
        sample.input_ids,
        to_torch(dump.aux, "bfloat16"),
        to_torch(dump.final, "bfloat16"),
        list(LAYERS),
        sample.loss_mask,
        meta=dump.meta,
        values_checked=False,
    )


def _resident_kb(file: Path) -> int | None:
    """Resident kB of this process's mappings of ``file``; None where it maps none."""
    found, total, lines = False, 0, Path("/proc/self/smaps").read_text().splitlines()
    for i, line in enumerate(lines):
        if line.endswith(str(file)) or line.endswith(f"{file} (deleted)"):
            found = True
            rss = next(x for x in lines[i + 1 :] if x.startswith("Rss:"))
            total += int(rss.split()[1])
    return total if found else None


def test_a_dump_is_stored_from_its_file_with_none_of_its_pages_mapped_in(tmp_path: Path) -> None:
    samples = [make_sample(i) for i in range(4)]  # 1 to 292 tokens: pieces across shards
    read = [_unchecked_from(_publish(tmp_path / "dumps", s), s) for s in samples]
    files = [tmp_path / "dumps" / f"req_hsdump-{s.sample_id}" / AUX_FILE for s in samples]
    assert all(_resident_kb(f) == 0 for f in files)  # mapped, not one page faulted in
    with open_test_store(str(tmp_path / "store")) as store:
        for hs in read:
            store.write(hs)
        store.flush()
        assert store.take_refused() == []
        assert all(_resident_kb(f) == 0 for f in files)  # placement read the files, not the maps
        for s in samples:
            back = store[s.sample_id]
            assert np.array_equal(_bits(back.aux_hidden_states), _bits(s.aux_hidden_states))
            assert np.array_equal(_bits(back.final_hidden_state), _bits(s.final_hidden_state))


def test_reading_through_the_mapping_faults_the_dump_in_and_stores_the_same_bytes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HSDUMP_DUMP_READS", "mapping")
    sample = make_sample(3)
    path = _publish(tmp_path / "dumps", sample)
    hs = _unchecked_from(path, sample)
    pages = -(-hs.aux_hidden_states.nbytes // mmap.PAGESIZE)
    assert _resident_kb(path / AUX_FILE) == pages * mmap.PAGESIZE // 1024  # every page
    with open_test_store(str(tmp_path / "store")) as store:
        store.write(hs)
        store.flush()
        assert store.take_refused() == []
        back = store[sample.sample_id]
        assert np.array_equal(_bits(back.aux_hidden_states), _bits(sample.aux_hidden_states))


def test_a_dump_file_cut_short_under_the_store_refuses_its_sample(tmp_path: Path) -> None:
    good, bad = make_sample(2), make_sample(3)
    read = [_unchecked_from(_publish(tmp_path / "dumps", s), s) for s in (good, bad)]
    aux_file = tmp_path / "dumps" / "req_hsdump-s3" / AUX_FILE
    os.truncate(aux_file, aux_file.stat().st_size // 2)  # after its size was checked
    with open_test_store(str(tmp_path / "store")) as store:
        for hs in read:
            store.write(hs)
        store.flush()
        (refused,) = store.take_refused()
        assert sorted(store) == ["s2"]
    assert isinstance(refused.error, DumpValidationError) and refused.sample_id == "s3"
    assert refused.error.rid == "hsdump-s3" and "cut them short" in str(refused.error)


def test_rows_read_from_a_lazy_mapping_prove_the_file_still_covers_them(tmp_path: Path) -> None:
    sample = make_sample(3)
    path = _publish(tmp_path / "dumps", sample)
    dump = read_dump(path, check_values=False)
    populate_rows(dump.aux, [0, sample.num_tokens - 1])  # the file covers both
    os.truncate(path / AUX_FILE, 0)
    with pytest.raises(OSError):
        populate_rows(dump.aux, [sample.num_tokens - 1])


def test_a_read_of_more_rows_than_one_call_takes_is_split(tmp_path: Path) -> None:
    rows = IOV_MAX * 2 + 5
    sample = HiddenStates(
        "long",
        torch.arange(rows),
        torch.randn(rows, len(LAYERS), HIDDEN).to(torch.bfloat16),
        torch.randn(rows, HIDDEN).to(torch.bfloat16),
        list(LAYERS),
    )
    dump = read_dump(_publish(tmp_path, sample), check_values=False)
    dest = np.zeros((rows, len(LAYERS) + 1, HIDDEN), np.uint16)
    row_source(dump.aux, from_file=True).copy(0, dest[:, : len(LAYERS)])
    row_source(dump.final, from_file=True).copy(0, dest[:, len(LAYERS)])
    assert _resident_kb(tmp_path / "req_hsdump-long" / AUX_FILE) == 0  # before the compare reads
    assert np.array_equal(dest[:, : len(LAYERS)], _bits(sample.aux_hidden_states).view(np.uint16))
    assert np.array_equal(dest[:, len(LAYERS)], _bits(sample.final_hidden_state).view(np.uint16))
