"""The store through its public seam: round trips, refusals, provenance, stats, corruption."""

from __future__ import annotations

import math
import threading
from pathlib import Path
from typing import Any

import anyio
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays
from store_crash_writer import make_sample, open_test_store
from zarr.storage import MemoryStore

from hsdump import (
    ConfigError,
    DumpMeta,
    HiddenStates,
    InputError,
    NotAStoreError,
    ProducerInfo,
    ProvenanceMismatch,
    SampleExistsError,
    SampleNotFoundError,
    StoreClosedError,
    StoreCorruptedError,
    StoreExistsError,
    StoreIOError,
    StoreNotFoundError,
    StoreOptions,
    StoreReadOnlyError,
    StoreWriteFailedError,
    open_store,
    verify_store,
)

# NaN, +-Inf, -0, the smallest and largest subnormals (positive and negative), the largest finite.
SPECIAL_BF16 = [0x7FC0, 0xFFC1, 0x7F80, 0xFF80, 0x8000, 0x0001, 0x007F, 0x8001, 0x807F, 0x7F7F]


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16) if t.element_size() == 2 else t.view(torch.int32)


def _assert_same(got: HiddenStates, want: HiddenStates) -> None:
    assert got.sample_id == want.sample_id
    assert torch.equal(_bits(got.aux_hidden_states), _bits(want.aux_hidden_states))
    assert torch.equal(_bits(got.final_hidden_state), _bits(want.final_hidden_state))
    assert got.aux_hidden_states.dtype == want.aux_hidden_states.dtype
    assert torch.equal(got.input_ids, want.input_ids.long())
    assert got.layer_ids == want.layer_ids
    if want.loss_mask is None:
        assert got.loss_mask is None
    else:
        assert got.loss_mask is not None and torch.equal(
            got.loss_mask, want.loss_mask.to(torch.uint8)
        )


def _from_bits(bits: np.ndarray, sid: str = "x", mask: bool = False) -> HiddenStates:
    t, layers, _ = bits.shape
    hidden = torch.from_numpy(bits.copy()).view(torch.bfloat16)
    ids = torch.arange(t) * 7
    return HiddenStates(
        sid,
        ids,
        hidden[:, :-1],
        hidden[:, -1],
        list(range(1, layers)),
        torch.ones(t, dtype=torch.uint8) if mask else None,
    )


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    bits=st.tuples(st.integers(1, 70), st.integers(2, 4), st.integers(1, 9)).flatmap(
        lambda shape: arrays(
            np.uint16, shape, elements=st.sampled_from(SPECIAL_BF16) | st.integers(0, 0xFFFF)
        )
    ),
    mask=st.booleans(),
)
def test_bf16_round_trip_is_bit_exact_with_nan_inf_negative_zero_and_subnormals(
    bits: np.ndarray, mask: bool
) -> None:
    sample = _from_bits(bits, mask=mask)
    with open_store(MemoryStore(), "a", shard_tokens=32, chunk_tokens=8) as store:
        store.write(sample)
        store.flush()
        _assert_same(store["x"], sample)


def test_strided_views_are_stored_as_their_values_and_verify(tmp_path: Path) -> None:
    # Views with a step in every axis: the store places them without a contiguous copy.
    full = torch.randn(2 * 70, 2 * 4, 2 * 9, generator=torch.Generator().manual_seed(3))
    hidden = full.to(torch.bfloat16)[::2, ::2, ::2]
    want = HiddenStates("v", torch.arange(70), hidden[:, :3], hidden[:, 3], [1, 2, 3])
    assert not want.aux_hidden_states.is_contiguous()
    with open_store(str(tmp_path / "s.zarr"), "a", shard_tokens=32, chunk_tokens=8) as store:
        store.write(want)
    with open_store(str(tmp_path / "s.zarr"), "r") as store:
        _assert_same(store["v"], want)
        assert store.verify().clean


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_other_float_dtypes_round_trip_bit_exact(dtype: torch.dtype) -> None:
    want = make_sample(3)
    want.aux_hidden_states = want.aux_hidden_states.to(dtype)
    want.final_hidden_state = want.final_hidden_state.to(dtype)
    with open_store(MemoryStore(), "a") as store:
        store.write(want)
    _assert_same(store["s3"], want)


def test_samples_survive_close_reopen_and_appending_into_a_partial_shard(tmp_path: Path) -> None:
    path = str(tmp_path / "s.zarr")
    with open_test_store(path) as store:
        for i in range(5):
            store.write(make_sample(i))
    with open_test_store(path) as store:
        for i in range(5, 12):
            store.write(make_sample(i))
    with open_store(path, "r") as store:
        assert sorted(store) == sorted(f"s{i}" for i in range(12))
        for i in range(12):
            _assert_same(store[f"s{i}"], make_sample(i))
        assert store.verify().clean


def test_plain_zarr_reads_the_bits_hsdump_wrote(tmp_path: Path) -> None:
    import zarr

    path = tmp_path / "s.zarr"
    with open_test_store(str(path)) as store:
        for i in range(6):
            store.write(make_sample(i))
        store.flush()
        part, offset, length = store.locate("s4")
    group = zarr.open_group(path, mode="r")
    bits = group[f"{part}/hidden"][offset : offset + length]
    assert group[f"{part}/hidden"].attrs["logical_dtype"] == "bfloat16"
    want = make_sample(4)
    assert np.array_equal(bits[:, :3], want.aux_hidden_states.view(torch.uint16).numpy())
    assert np.array_equal(bits[:, 3], want.final_hidden_state.view(torch.uint16).numpy())
    assert np.array_equal(
        group[f"{part}/input_ids"][offset : offset + length], want.input_ids.numpy()
    )


def test_buffered_samples_become_visible_on_flush() -> None:
    with open_store(MemoryStore(), "a", shard_tokens=4096, chunk_tokens=16) as store:
        store.write(make_sample(1))
        assert "s1" not in store and len(store) == 0
        store.flush()
        assert "s1" in store and list(store) == ["s1"] and store.committed_ids() == {"s1"}


def test_duplicate_id_is_refused_whether_committed_or_buffered() -> None:
    with open_store(MemoryStore(), "a", shard_tokens=4096) as store:
        store.write(make_sample(1))
        with pytest.raises(SampleExistsError, match="if_exists='skip'"):
            store.write(make_sample(1))
        store.flush()
        with pytest.raises(SampleExistsError, match="s1"):
            store.write(make_sample(1))
        assert len(store) == 1


def test_skip_leaves_the_stored_sample_unchanged() -> None:
    with open_store(MemoryStore(), "a") as store:
        assert store.write(make_sample(1)) is True
        other = make_sample(2)
        other.sample_id = "s1"
        assert store.write(other, if_exists="skip") is False
    _assert_same(store["s1"], make_sample(1))


def test_sample_with_other_layers_is_refused_naming_both_values() -> None:
    with open_store(MemoryStore(), "a") as store:
        store.write(make_sample(1))
        with pytest.raises(
            ProvenanceMismatch, match=r"layer_ids.*\[2, 5, 7\].*\[1, 2, 3\].*new store"
        ):
            store.write(make_sample(2, layers=[1, 2, 3]))


def _with_meta(hs: HiddenStates, model: str) -> HiddenStates:
    t, k, h = hs.aux_hidden_states.shape
    hs.meta = DumpMeta(
        rid=f"hsdump-{hs.sample_id}",
        input_ids=hs.input_ids.tolist(),
        num_tokens=t,
        layer_ids=hs.layer_ids,
        final_norm="post_norm",
        hidden_size=h,
        dtype="bfloat16",
        aux_shape=(t, k, h),
        final_shape=(t, h),
        producer=ProducerInfo(name="sglang-hsdump", version="0.1"),
        model_path=model,
    )
    return hs


def test_sample_from_another_model_is_refused_and_provenance_is_recorded(tmp_path: Path) -> None:
    with open_store(tmp_path / "s.zarr", "a") as store:
        store.write(_with_meta(make_sample(1), "org/model-a"))
        store.write(make_sample(3))  # built by hand: only its tensors are compared
        with pytest.raises(ProvenanceMismatch, match=r"model_path.*org/model-a.*org/model-b"):
            store.write(_with_meta(make_sample(2), "org/model-b"))
    with open_store(tmp_path / "s.zarr", "r") as store:
        prov = store.provenance
        assert (
            prov is not None and prov.model_path == "org/model-a" and prov.final_norm == "post_norm"
        )
        assert prov.codec["name"] == "zstd" and prov.hsdump_version
        assert store["s1"].attrs["provenance"]["producer_name"] == "sglang-hsdump"


def test_second_writer_part_with_other_settings_is_refused(tmp_path: Path) -> None:
    with open_store(tmp_path / "s.zarr", "a", writer_id="a") as store:
        store.write(make_sample(1))
    with (
        open_store(tmp_path / "s.zarr", "a", writer_id="b") as store,
        pytest.raises(ProvenanceMismatch),
    ):
        store.write(make_sample(2, hidden=16))


def test_mismatched_shapes_are_refused_with_the_expected_shape() -> None:
    bad = make_sample(1)
    bad.final_hidden_state = bad.final_hidden_state[:, :5]
    with open_store(MemoryStore(), "a") as store, pytest.raises(InputError, match="aux must be"):
        store.write(bad)


def test_modes_refuse_missing_existing_read_only_and_closed_stores(tmp_path: Path) -> None:
    path = tmp_path / "s.zarr"
    with pytest.raises(StoreNotFoundError, match="no store"):
        open_store(path, "r")
    store = open_store(path, "w")
    store.write(make_sample(1))
    store.close()
    with pytest.raises(StoreClosedError, match="open it again"):
        store.write(make_sample(2))
    with pytest.raises(StoreExistsError, match="mode='a'"):
        open_store(path, "w")
    with open_store(path, "r") as reader, pytest.raises(StoreReadOnlyError, match="mode='a'"):
        reader.write(make_sample(2))


def test_a_zarr_group_that_is_not_a_store_is_refused(tmp_path: Path) -> None:
    import zarr

    zarr.open_group(tmp_path / "other.zarr", mode="w", attributes={"owner": "someone else"})
    for mode in ("r", "a", "w"):
        with pytest.raises(NotAStoreError, match="not an hsdump store"):
            open_store(tmp_path / "other.zarr", mode)  # type: ignore[arg-type]


def test_an_unknown_compression_is_refused_at_open_and_creates_nothing(tmp_path: Path) -> None:
    with pytest.raises(InputError, match=r"'zstd', 'lz4' or 'none', got 'brotli'"):
        open_store(tmp_path / "s.zarr", "a", compression="brotli")  # type: ignore[arg-type]
    assert not (tmp_path / "s.zarr").exists()


def test_missing_sample_raises_a_key_error_naming_it() -> None:
    with (
        open_store(MemoryStore(), "a") as store,
        pytest.raises(SampleNotFoundError, match="nope") as info,
    ):
        store["nope"]
    assert isinstance(info.value, KeyError)


def test_memory_store_backend_is_shared_by_a_second_handle() -> None:
    backend = MemoryStore()
    with open_store(backend, "a") as store:
        for i in range(4):
            store.write(make_sample(i))
    with open_store(backend, "r") as reader:
        assert len(reader) == 4
        _assert_same(reader["s2"], make_sample(2))


def test_corrupted_shard_is_found_by_verify_and_by_checked_reads(tmp_path: Path) -> None:
    path = tmp_path / "s.zarr"
    with open_test_store(str(path)) as store:
        for i in range(6):
            store.write(make_sample(i))
    shard = sorted((path / "part-default" / "hidden").glob("c.*"))[0]
    data = bytearray(shard.read_bytes())
    for pos in range(100, len(data) // 2, 97):
        data[pos] ^= 0x5A
    shard.write_bytes(bytes(data))
    report = verify_store(path)
    assert not report.clean and report.checked == 6 and report.corrupted[0].sample_id == "s0"
    with (
        open_store(path, "r", verify_reads=True) as store,
        pytest.raises(StoreCorruptedError, match="verify-store"),
    ):
        store["s0"]


def test_stats_match_numpy_including_non_finite_values() -> None:
    samples = [make_sample(i) for i in range(4)]
    samples[1].aux_hidden_states[3, 0, :4] = torch.tensor(
        [float("nan"), float("inf"), -float("inf"), 1e30]
    )
    # A sample of 292 rows: a finite block, then a block with a NaN (merged per sample).
    samples[3].final_hidden_state[280, 5] = float("nan")
    with open_store(MemoryStore(), "a") as store:
        for s in samples:
            store.write(s)
    stats = store.stats()
    for layer in range(4):
        values = np.concatenate(
            [
                (s.aux_hidden_states[:, layer] if layer < 3 else s.final_hidden_state)
                .float()
                .numpy()
                .ravel()
                for s in samples
            ]
        ).astype(np.float64)
        finite = values[np.isfinite(values)]
        got = stats[layer]
        assert got.count == finite.size and got.non_finite == values.size - finite.size
        # Row sums accumulate in float32 (H values), rows in float64.
        assert got.mean == pytest.approx(finite.mean(), rel=1e-6, abs=1e-7)
        assert got.std == pytest.approx(finite.std(), rel=1e-6)
        assert got.max_abs == np.abs(finite).max()
    assert [s.layer for s in stats] == [2, 5, 7, "final"]


def test_stats_of_finite_values_whose_squares_overflow_float32_are_exact() -> None:
    sample = make_sample(3)  # 292 rows: the value sits in the second block
    sample.aux_hidden_states[100, 1, 3] = 1e25  # finite; its square is not, in float32
    with open_store(MemoryStore(), "a") as store:
        store.write(sample)
    values = sample.aux_hidden_states[:, 1].double().numpy().ravel()
    got = store.stats()[1]
    assert (got.count, got.non_finite) == (values.size, 0)
    assert got.std == pytest.approx(values.std(), rel=1e-6) and math.isfinite(got.std)
    assert got.max_abs == np.abs(values).max()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_max_abs_is_the_largest_magnitude_whichever_its_sign(dtype: torch.dtype) -> None:
    aux = torch.tensor([[-1.0, 2.0, 0.5], [3.0, -5.0, 0.25]]).repeat(4, 1, 1).transpose(1, 2)
    final = torch.tensor([[-0.5, -2.0], [-0.75, -1.5]]).repeat(2, 1)
    hs = HiddenStates("m", torch.arange(4), aux.to(dtype), final.to(dtype), [1, 2, 3])
    with open_store(MemoryStore(), "a") as store:
        store.write(hs)
    # Layer 1: the peak is positive beside negatives; layer 2: negative beside positives;
    # layer 3: all positive; final: all negative.
    assert [s.max_abs for s in store.stats()] == [3.0, 5.0, 0.5, 2.0]


def test_counters_report_raw_stored_bytes_and_tokens(tmp_path: Path) -> None:
    samples = [make_sample(i) for i in range(8)]
    with open_store(tmp_path / "s.zarr", "a") as store:
        for s in samples:
            store.write(s)
    with open_store(tmp_path / "s.zarr", "r") as store:
        assert store.num_tokens == sum(s.num_tokens for s in samples)
        assert store.bytes_raw == sum(s.nbytes for s in samples)
        assert 0 < store.bytes_stored < store.bytes_raw


class _GatedStore(MemoryStore):
    """A zarr store whose first write of an array's metadata waits for ``gate`` (10 s at most)."""

    gate: threading.Event | None = None
    waited: list[bool] | None = None

    async def set(self, key: str, value: Any, *args: Any, **kwargs: Any) -> None:
        first = self.waited == [] and key.endswith("hidden/zarr.json")
        if self.gate is not None and self.waited is not None and first:
            self.waited.append(self.gate.wait(timeout=10))  # on zarr's thread, not the loop's
        await super().set(key, value, *args, **kwargs)


@pytest.mark.anyio
async def test_async_write_runs_off_the_event_loop() -> None:
    backend = _GatedStore()
    backend.gate, backend.waited = threading.Event(), []
    store = open_store(backend, "a")

    async def tick() -> None:
        await anyio.sleep(0.01)  # runs only if the loop is free while the first write blocks
        backend.gate.set()  # type: ignore[union-attr]

    async with store, anyio.create_task_group() as tg:
        tg.start_soon(tick)
        assert await store.awrite(make_sample(1)) is True
    assert backend.waited == [True]
    with open_store(backend, "r") as reader:
        assert "s1" in reader


@pytest.mark.parametrize(
    ("variable", "options"),
    [("3600", None), ("0", StoreOptions(commit_interval_s=3600))],
    ids=["variable", "argument-over-variable"],
)
def test_commits_are_batched_while_writing_and_flush_commits_everything(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, variable: str, options: StoreOptions | None
) -> None:
    monkeypatch.setenv("HSDUMP_COMMIT_INTERVAL_S", variable)
    path, n = tmp_path / "s.zarr", 40  # ~6,000 tokens: ~47 shards of 128 tokens
    store = open_test_store(str(path), options=options)
    for i in range(n):
        store.write(make_sample(i))
    reader = open_store(path, "r")
    # At most the writer's first commit (its first shard or two): the next is an hour away,
    # although ~45 full shards are written by now.
    assert len(reader) < 5
    # The live compression ratio compares the same samples although most await their commit.
    assert store.bytes_raw < store.bytes_raw_written
    assert 1.0 < store.bytes_raw_written / store.bytes_stored < 1.6
    store.flush()
    reader.refresh()
    assert len(reader) == n
    total = sum(make_sample(i).nbytes for i in range(n))
    assert store.bytes_raw_written == store.bytes_raw == total
    store.close()


@pytest.mark.parametrize(
    ("field", "value"),
    [("shard_writers", 0), ("lease_ttl_s", -1.0), ("cores", 0), ("commit_interval_s", -0.5)],
)
def test_store_options_out_of_range_are_config_errors_naming_the_field(
    field: str, value: float
) -> None:
    with pytest.raises(ConfigError, match=rf"StoreOptions\.{field} must be .*got {value}"):
        StoreOptions(**{field: value})


def test_store_options_are_frozen() -> None:
    options = StoreOptions(shard_writers=2)
    with pytest.raises(AttributeError):
        options.shard_writers = 3  # type: ignore[misc]


def test_a_malformed_store_variable_is_a_config_error_at_open_that_creates_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HSDUMP_SHARD_WRITERS", "many")
    with pytest.raises(ConfigError, match=r"HSDUMP_SHARD_WRITERS.*'many'"):
        open_store(tmp_path / "s.zarr", "a")
    assert not (tmp_path / "s.zarr").exists()


def test_refresh_shows_samples_another_writer_committed(tmp_path: Path) -> None:
    path = tmp_path / "s.zarr"
    with open_store(path, "a", writer_id="a") as store:
        store.write(make_sample(1))
    reader = open_store(path, "r")
    with open_store(path, "a", writer_id="b") as store:
        store.write(make_sample(2))
    assert "s2" not in reader
    reader.refresh()
    assert sorted(reader) == ["s1", "s2"] and reader.lengths()["s2"] == make_sample(2).num_tokens


def test_full_disk_is_reported_as_a_store_error_saying_what_to_do(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import errno
    import os

    def no_space(*args: object) -> int:
        raise OSError(errno.ENOSPC, "No space left on device")

    store = open_store(tmp_path / "s.zarr", "a")
    monkeypatch.setattr(os, "writev", no_space)  # how the store writes shards and chunks
    with pytest.raises(StoreIOError, match="free space and rerun") as info:
        store.write(make_sample(1))
        store.flush()
    assert isinstance(info.value.__cause__, OSError)
    with pytest.raises(StoreWriteFailedError, match="open it again to resume"):
        store.write(make_sample(2))
    store.close()
    assert len(open_store(tmp_path / "s.zarr", "r")) == 0


def test_a_shard_write_that_fails_midway_leaves_no_file_and_no_temp_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import errno
    import os

    calls = {"n": 0}
    real_writev = os.writev

    def writev_then_full(fd: int, buffers: list[memoryview]) -> int:
        if "/hidden/c." not in os.readlink(f"/proc/self/fd/{fd}"):
            return real_writev(fd, buffers)  # metadata and index files: not the shard
        calls["n"] += 1
        if calls["n"] > 1:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_writev(fd, buffers[:1])  # a short write: the rest must follow

    store = open_store(tmp_path / "s.zarr", "a")
    monkeypatch.setattr(os, "writev", writev_then_full)
    with pytest.raises(StoreIOError, match="free space and rerun"):
        store.write(make_sample(1))
        store.flush()
    store.close()
    part = tmp_path / "s.zarr" / "part-default"
    assert calls["n"] == 2
    temps = list(part.rglob("*.partial"))  # the temporary files' names (docs/store.md)
    shards = [p for p in (part / "hidden").glob("c.*") if p not in temps]
    assert not shards, "no shard file may appear from a failed write"
    assert not temps, "a failed write removes its temporary file"
    monkeypatch.setattr(os, "writev", real_writev)
    with open_store(tmp_path / "s.zarr", "a") as store:
        store.write(make_sample(1))
    with open_store(tmp_path / "s.zarr", "r") as store:
        assert torch.equal(store["s1"].final_hidden_state, make_sample(1).final_hidden_state)


@pytest.mark.parametrize("writers", [1, 3])
def test_samples_straddling_shards_round_trip_with_several_shards_written_at_once(
    tmp_path: Path, writers: int
) -> None:
    """(test_codec_pool.py slows the placement of rows to check that a shard waits for it.)"""
    options = StoreOptions(shard_writers=writers)
    path = str(tmp_path / "s.zarr")
    # 128-token shards: most samples straddle two or more
    with open_test_store(path, options=options) as store:
        for i in range(30):
            store.write(make_sample(i))
    with open_test_store(path, options=options) as store:  # resumes inside a partial shard
        for i in range(30, 45):
            store.write(make_sample(i))
    with open_store(path, "r") as store:
        assert len(store) == 45
        for i in range(45):
            _assert_same(store[f"s{i}"], make_sample(i))
        assert store.verify().clean


def test_a_store_another_writer_creates_while_this_one_opens_is_joined(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two writers starting together: the one whose create finds the root already made joins it."""
    import zarr
    import zarr.errors

    path, real_open = tmp_path / "s.zarr", zarr.open_group

    def lose_the_race(*args: Any, **kwargs: Any) -> Any:
        if kwargs.get("attributes"):  # this writer's create: the first writer got there first
            monkeypatch.setattr(zarr, "open_group", real_open)
            with open_store(path, "a", writer_id="first") as first:
                first.write(make_sample(1))
            raise zarr.errors.ContainsGroupError(str(path), "")  # (store, path), as zarr raises it
        return real_open(*args, **kwargs)

    monkeypatch.setattr(zarr, "open_group", lose_the_race)
    with open_store(path, "a", writer_id="second") as second:
        second.write(make_sample(2))
    with open_store(path, "r") as store:
        assert sorted(store) == ["s1", "s2"]


def _written(tmp_path: Path, n: int = 4) -> Path:
    path = tmp_path / "s.zarr"
    with open_test_store(str(path)) as store:
        for i in range(n):
            store.write(make_sample(i))
    return path


def test_a_changed_sample_id_is_found_on_open_and_by_verify(tmp_path: Path) -> None:
    import zarr

    path = _written(tmp_path)
    reader = open_store(path, "r")  # opened before the damage: verify() reads the index again
    zarr.open_array(path / "part-default" / "index" / "sample_id", mode="r+")[1] = "s9"
    for check in (reader.verify, lambda: open_store(path, "r"), lambda: verify_store(path)):
        with pytest.raises(StoreCorruptedError, match=r"index/sample_id is damaged: checksum"):
            check()


def test_changed_statistics_are_found_by_the_part_state_checksum(tmp_path: Path) -> None:
    import json

    path = _written(tmp_path)
    meta = path / "part-default" / "zarr.json"
    doc = json.loads(meta.read_text())
    doc["attributes"]["hsdump_part"]["stats"][0]["mean"] += 1.0
    meta.write_text(json.dumps(doc))
    with pytest.raises(StoreCorruptedError, match=r"part-default/zarr.json is damaged: .*checksum"):
        open_store(path, "r")


@pytest.mark.parametrize(
    ("file", "named"),
    [
        ("zarr.json", "s.zarr/zarr.json"),
        ("part-default/zarr.json", "part-default/zarr.json"),
        ("part-default/index/rows/zarr.json", "index/rows"),
        ("part-default/index/rows/c/0/0", "index/rows"),
        ("part-default/index/sample_id/c/0", "index/sample_id"),
        ("part-default/index/tokens/c/0", "index/tokens"),
    ],
)
@pytest.mark.parametrize("mode", ["r", "a"])
def test_undecodable_metadata_is_a_store_error_naming_the_file(
    tmp_path: Path, file: str, named: str, mode: str
) -> None:
    path = _written(tmp_path)
    damaged = path / file
    data = bytearray(damaged.read_bytes())
    data[len(data) // 2] ^= 0xFF  # breaks JSON and zstd frames alike
    damaged.write_bytes(bytes(data))
    with pytest.raises(StoreCorruptedError, match=rf"{named}.* is damaged: .*backup"):
        open_store(path, mode)  # type: ignore[arg-type]


def _as_written_before_metadata_checksums(path: Path) -> None:
    """Remove what the metadata checksums added: the store then looks like an older one."""
    import json
    import shutil

    meta = path / "part-default" / "zarr.json"
    doc = json.loads(meta.read_text())
    del doc["attributes"]["hsdump_part_crc32"], doc["attributes"]["hsdump_part"]["index_crc"]
    meta.write_text(json.dumps(doc))
    shutil.rmtree(path / "part-default" / "index" / "tokens")


def test_a_store_from_before_metadata_checksums_is_read_and_covered_once_appended(
    tmp_path: Path,
) -> None:
    import zarr

    from hsdump import Sample

    path = _written(tmp_path)
    _as_written_before_metadata_checksums(path)
    with open_store(path, "r") as store:
        assert store.verify().clean and len(store) == 4
        other = Sample("s1", [1, 2, 3])
        assert store.token_mismatch(other) is None  # no digest recorded: nothing to compare
    with open_test_store(str(path)) as store:
        store.write(make_sample(4))
    with open_store(path, "r") as store:
        assert store.verify().clean
        _assert_same(store["s0"], make_sample(0))
        assert store.token_mismatch(other) is None and store.token_mismatch(Sample("s4", [1]))
    zarr.open_array(path / "part-default" / "index" / "sample_id", mode="r+")[1] = "s9"
    with pytest.raises(StoreCorruptedError, match="index/sample_id"):
        open_store(path, "r")


def test_a_bug_while_decoding_is_raised_as_itself_not_reported_as_damage(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import numcodecs

    path = _written(tmp_path)

    def buggy_decode(*args: object, **kwargs: object) -> None:
        raise TypeError("a bug in the decoder")

    monkeypatch.setattr(numcodecs.Blosc, "decode", buggy_decode)
    with open_store(path, "r") as store:
        with pytest.raises(TypeError, match="a bug in the decoder"):
            store["s0"]
        with pytest.raises(TypeError, match="a bug in the decoder"):
            store.verify()


def _tiny(i: int) -> HiddenStates:
    """Sample ``t<i>``: one token, H=2, one aux layer, bits that differ from every other's."""
    bits = np.array([[[i & 0xFFFF, i >> 16], [~i & 0xFFFF, 7]]], np.uint16)
    hidden = torch.from_numpy(bits.view(np.int16)).view(torch.bfloat16)
    return HiddenStates(f"t{i}", torch.tensor([i]), hidden[:, :1], hidden[:, 1], [3], None)


def test_the_index_grows_past_its_first_chunk_and_reads_back_after_reopening(
    tmp_path: Path,
) -> None:
    n = 4096 + 300  # the index holds 4,096 entries before it first grows
    path = tmp_path / "s.zarr"
    with open_store(path, "a", shard_tokens=1024, chunk_tokens=1) as store:
        for i in range(n):
            store.write(_tiny(i))
    with open_store(path, "r") as store:
        assert len(store) == n
        for i in range(n):
            _assert_same(store[f"t{i}"], _tiny(i))
    with open_store(path, "a", shard_tokens=1024, chunk_tokens=1) as store:  # resumes past it
        store.write(_tiny(n))
    with open_store(path, "r") as store:
        assert len(store) == n + 1
        for i in (0, 4095, 4096, n):
            _assert_same(store[f"t{i}"], _tiny(i))
