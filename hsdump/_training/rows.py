"""The dataset rows of a speculators export, read from the store without its hidden states.

speculators' ``ArrowDataset`` (``src/speculators/train/data.py``) opens its data directory with
``datasets.load_from_disk`` and matches row ``i`` to ``hidden_states/hs_{i}.safetensors``: it
reads ``input_ids`` (compared with the file's ``token_ids``), ``loss_mask`` and ``seq_len``, in the
torch format that ``scripts/prepare_data.py`` saves. Its ``scripts/train.py`` builds the draft
vocabulary from ``token_freq.pt`` beside them (``{token id: count}`` over the tokens with loss, as
``speculators/train/vocab_mapping.py`` counts them).
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from hsdump._store.durable import PARTIAL_SUFFIX

if TYPE_CHECKING:
    from hsdump._store.store import HiddenStateStore

__all__ = ["write_rows"]

_BATCH_ROWS = 1024


def write_rows(path: Any, store: HiddenStateStore, out: Path, ids: list[str]) -> None:
    """Save the rows of ``ids`` (in order) as a datasets directory at ``out``, and their token
    frequencies as ``out/token_freq.pt``.

    The rows are streamed to an Arrow file, saved with ``datasets`` beside it, and renamed into
    ``out`` with ``state.json`` (where ``load_from_disk`` starts) last.
    """
    import datasets
    import pyarrow as pa
    import torch

    work = out / f".rows{PARTIAL_SUFFIX}"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir()
    column = pa.list_(pa.int64())
    schema = pa.schema([("input_ids", column), ("loss_mask", column), ("seq_len", pa.int64())])
    counts = np.zeros(0, np.int64)
    with pa.OSFile(str(work / "rows.arrow"), "wb") as sink, pa.ipc.new_stream(sink, schema) as w:
        for batch, masked in _batches(_TokenReader(path, store), ids, schema):
            w.write_batch(batch)
            counts = _add_counts(counts, masked)
    frequencies = {int(i): int(counts[i]) for i in np.flatnonzero(counts)}
    torch.save(frequencies, work / "token_freq.pt")
    rows = datasets.Dataset.from_file(str(work / "rows.arrow"))
    rows.set_format("torch")
    with _quiet_datasets():
        rows.save_to_disk(str(work / "dataset"))
    del rows
    os.replace(work / "token_freq.pt", out / "token_freq.pt")
    _move_dataset(work / "dataset", out)
    shutil.rmtree(work, ignore_errors=True)


def _add_counts(counts: np.ndarray, tokens: np.ndarray) -> np.ndarray:
    found = np.bincount(tokens, minlength=len(counts))
    found[: len(counts)] += counts
    return found


def _batches(reader: _TokenReader, ids: list[str], schema: Any) -> Iterator[tuple[Any, np.ndarray]]:
    """Record batches of rows, each with the token ids that have loss."""
    import pyarrow as pa

    for start in range(0, len(ids), _BATCH_ROWS):
        pieces = [reader.read(sid) for sid in ids[start : start + _BATCH_ROWS]]
        offsets = pa.array(np.cumsum([0] + [len(ids_) for ids_, _ in pieces], dtype=np.int32))
        tokens = np.concatenate([ids_ for ids_, _ in pieces]).astype(np.int64)
        masks = np.concatenate([mask for _, mask in pieces]).astype(np.int64)
        lengths = np.array([len(ids_) for ids_, _ in pieces], dtype=np.int64)
        batch = pa.record_batch(
            [
                pa.ListArray.from_arrays(offsets, pa.array(tokens)),
                pa.ListArray.from_arrays(offsets, pa.array(masks)),
                pa.array(lengths),
            ],
            schema=schema,
        )
        yield batch, tokens[masks.astype(bool)]


class _TokenReader:
    """Token ids and masks through plain zarr at ``store.locate``'s rows, without decoding the
    hidden states. A sample stored without a mask has ones in ``loss_mask``, as hsdump's dataset
    reads it."""

    _WINDOW = 1 << 20  # tokens read at once: samples of one writer lie in order

    def __init__(self, path: Any, store: HiddenStateStore) -> None:
        import zarr

        self._root = zarr.open_group(path, mode="r")
        self._store = store
        self._windows: dict[str, tuple[int, np.ndarray]] = {}

    def read(self, sid: str) -> tuple[np.ndarray, np.ndarray]:
        part, offset, length = self._store.locate(sid)
        return (
            self._rows(f"{part}/input_ids", offset, length),
            self._rows(f"{part}/loss_mask", offset, length),
        )

    def _rows(self, key: str, offset: int, length: int) -> np.ndarray:
        array: Any = self._root[key]
        start = offset // self._WINDOW * self._WINDOW
        if offset + length > start + self._WINDOW:
            return np.asarray(array[offset : offset + length])
        cached = self._windows.get(key)
        if cached is None or cached[0] != start:
            stop = min(start + self._WINDOW, int(array.shape[0]))
            cached = (start, np.asarray(array[start:stop]))
            self._windows[key] = cached
        return cached[1][offset - start : offset - start + length]


def _move_dataset(src: Path, out: Path) -> None:
    """Rename a saved dataset's files into ``out``, ``state.json`` last, then remove the shards
    of an earlier save that the new state does not list."""
    state = json.loads((src / "state.json").read_text())
    for name in sorted(os.listdir(src)):
        if name != "state.json":
            os.replace(src / name, out / name)
    os.replace(src / "state.json", out / "state.json")
    listed = {f["filename"] for f in state["_data_files"]}
    for stale in out.glob("data-*-of-*.arrow"):
        if stale.name not in listed:
            stale.unlink()


class _quiet_datasets:
    """Hide datasets' progress bar while saving (the export shows its own progress)."""

    def __enter__(self) -> None:
        from datasets.utils import are_progress_bars_disabled, disable_progress_bars

        self._was_disabled = are_progress_bars_disabled()
        disable_progress_bars()

    def __exit__(self, *exc_info: object) -> None:
        from datasets.utils import enable_progress_bars

        if not self._was_disabled:
            enable_progress_bars()
