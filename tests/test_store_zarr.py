"""A store read with zarr alone: a clean tree walk, and sample k found from the attributes only."""

from __future__ import annotations

import fcntl
import json
import os
import warnings
from pathlib import Path
from typing import Any

import pytest
import zarr
from store_crash_writer import make_sample, open_test_store

from hsdump import StoreError, open_store

_LEGACY_LOCK = ".hsdump-writer.lock"
COLUMNS = ("offset", "length", "has_mask", "crc32")  # index/rows, as docs/store.md names them


def _write(path: Path, n: int, writer_id: str | None = None) -> None:
    with open_test_store(str(path), writer_id=writer_id) as store:
        for i in range(n):
            store.write_sync(make_sample(i))


def _walk(path: Path) -> list[str]:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        root = zarr.open_group(str(path), mode="r")
        return [name for name, _ in root.members(max_depth=None)]


def test_zarr_walks_a_store_being_written_without_warnings(tmp_path: Path) -> None:
    path = tmp_path / "s.zarr"
    _write(path, 3)
    with open_test_store(str(path)) as store:  # the writer's lock is held during the walk
        store.write_sync(make_sample(3))
        store.flush_sync()
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
        with pytest.raises(StoreError, match=r"own writer_id") as info:
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


def _edit_json(file: Path, edit: Any) -> None:
    meta = json.loads(file.read_text())
    edit(meta["attributes"])
    file.write_text(json.dumps(meta))
