"""A store read with zarr alone: a clean tree walk, and sample k found from the attributes only."""

from __future__ import annotations

import fcntl
import json
import os
import warnings
import zlib
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import zarr
from store_crash_writer import make_sample, open_test_store

from hsdump import HiddenStateStore, PartLockedError, StoreCorruptedError, open_store

_LEGACY_LOCK = ".hsdump-writer.lock"
COLUMNS = ("offset", "length", "has_mask", "crc32")  # index/rows, as docs/store.md names them


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int16)


def _write(path: Path, n: int, writer_id: str | None = None) -> None:
    with open_test_store(str(path), writer_id=writer_id) as store:
        for i in range(n):
            store.write(make_sample(i))


def _walk(path: Path) -> list[str]:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        root = zarr.open_group(str(path), mode="r")
        return [name for name, _ in root.members(max_depth=None)]


def test_zarr_walks_a_store_being_written_without_warnings(tmp_path: Path) -> None:
    path = tmp_path / "s.zarr"
    _write(path, 3)
    with open_test_store(str(path)) as store:  # the writer's lock is held during the walk
        store.write(make_sample(3))
        store.flush()
        names = _walk(path)
    assert {"part-default", "part-default/hidden", "part-default/index/rows"} <= set(names)


def test_a_part_with_the_old_lock_file_opens_and_loses_it(tmp_path: Path) -> None:
    path = tmp_path / "s.zarr"
    _write(path, 2)
    legacy = path / "part-default" / _LEGACY_LOCK
    legacy.touch()  # as hsdump left it before the locks moved beside the store
    with open_test_store(str(path)) as store:
        assert len(store) == 2
        assert not legacy.exists()
    _walk(path)


def test_a_live_holder_of_the_old_lock_file_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "s.zarr"
    _write(path, 1)
    fd = os.open(path / "part-default" / _LEGACY_LOCK, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # an older hsdump writing this part
        with pytest.raises(PartLockedError, match=r"own writer_id") as info:
            open_test_store(str(path))
        assert _LEGACY_LOCK in str(info.value)
    finally:
        os.close(fd)
    with open_test_store(str(path)) as store:  # released: the part opens
        assert len(store) == 1


def test_index_rows_name_their_columns_in_new_and_resumed_parts(tmp_path: Path) -> None:
    path = tmp_path / "s.zarr"
    _write(path, 2)
    rows_json = path / "part-default" / "index" / "rows" / "zarr.json"
    assert json.loads(rows_json.read_text())["attributes"]["columns"] == list(COLUMNS)
    _edit_json(rows_json, lambda a: a.pop("columns"))  # as parts were before the names
    with open_store(str(path), "r") as store:
        assert len(store) == 2
    with open_test_store(str(path)) as store:
        assert len(store) == 2
    part: Any = zarr.open_group(str(path), mode="r")["part-default"]
    assert part["index/rows"].attrs["columns"] == list(COLUMNS)


def _read_with_zarr(path: Path, sample_id: str) -> dict[str, Any]:
    """Sample ``sample_id`` found and decoded as the root's ``hsdump_layout`` text tells."""
    root = zarr.open_group(str(path), mode="r")
    assert "committed_samples" in root.attrs["hsdump_layout"]
    for name in sorted(name for name, _ in root.groups()):
        part: Any = root[name]
        n = part.attrs["committed_samples"]
        k = list(part["index/sample_id"][:n]).index(sample_id)
        columns = part["index/rows"].attrs["columns"]
        row = dict(zip(columns, part["index/rows"][k].tolist(), strict=True))
        span = slice(row["offset"], row["offset"] + row["length"])
        hidden = part["hidden"]
        assert hidden.attrs["logical_dtype"] == "bfloat16"
        bits = np.ascontiguousarray(hidden[span])
        ids, mask = part["input_ids"][span], part["loss_mask"][span]
        crc = zlib.crc32(ids.data, zlib.crc32(bits.data))
        assert row["crc32"] == (zlib.crc32(mask.data, crc) if row["has_mask"] else crc)
        return {
            "layer_ids": part.attrs["hsdump_part"]["provenance"]["layer_ids"],
            "hidden": torch.from_numpy(bits).view(torch.bfloat16),
            "input_ids": ids,
            "loss_mask": mask if row["has_mask"] else None,
            "committed_tokens": part.attrs["committed_tokens"],
        }
    raise AssertionError(f"{sample_id} is in no part")


def test_zarr_alone_reads_sample_k_as_the_store_does(tmp_path: Path) -> None:
    path = tmp_path / "s.zarr"
    _write(path, 4)
    with open_test_store(str(path)) as store:  # a second session: the counters move on commit
        for i in range(4, 7):
            store.write(make_sample(i))
    with open_store(str(path), "r") as store:
        _check_read_with_zarr(path, store)


def _check_read_with_zarr(path: Path, store: HiddenStateStore) -> None:
    names = _walk(path)
    assert "part-default/index/sample_id" in names
    for sid in ("s0", "s3", "s5"):
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            got = _read_with_zarr(path, sid)
        want = store[sid]
        k = len(got["layer_ids"])
        assert got["layer_ids"] == want.layer_ids
        assert torch.equal(got["hidden"][:, :k].view(torch.int16), _bits(want.aux_hidden_states))
        assert torch.equal(got["hidden"][:, k].view(torch.int16), _bits(want.final_hidden_state))
        assert np.array_equal(got["input_ids"], want.input_ids.numpy())
        if want.loss_mask is None:
            assert got["loss_mask"] is None
        else:
            assert np.array_equal(got["loss_mask"], want.loss_mask.numpy())
        assert got["committed_tokens"] == store.num_tokens
    assert len(store) == 7


def _edit_json(file: Path, edit: Any) -> None:
    meta = json.loads(file.read_text())
    edit(meta["attributes"])
    file.write_text(json.dumps(meta))


def _make_old(path: Path) -> None:
    """Remove what stores from before the store described itself did not have."""
    _edit_json(path / "zarr.json", lambda a: a.pop("hsdump_layout"))
    _edit_json(path / "part-default" / "index" / "rows" / "zarr.json", lambda a: a.pop("columns"))
    for key in ("committed_samples", "committed_tokens"):
        _edit_json(path / "part-default" / "zarr.json", lambda a, key=key: a.pop(key))


def test_an_old_store_reads_and_gains_the_descriptions_when_opened_for_writing(
    tmp_path: Path,
) -> None:
    path = tmp_path / "s.zarr"
    _write(path, 3)
    _make_old(path)
    with open_store(str(path), "r") as store:
        assert len(store) == 3 and store["s1"].sample_id == "s1"
    with open_test_store(str(path)) as store:
        assert len(store) == 3
        num_tokens = store.num_tokens
    root = zarr.open_group(str(path), mode="r")
    part: Any = root["part-default"]
    assert "part-<writer_id>" in root.attrs["hsdump_layout"]
    assert part["index/rows"].attrs["columns"] == list(COLUMNS)
    assert (part.attrs["committed_samples"], part.attrs["committed_tokens"]) == (3, num_tokens)


def test_committed_samples_that_disagree_with_the_part_state_are_damage(tmp_path: Path) -> None:
    path = tmp_path / "s.zarr"
    _write(path, 2)
    _edit_json(path / "part-default" / "zarr.json", lambda a: a.update(committed_samples=3))
    with pytest.raises(StoreCorruptedError, match=r"part-default/zarr.json.*committed_samples"):
        open_store(str(path), "r")
