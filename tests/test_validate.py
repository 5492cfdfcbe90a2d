"""Value checks agree with torch on the same bits, for every dtype the protocol allows; files that
do not hold what the metadata says are refused."""

from __future__ import annotations

import gc
import multiprocessing
import os
import re
import tempfile
import threading
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hsdump import (
    DegenerateValues,
    DtypeMismatch,
    DumpValidationError,
    NonFiniteValues,
    Sample,
    ShapeMismatch,
)
from hsdump._client import dumpfiles
from hsdump._client.dumpfiles import read_checked
from hsdump._client.loading import load_dump
from hsdump._client.validate import Expected
from hsdump._protocol import DTYPES, DumpMeta, ProducerInfo, write_dump


def copy_checked(bits: np.ndarray, dtype: str, name: str, **context: str) -> np.ndarray:
    """Write ``bits`` as a dump's tensor file and read them back through the checks."""
    with tempfile.TemporaryDirectory() as tmp:
        file = Path(tmp) / "aux.bin"
        bits.tofile(file)
        context.setdefault("rid", "hsdump-r")
        return read_checked(file, bits.shape, dtype, name, **context)


@settings(max_examples=150, deadline=None)
@given(
    dtype=st.sampled_from(sorted(DTYPES)),
    rows=st.integers(1, 40),
    seed=st.integers(0, 2**32 - 1),
    specials=st.lists(st.sampled_from([np.inf, -np.inf, np.nan, -0.0]), max_size=3),
)
def test_checks_match_torch_on_random_bits(
    dtype: str, rows: int, seed: int, specials: list[float]
) -> None:
    rng = np.random.default_rng(seed)
    spec = DTYPES[dtype]
    width = 8 * spec.itemsize
    bits = rng.integers(0, 1 << width, (rows, 3, 16), dtype=spec.bits_dtype)
    for value in specials:
        bits[tuple(rng.integers(0, n) for n in bits.shape)] = spec.from_float32(np.float32(value))
    if rng.random() < 0.3:
        bits[rng.integers(0, rows), rng.integers(0, 3), :] = rng.choice([0, 1 << (width - 1)])
    tensor = spec.tensor_of(bits.copy())
    finite = bool(torch.isfinite(tensor).all())
    nonzero = bool((tensor != 0).any(dim=-1).all())
    if not finite:
        with pytest.raises(NonFiniteValues):
            copy_checked(bits, dtype, "aux")
    elif not nonzero:
        with pytest.raises(DegenerateValues):
            copy_checked(bits, dtype, "aux")
    else:
        assert np.array_equal(copy_checked(bits, dtype, "aux"), bits)


def test_float32_is_read_and_checked_as_its_bits() -> None:
    good = np.ones((4, 2, 8), np.float32).view(np.uint32)
    read = copy_checked(good, "float32", "final")
    assert read.dtype == np.uint32 and np.array_equal(read, good)
    bad = np.ones((4, 2, 8), np.float32)
    bad[3, 1, 2] = np.inf
    with pytest.raises(NonFiniteValues, match="token 3"):
        copy_checked(bad.view(np.uint32), "float32", "final", sample_id="s1", rid="hsdump-r")


def test_the_first_bad_token_is_named_across_blocks() -> None:
    bits = np.full((5000, 2, 512), 0x3F80, np.uint16)  # 1.0 everywhere, spans several blocks
    bits[4321, 1, 7] = 0x7FC0
    with pytest.raises(NonFiniteValues, match="token 4321"):
        copy_checked(bits, "bfloat16", "aux")
    bits[4321, 1, 7] = 0x3F80
    bits[4999, 0, :] = 0x8000  # -0.0 is zero too
    with pytest.raises(DegenerateValues, match="token 4999"):
        copy_checked(bits, "bfloat16", "aux")


def _mapped(file: Path) -> bool:
    """Whether this process maps ``file`` (also once it is removed)."""
    return str(file) in Path("/proc/self/maps").read_text()


def _ones_file(tmp_path: Path, shape: tuple[int, ...] = (64, 2, 512)) -> tuple[Path, np.ndarray]:
    bits = np.full(shape, 0x3F80, np.uint16)  # bf16 1.0
    file = tmp_path / "aux.bin"
    bits.tofile(file)
    return file, bits


@pytest.mark.parametrize("check_values", [True, False], ids=["checked", "unchecked"])
def test_a_file_is_mapped_not_copied_and_outlives_its_removal(
    tmp_path: Path, check_values: bool
) -> None:
    """Also unchecked, as an extraction run reads its dumps (the store checks the values)."""
    file, bits = _ones_file(tmp_path)
    read = read_checked(
        file, bits.shape, "bfloat16", "aux", rid="hsdump-r", check_values=check_values
    )
    assert _mapped(file)
    file.unlink()  # as the client removes a dump once it is read
    assert np.array_equal(read, bits)
    del read
    gc.collect()
    assert not _mapped(file)  # unmapped with the last array on it: no mapping leaks


def _held(file: Path) -> bool:
    """Whether a descriptor of this process still holds ``file`` (also once it is removed)."""
    links = (os.readlink(fd) for fd in Path("/proc/self/fd").iterdir() if fd.is_symlink())
    return any(link.startswith(str(file)) for link in links)


def _drop_a_removed_dump(tmp_path: Path) -> Path:
    file, bits = _ones_file(tmp_path)
    read = read_checked(file, bits.shape, "bfloat16", "aux", rid="hsdump-r")
    file.unlink()
    del read
    gc.collect()
    return file


def test_the_pages_of_a_dropped_dump_are_freed_in_a_thread_of_their_own(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    closed_in: list[str] = []

    def close(fd: int) -> None:
        closed_in.append(threading.current_thread().name)
        os.close(fd)

    monkeypatch.setattr(dumpfiles, "_close", close)
    file = _drop_a_removed_dump(tmp_path)
    dumpfiles.released()
    assert closed_in and threading.current_thread().name not in closed_in
    assert not _held(file)  # its last descriptor closed: the kernel has freed its pages


def test_a_mapping_dropped_while_its_thread_holds_a_pool_lock_does_not_deadlock(
    tmp_path: Path,
) -> None:
    """The garbage collector runs a mapping's finalizer in whichever thread allocates, also inside
    `ThreadPoolExecutor.submit`, which holds concurrent.futures' module-wide lock: the finalizer
    must take no lock that such a thread may hold (it once submitted to a pool of its own)."""
    import concurrent.futures.thread as pools

    file, bits = _ones_file(tmp_path)
    read = [read_checked(file, bits.shape, "bfloat16", "aux", rid="hsdump-r")]
    dropped = threading.Event()

    def drop_holding_the_lock() -> None:
        with pools._global_shutdown_lock:  # as inside submit
            read.clear()  # the last array on the mapping: its finalizer runs here
        dropped.set()

    thread = threading.Thread(target=drop_holding_the_lock, daemon=True)
    thread.start()
    assert dropped.wait(timeout=20)
    dumpfiles.released()
    assert not _held(file)


def _drop_in_a_fork(tmp: str, done: multiprocessing.SimpleQueue) -> None:
    file = _drop_a_removed_dump(Path(tmp))
    dumpfiles.released()
    done.put(_held(file))


def test_a_forked_process_frees_the_pages_it_drops(tmp_path: Path) -> None:
    ours, theirs = tmp_path / "parent", tmp_path / "child"
    ours.mkdir()
    theirs.mkdir()
    _drop_a_removed_dump(ours)
    dumpfiles.released()  # this process's closing thread runs: the fork inherits it, not its thread
    context = multiprocessing.get_context("fork")
    done = context.SimpleQueue()
    child = context.Process(target=_drop_in_a_fork, args=(str(theirs), done))
    child.start()
    child.join(timeout=20)
    if child.exitcode is None:
        child.kill()
    assert child.exitcode == 0 and done.get() is False


def test_writing_to_a_mapped_array_leaves_the_file_as_it_was(tmp_path: Path) -> None:
    file, bits = _ones_file(tmp_path)
    read = read_checked(file, bits.shape, "bfloat16", "aux", rid="hsdump-r")
    read[3, 1, 7] = 0x4000
    assert np.array_equal(np.fromfile(file, np.uint16).reshape(bits.shape), bits)


def test_where_a_mapping_cannot_be_filled_the_file_is_read_and_checked(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(dumpfiles, "_MADV_POPULATE_READ", 0x7FFF)  # advice the kernel refuses
    file, bits = _ones_file(tmp_path)
    read = read_checked(file, bits.shape, "bfloat16", "aux", rid="hsdump-r")
    assert np.array_equal(read, bits) and not _mapped(file)
    bits[40, 0, 3] = 0x7F80  # +Inf
    bits.tofile(file)
    with pytest.raises(NonFiniteValues, match="token 40"):
        read_checked(file, bits.shape, "bfloat16", "aux", rid="hsdump-r")


@pytest.mark.parametrize("check_values", [True, False], ids=["checked", "unchecked"])
@pytest.mark.parametrize("advice", [dumpfiles._MADV_POPULATE_READ, 0x7FFF], ids=["map", "read"])
def test_a_file_cut_short_after_its_size_was_checked_is_refused_not_a_crash(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, advice: int, check_values: bool
) -> None:
    """The mapping's pages are faulted in up front, so a file cut short raises here, not SIGBUS at
    the store's first touch: also for a dump read unchecked."""
    checked = dumpfiles.check_file_size

    def check_then_cut(file: Path, *args: object, **kwargs: object) -> None:
        checked(file, *args, **kwargs)  # type: ignore[arg-type]
        os.truncate(file, 1000)

    monkeypatch.setattr(dumpfiles, "check_file_size", check_then_cut)
    monkeypatch.setattr(dumpfiles, "_MADV_POPULATE_READ", advice)
    file, bits = _ones_file(tmp_path)
    with pytest.raises(DumpValidationError, match="shrank") as info:
        read_checked(
            file, bits.shape, "bfloat16", "aux", sample_id="s1", rid="hsdump-r",
            check_values=check_values,
        )  # fmt: skip
    assert info.value.sample_id == "s1"
    gc.collect()
    assert not _mapped(file)


def test_an_unchecked_read_hands_non_finite_values_on_for_the_store_to_refuse(
    tmp_path: Path,
) -> None:
    file, bits = _ones_file(tmp_path)
    bits[40, 0, 3] = 0x7F80  # +Inf
    bits.tofile(file)
    read = read_checked(file, bits.shape, "bfloat16", "aux", rid="hsdump-r", check_values=False)
    assert np.array_equal(read, bits)
    with pytest.raises(NonFiniteValues, match="token 40"):
        read_checked(file, bits.shape, "bfloat16", "aux", rid="hsdump-r")


def test_a_file_of_the_wrong_size_is_refused_with_both_sizes(tmp_path: Path) -> None:
    file = tmp_path / "final.bin"
    np.ones((3, 8), np.uint16).tofile(file)
    with pytest.raises(DumpValidationError, match="holds 48 bytes, expected 64") as info:
        read_checked(file, (4, 8), "bfloat16", "final", sample_id="s1", rid="hsdump-r")
    assert info.value.sample_id == "s1" and info.value.rid == "hsdump-r"


def test_a_missing_file_is_refused(tmp_path: Path) -> None:
    with pytest.raises(DumpValidationError, match="is missing"):
        read_checked(tmp_path / "aux.bin", (4, 2, 8), "bfloat16", "aux", rid="hsdump-r")


def test_an_empty_tensor_reads_as_empty(tmp_path: Path) -> None:
    file = tmp_path / "aux.bin"
    file.touch()
    assert read_checked(file, (0, 2, 8), "bfloat16", "aux", rid="hsdump-r").shape == (0, 2, 8)


@pytest.mark.parametrize("hidden", [2**40, 2**62])
def test_a_shape_larger_than_the_file_is_refused_before_anything_is_allocated(
    tmp_path: Path, hidden: int
) -> None:
    file = tmp_path / "aux.bin"
    np.ones((12, 3, 8), np.uint16).tofile(file)
    with pytest.raises(DumpValidationError, match=f"holds {file.stat().st_size} bytes, expected"):
        read_checked(file, (12, 3, hidden), "bfloat16", "aux", sample_id="s1", rid="hsdump-r")


def test_a_negative_size_is_a_shape_mismatch(tmp_path: Path) -> None:
    file = tmp_path / "aux.bin"
    file.touch()
    with pytest.raises(ShapeMismatch, match=r"aux has shape \[12, 3, -1\]") as info:
        read_checked(file, (12, 3, -1), "bfloat16", "aux", sample_id="s1", rid="hsdump-r")
    assert info.value.sample_id == "s1"


def dump_of(root: Path, rid: str, ids: list[int], dtype: str, fill: int) -> Path:
    """Publish a dump of ``ids`` (2 layers, H=4) whose every 16-bit value is ``fill``."""
    t = len(ids)
    meta = DumpMeta(
        rid=rid, input_ids=ids, num_tokens=t, layer_ids=[1, 2], final_norm="post_norm",
        hidden_size=4, dtype=dtype, aux_shape=(t, 2, 4), final_shape=(t, 4),
        producer=ProducerInfo(name="test", version="1"),
    )  # fmt: skip
    aux, final = np.full((t, 2, 4), fill, np.uint16), np.full((t, 4), fill, np.uint16)
    return write_dump(root, meta, aux, final)


def test_a_refused_dump_sets_nothing_the_next_dumps_are_held_to(tmp_path: Path) -> None:
    expected = Expected()  # nothing announced: learnt from the first dump that passes
    s = Sample("s1", [1, 2, 3])
    nan = dump_of(tmp_path, "hsdump-a", [1, 2, 3], "float16", 0x7E00)
    with pytest.raises(NonFiniteValues):
        load_dump(nan, sample=s, rid="hsdump-a", expected=expected)
    good = dump_of(tmp_path, "hsdump-b", [1, 2, 3], "bfloat16", 0x3F80)
    assert load_dump(good, sample=s, rid="hsdump-b", expected=expected).meta is not None
    assert (expected.dtype, expected.layer_ids, expected.hidden_size) == ("bfloat16", [1, 2], 4)
    other = dump_of(tmp_path, "hsdump-c", [1, 2, 3], "float16", 0x3C00)
    with pytest.raises(DtypeMismatch, match="'float16', expected 'bfloat16'"):
        load_dump(other, sample=s, rid="hsdump-c", expected=expected)


@pytest.mark.parametrize(
    ("layers", "hidden", "found"),
    [([1, 2], 0, "hidden_size 0, outside"), ([], 4, "no aux layers"), ([2, 2], 4, "[2, 2]")],
)
def test_a_dump_of_impossible_sizes_is_refused_when_nothing_is_expected_yet(
    tmp_path: Path, layers: list[int], hidden: int, found: str
) -> None:
    meta = DumpMeta(
        rid="hsdump-a", input_ids=[1], num_tokens=1, layer_ids=layers, final_norm="post_norm",
        hidden_size=hidden, dtype="bfloat16", aux_shape=(1, len(layers), hidden),
        final_shape=(1, hidden), producer=ProducerInfo(name="test", version="1"),
    )  # fmt: skip
    path = tmp_path / "req_hsdump-a"
    path.mkdir()
    (path / "meta.json").write_text(meta.model_dump_json())
    np.full(len(layers) * hidden, 0x3F80, np.uint16).tofile(path / "aux.bin")
    np.full(hidden, 0x3F80, np.uint16).tofile(path / "final.bin")
    (path / "done").touch()
    with pytest.raises(DumpValidationError, match=re.escape(found)):
        load_dump(path, sample=Sample("s1", [1]), rid="hsdump-a", expected=Expected())
