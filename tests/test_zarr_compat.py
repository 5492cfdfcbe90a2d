"""hsdump and zarr read each other's bytes, bit for bit, and only one module reaches into zarr.

Run against another zarr release with ``nox -s compat -- 3.1.1`` (docs/store.md, "Supported zarr
versions"). ``HSDUMP_COMPAT_PYTHON`` names another interpreter with numpy and zarr installed
(a newer Python with zarr's newest release, say): the last test then has that zarr read a store
this hsdump wrote and write one this hsdump reads.
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import zarr
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import hsdump
from hsdump import HiddenStates, open_store

PACKAGE = Path(hsdump.__file__).parent
ADAPTER = PACKAGE / "_store" / "zarr_adapter.py"
# zarr's documented modules; everything else (zarr.core...) is an internal.
PUBLIC = {"zarr", "zarr.abc.store", "zarr.buffer", "zarr.codecs", "zarr.errors", "zarr.storage"}
INTERNAL_ATTRIBUTES = {"encode_chunk_key", "store_path"}
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
BITS = {"bfloat16": np.uint16, "float16": np.uint16, "float32": np.uint32}


def _internal_uses(path: Path) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        modules: list[str] = []
        if isinstance(node, ast.Import):
            modules = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            modules = [node.module]
        found += [f"import {m}" for m in modules if m.startswith("zarr.") and m not in PUBLIC]
        if not isinstance(node, ast.Attribute):
            continue
        if node.attr in INTERNAL_ATTRIBUTES and ast.unparse(node.value) != "self":
            found.append(f".{node.attr}")
        if node.attr == "core" and isinstance(node.value, ast.Name) and node.value.id == "zarr":
            found.append("zarr.core")
        inner = node.value
        if node.attr == "codecs" and isinstance(inner, ast.Attribute) and inner.attr == "metadata":
            found.append(".metadata.codecs")
    return [f"{path.relative_to(PACKAGE)}:{use}" for use in found]


def test_only_the_adapter_uses_zarr_internals() -> None:
    modules = [p for p in PACKAGE.rglob("*.py") if p != ADAPTER]
    assert [use for p in modules for use in _internal_uses(p)] == []
    assert _internal_uses(ADAPTER), "the check finds nothing, even in the adapter"


@dataclass
class Case:
    """One store: its geometry and codec, and the samples written to it."""

    dtype: str
    compression: str
    chunk_tokens: int
    shard_tokens: int
    hidden: int
    layers: int
    lengths: list[int]
    zeros: list[bool]
    seed: int

    def samples(self) -> list[HiddenStates]:
        rng = np.random.default_rng(self.seed)
        bits = BITS[self.dtype]
        out = []
        for i, (t, zero) in enumerate(zip(self.lengths, self.zeros, strict=True)):
            shape = (t, self.layers + 1, self.hidden)
            raw = (
                np.zeros(shape, bits) if zero else rng.integers(0, np.iinfo(bits).max, shape, bits)
            )
            hidden = _as_tensor(raw, self.dtype)
            ids = torch.from_numpy(rng.integers(0, 2**31 - 1, t))
            mask = torch.from_numpy(rng.integers(0, 2, t, np.uint8)) if i % 2 else None
            out.append(
                HiddenStates(
                    f"s{i}", ids, hidden[:, :-1], hidden[:, -1], [*range(self.layers)], mask
                )
            )
        return out


def _as_tensor(bits: np.ndarray, dtype: str) -> torch.Tensor:
    signed = bits.view(np.int16 if bits.dtype == np.uint16 else np.int32)
    return torch.from_numpy(signed.copy()).view(DTYPES[dtype])


def _bits(t: torch.Tensor) -> np.ndarray:
    wide = torch.int16 if t.element_size() == 2 else torch.int32
    return t.contiguous().view(wide).numpy().view(np.uint16 if t.element_size() == 2 else np.uint32)


@st.composite
def cases(draw: st.DrawFn) -> Case:
    chunk = draw(st.sampled_from([1, 2, 4, 8]))
    n = draw(st.integers(2, 7))  # the last one is appended after zarr rewrote the others
    return Case(
        dtype=draw(st.sampled_from(sorted(DTYPES))),
        compression=draw(st.sampled_from(["zstd", "lz4", "none"])),
        chunk_tokens=chunk,
        shard_tokens=chunk * draw(st.integers(1, 4)),
        hidden=draw(st.integers(1, 5)),
        layers=draw(st.integers(1, 3)),
        lengths=draw(st.lists(st.integers(1, 20), min_size=n, max_size=n)),
        zeros=draw(st.lists(st.booleans(), min_size=n, max_size=n)),
        seed=draw(st.integers(0, 2**32 - 1)),
    )


def _write(path: Path, case: Case, samples: list[HiddenStates]) -> None:
    options: Any = {"compression": case.compression}
    with open_store(
        path, "a", shard_tokens=case.shard_tokens, chunk_tokens=case.chunk_tokens, **options
    ) as store:
        for sample in samples:
            store.write(sample)


def _assert_zarr_reads(path: Path, samples: list[HiddenStates]) -> None:
    """Plain zarr finds each sample's rows where the store says they are, bit for bit."""
    with open_store(path, "r") as store:
        spans = {s.sample_id: store.locate(s.sample_id) for s in samples}
    group: Any = zarr.open_group(path, mode="r")
    for sample in samples:
        part, offset, length = spans[sample.sample_id]
        rows = slice(offset, offset + length)
        hidden = group[f"{part}/hidden"][rows]
        k = len(sample.layer_ids)
        assert np.array_equal(hidden[:, :k], _bits(sample.aux_hidden_states))
        assert np.array_equal(hidden[:, k], _bits(sample.final_hidden_state))
        assert np.array_equal(group[f"{part}/input_ids"][rows], sample.input_ids.numpy())
        if sample.loss_mask is not None:
            assert np.array_equal(group[f"{part}/loss_mask"][rows], sample.loss_mask.numpy())


def _rewrite_with_zarr(part: Path) -> None:
    """Replace every chunk and shard of the part's sample arrays by what zarr writes for the
    same values under the same metadata."""
    for name in ("hidden", "input_ids", "loss_mask"):
        array: Any = zarr.open_array(part / name, mode="r+")
        values = array[:]
        for chunk in (part / name).glob("c.*"):
            chunk.unlink()
        array[:] = values


def _assert_hsdump_reads(path: Path, samples: list[HiddenStates]) -> None:
    with open_store(path, "r") as store:
        for sample in samples:
            got = store[sample.sample_id]  # not verified: shards zarr left out are checked
            assert got.aux_hidden_states.dtype == sample.aux_hidden_states.dtype
            assert np.array_equal(_bits(got.aux_hidden_states), _bits(sample.aux_hidden_states))
            assert np.array_equal(_bits(got.final_hidden_state), _bits(sample.final_hidden_state))
            assert torch.equal(got.input_ids, sample.input_ids)
            if sample.loss_mask is not None:
                assert got.loss_mask is not None and torch.equal(got.loss_mask, sample.loss_mask)
        report = store.verify()
        assert report.clean and report.checked == len(samples)


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=cases())
def test_zarr_and_hsdump_read_each_others_shards_bit_for_bit(case: Case) -> None:
    samples = case.samples()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "s.zarr"
        _write(path, case, samples[:-1])
        _assert_zarr_reads(path, samples[:-1])
        _rewrite_with_zarr(path / "part-default")
        _assert_hsdump_reads(path, samples[:-1])
        _write(path, case, samples[-1:])  # resumes in a partial shard that zarr wrote
        _assert_zarr_reads(path, samples)
        _assert_hsdump_reads(path, samples)


# Run by HSDUMP_COMPAT_PYTHON, which has numpy and zarr but not hsdump: check the rows hsdump
# wrote (argv[2], a JSON list of [part, offset, length, sha256 of the bits]), then rewrite every
# sample array with zarr.
OTHER_ZARR = """
import hashlib, json, sys
from pathlib import Path
import zarr
path, spans = Path(sys.argv[1]), json.loads(sys.argv[2])
for part, offset, length, digest in spans:
    rows = zarr.open_group(path, mode="r")[part + "/hidden"][offset : offset + length]
    assert hashlib.sha256(rows.tobytes()).hexdigest() == digest, (part, offset)
for part in {span[0] for span in spans}:
    for name in ("hidden", "input_ids", "loss_mask"):
        array = zarr.open_array(path / part / name, mode="r+")
        values = array[:]
        for chunk in (path / part / name).glob("c.*"):
            chunk.unlink()
        array[:] = values
print(zarr.__version__)
"""


def test_another_zarr_reads_and_writes_what_this_hsdump_does(tmp_path: Path) -> None:
    other = os.environ.get("HSDUMP_COMPAT_PYTHON")
    if not other:
        pytest.skip("HSDUMP_COMPAT_PYTHON names no interpreter with another zarr")
    import hashlib

    case = Case("bfloat16", "zstd", 4, 12, 3, 2, [5, 1, 17, 9, 4], [False, True] * 2 + [False], 7)
    samples, path = case.samples(), tmp_path / "s.zarr"
    _write(path, case, samples)
    with open_store(path, "r") as store:
        spans = [store.locate(s.sample_id) for s in samples]
    digests = [
        hashlib.sha256(
            np.concatenate(
                [_bits(s.aux_hidden_states), _bits(s.final_hidden_state)[:, None]], 1
            ).tobytes()
        ).hexdigest()
        for s in samples
    ]
    arg = json.dumps([[*span, d] for span, d in zip(spans, digests, strict=True)])
    done = subprocess.run(
        [other, "-c", OTHER_ZARR, str(path), arg], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    _assert_hsdump_reads(path, samples)
