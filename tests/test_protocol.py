"""Dump protocol v1: what producers write is what the client's reader gives back, or a clear error.

Dumps are read here through :func:`hsdump._client.loading.read_dump`, the path the client reads
every dump by.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import numpy as np
import pytest

from hsdump import (
    DumpFailed,
    DumpValidationError,
    HsdumpError,
    MomentsMismatch,
    ServerNotDumping,
)
from hsdump._client.loading import read_dump, to_torch
from hsdump._exceptions import InvalidRequestId
from hsdump._protocol import (
    DTYPES,
    Capabilities,
    DumpMeta,
    DumpWriter,
    ProducerInfo,
    ProducerManifest,
    default_dump_dir,
    dtype_spec,
    is_opted_in,
    moments_error,
    read_manifests,
    remove_dump,
    request_dir,
    row_moments,
    spot_rows,
    validate_rid,
    write_dump,
    write_error,
    write_manifest,
)

PRODUCER = ProducerInfo(name="test", version="0")


def meta(
    rid: str = "hsdump-a", t: int = 4, k: int = 2, h: int = 8, dtype: str = "bfloat16"
) -> DumpMeta:
    return DumpMeta(
        rid=rid, input_ids=list(range(t)), num_tokens=t, layer_ids=list(range(1, k + 1)),
        final_norm="post_norm", hidden_size=h, dtype=dtype, aux_shape=(t, k, h), final_shape=(t, h),
        producer=PRODUCER,
    )  # fmt: skip


def arrays(
    t: int = 4, k: int = 2, h: int = 8, dtype: str = "bfloat16"
) -> tuple[np.ndarray, np.ndarray]:
    """Finite, non-zero random states as the raw bits of ``dtype``."""
    rng = np.random.default_rng(t)
    spec = DTYPES[dtype]
    return spec.from_float32(rng.standard_normal((t, k, h)) + 0.5), spec.from_float32(
        rng.standard_normal((t, h)) + 0.5
    )


@pytest.mark.parametrize("dtype", sorted(DTYPES))
def test_round_trip_is_bit_exact_as_the_raw_bits_of_every_dtype(tmp_path: Path, dtype: str) -> None:
    aux, final = arrays(dtype=dtype)
    dump = read_dump(write_dump(tmp_path, meta(dtype=dtype), aux, final))
    assert dump.aux.dtype == DTYPES[dtype].bits_dtype == dump.final.dtype
    assert np.array_equal(dump.aux, aux) and np.array_equal(dump.final, final)
    assert dump.meta == meta(dtype=dtype).model_copy(update={"created_at": dump.meta.created_at})


@pytest.mark.parametrize("dtype", sorted(DTYPES))
def test_read_bits_view_as_the_float_tensors_that_were_dumped(tmp_path: Path, dtype: str) -> None:
    import torch

    values = torch.randn(4, 2, 8).to(getattr(torch, dtype))
    spec = DTYPES[dtype]
    path = write_dump(tmp_path, meta(dtype=dtype), spec.bits_of(values), spec.bits_of(values[:, 0]))
    tensor = to_torch(read_dump(path).aux, dtype)
    assert tensor.dtype == values.dtype and torch.equal(tensor, values)


def test_the_dtype_table_covers_exactly_the_protocol_dtypes() -> None:
    from typing import get_args

    from hsdump._protocol import DType

    assert set(DTYPES) == set(get_args(DType))
    for name, spec in DTYPES.items():
        assert spec.name == name and spec.bits_dtype.itemsize == spec.itemsize
        assert spec.bits_dtype.kind == "u"  # raw bits, never a float array, whatever the dtype


@pytest.mark.parametrize("dtype", sorted(DTYPES))
def test_the_exponent_mask_tells_finite_values_from_inf_and_nan(dtype: str) -> None:
    spec = DTYPES[dtype]
    values = np.array([np.inf, -np.inf, np.nan, 1e5, 65000.0, -1.0, 0.0], np.float32)
    bits = spec.from_float32(values)
    below = np.bitwise_and(bits, spec.magnitude_mask) < spec.exponent_mask
    assert np.array_equal(below, np.isfinite(spec.to_float32(bits)))
    assert not below[:3].any() and below[4:].all()


def test_published_dir_appears_complete_with_done_marker(tmp_path: Path) -> None:
    path = write_dump(tmp_path, meta(), *arrays())
    assert path == request_dir(tmp_path, "hsdump-a")
    assert {p.name for p in path.iterdir()} == {"meta.json", "aux.bin", "final.bin", "done"}
    assert [p.name for p in tmp_path.iterdir()] == [path.name]  # no temp dir left


def test_chunks_in_any_order_assemble_into_one_dump(tmp_path: Path) -> None:
    aux, final = arrays(t=10)
    with DumpWriter(
        tmp_path, "hsdump-c", num_tokens=10, num_layers=2, hidden_size=8, dtype="bfloat16"
    ) as w:
        for lo, hi in ((6, 10), (0, 3), (3, 6)):
            w.write_rows(lo, aux[lo:hi], final[lo:hi])
        path = w.publish(meta("hsdump-c", t=10))
    dump = read_dump(path)
    assert np.array_equal(dump.aux, aux) and np.array_equal(dump.final, final)


@pytest.mark.parametrize("spans", [[(0, 3)], [(0, 3), (2, 10)], [(1, 10)]])
def test_publish_refuses_incomplete_or_overlapping_coverage(tmp_path: Path, spans: list) -> None:
    aux, final = arrays(t=10)
    with DumpWriter(
        tmp_path, "hsdump-c", num_tokens=10, num_layers=2, hidden_size=8, dtype="bfloat16"
    ) as w:
        for lo, hi in spans:
            w.write_rows(lo, aux[lo:hi], final[lo:hi])
        with pytest.raises(ValueError, match="do not cover"):
            w.publish(meta("hsdump-c", t=10))
    assert list(tmp_path.iterdir()) == []  # the context manager removed the temp dir


def test_rows_outside_the_prompt_are_refused(tmp_path: Path) -> None:
    aux, final = arrays(t=4)
    with (
        DumpWriter(
            tmp_path, "hsdump-c", num_tokens=3, num_layers=2, hidden_size=8, dtype="bfloat16"
        ) as w,
        pytest.raises(ValueError, match="outside"),
    ):
        w.write_rows(0, aux, final)


def test_error_marker_reads_as_dump_failed_with_the_reason(tmp_path: Path) -> None:
    path = write_error(tmp_path, "hsdump-e", "prefix cache hit of 64 tokens", PRODUCER)
    with pytest.raises(DumpFailed, match="prefix cache hit of 64 tokens") as info:
        read_dump(path, sample_id="s9")
    assert info.value.sample_id == "s9" and info.value.rid == "hsdump-e"


def test_a_non_finite_value_in_a_dump_is_refused_by_its_reader(tmp_path: Path) -> None:
    aux, final = arrays(dtype="float16")
    aux[2, 1, 3] = DTYPES["float16"].from_float32(np.float32(np.inf))
    path = write_dump(tmp_path, meta(dtype="float16"), aux, final)
    with pytest.raises(DumpValidationError, match="NaN or Inf at token 2"):
        read_dump(path)


def test_truncated_tensor_file_is_a_validation_error(tmp_path: Path) -> None:
    path = write_dump(tmp_path, meta(), *arrays())
    (path / "aux.bin").write_bytes(b"\0" * 10)
    with pytest.raises(DumpValidationError, match="holds 10 bytes"):
        read_dump(path)


def test_meta_with_inconsistent_shapes_is_refused(tmp_path: Path) -> None:
    path = write_dump(tmp_path, meta(), *arrays())
    data = json.loads((path / "meta.json").read_text())
    data["num_tokens"] = 5
    (path / "meta.json").write_text(json.dumps(data))
    with pytest.raises(DumpValidationError, match=r"meta\.json"):
        read_dump(path)


def test_meta_is_json_and_tensors_are_raw_bytes_never_pickle(tmp_path: Path) -> None:
    path = write_dump(tmp_path, meta(), *arrays())
    json.loads((path / "meta.json").read_text())
    assert (path / "aux.bin").stat().st_size == 4 * 2 * 8 * 2


def test_a_dump_that_is_a_link_is_refused(tmp_path: Path) -> None:
    theirs = write_dump(tmp_path / "elsewhere", meta(), *arrays())
    link = request_dir(tmp_path / "root", "hsdump-a")
    link.parent.mkdir()
    link.symlink_to(theirs)
    refusal = re.escape(f"{link} is a symbolic link to {theirs}")
    with pytest.raises(DumpValidationError, match=refusal) as info:
        read_dump(link, sample_id="s1")
    assert info.value.rid == "hsdump-a" and info.value.sample_id == "s1"
    assert "writable only by" in str(info.value)


def test_removing_a_dump_that_is_a_link_removes_the_link_not_its_target(tmp_path: Path) -> None:
    other = write_dump(tmp_path, meta("hsdump-other"), *arrays())  # another request's dump
    link = request_dir(tmp_path, "hsdump-a")
    link.symlink_to(other)
    remove_dump(link)
    assert not os.path.lexists(link)
    assert {p.name for p in other.iterdir()} == {"meta.json", "aux.bin", "final.bin", "done"}


@pytest.mark.parametrize("name", ["meta.json", "aux.bin", "final.bin", "done"])
def test_a_dump_holding_a_link_is_refused_and_removed_without_following_it(
    tmp_path: Path, name: str
) -> None:
    path = write_dump(tmp_path / "root", meta(), *arrays())
    outside = tmp_path / "outside"
    (path / name).rename(outside)
    (path / name).symlink_to(outside)
    with pytest.raises(DumpValidationError, match=re.escape(f"{path / name} is a symbolic link")):
        read_dump(path)
    remove_dump(path)
    assert not os.path.lexists(path) and outside.exists()


def test_a_fifo_in_a_files_place_is_refused_without_blocking(tmp_path: Path) -> None:
    path = write_dump(tmp_path, meta(), *arrays())
    (path / "meta.json").unlink()
    os.mkfifo(path / "meta.json")  # opening one to read would wait for a writer forever
    with pytest.raises(DumpValidationError, match=r"meta\.json is a FIFO, expected a regular"):
        read_dump(path)


@pytest.mark.parametrize("rid", ["../x", "a/b", "", ".x", "x" * 201, "a b", "..", "-x"])
def test_unsafe_rids_are_refused_with_an_hsdump_error(rid: str) -> None:
    with pytest.raises(InvalidRequestId, match="is not a valid dump name") as info:
        validate_rid(rid)
    assert isinstance(info.value, HsdumpError) and isinstance(info.value, ValueError)
    assert not is_opted_in(rid, prefix="")


def test_only_prefixed_rids_opt_in() -> None:
    assert is_opted_in("hsdump-abc")
    assert not is_opted_in("HEALTH_CHECK_1") and not is_opted_in("0f3a") and not is_opted_in(None)


def test_dump_dir_comes_from_the_environment_at_call_time(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("HSDUMP_DUMP_DIR", raising=False)
    assert default_dump_dir() == Path("/dev/shm/hsdump")
    monkeypatch.setenv("HSDUMP_DUMP_DIR", "/tmp/elsewhere")
    assert default_dump_dir() == Path("/tmp/elsewhere")


def test_manifests_announce_producers(tmp_path: Path) -> None:
    with pytest.raises(ServerNotDumping, match="no server is dumping"):
        read_manifests(tmp_path)
    m = ProducerManifest(
        producer=PRODUCER, layer_ids=[2, 4], final_norm="post_norm", hidden_size=8,
        dtype="bfloat16",
        capabilities=Capabilities(chunked_prefill_assembly=True, prefix_cache_guard=True),
    )  # fmt: skip
    write_manifest(tmp_path, m)
    (found,) = read_manifests(tmp_path)
    assert found == m and found.is_alive()
    assert not found.model_copy(update={"pid": 2**22 + 12345}).is_alive()


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
def test_every_protocol_dtype_loads_as_checked_torch_tensors(tmp_path: Path, dtype: str) -> None:
    import torch

    from hsdump import NonFiniteValues, Sample
    from hsdump._client.loading import load_dump
    from hsdump._client.validate import Expected

    values = torch.linspace(0.5, 3.0, 4 * 3 * 8).reshape(4, 3, 8).to(getattr(torch, dtype))
    raw = values.view(torch.uint16) if dtype == "bfloat16" else values
    aux, final = raw[:, :2].contiguous().numpy(), raw[:, 2].contiguous().numpy()
    sample = Sample(id="s1", input_ids=list(range(4)))
    path = write_dump(tmp_path, meta(dtype=dtype), aux, final)
    loaded = load_dump(path, sample=sample, rid="hsdump-a", expected=Expected())
    assert loaded.aux_hidden_states.dtype == values.dtype
    assert torch.equal(loaded.aux_hidden_states, values[:, :2])
    assert torch.equal(loaded.final_hidden_state, values[:, 2])
    aux[3, 1, 5] = 0x7FC0 if dtype == "bfloat16" else np.nan  # a NaN, in bits for bf16
    path = write_dump(tmp_path, meta(rid="hsdump-b", dtype=dtype), aux, final)
    with pytest.raises(NonFiniteValues, match="token 3"):
        load_dump(path, sample=sample, rid="hsdump-b", expected=Expected())


def test_moments_written_later_must_cover_the_dump_before_it_is_published(tmp_path) -> None:
    aux, final = arrays(t=6)
    moments = row_moments(aux, final, "bfloat16")
    with DumpWriter(
        tmp_path, "hsdump-m", num_tokens=6, num_layers=2, hidden_size=8, dtype="bfloat16",
        moments=True,
    ) as w:  # fmt: skip
        w.write_rows(0, aux, final, moments_later=True)
        w.write_moments(0, moments[:4])
        with pytest.raises(ValueError, match=r"moments \[\(0, 4\)\] do not cover"):
            w.publish(meta("hsdump-m", t=6))
        w.write_moments(4, moments[4:])
        path = w.publish(meta("hsdump-m", t=6))
    assert np.array_equal(read_dump(path, moments=True).moments, moments)


def test_moments_for_a_writer_without_them_or_outside_the_dump_are_refused(tmp_path) -> None:
    aux, final = arrays(t=3)
    moments = row_moments(aux, final, "bfloat16")
    common = {"num_tokens": 3, "num_layers": 2, "hidden_size": 8, "dtype": "bfloat16"}
    with (
        DumpWriter(tmp_path, "hsdump-n", **common) as w,
        pytest.raises(ValueError, match="without"),
    ):
        w.write_moments(0, moments)
    with DumpWriter(tmp_path, "hsdump-o", moments=True, **common) as w:
        with pytest.raises(ValueError, match="not whole rows"):
            w.write_moments(1, moments)
        with pytest.raises(ValueError, match="not those of 3 rows"):
            w.write_rows(0, aux, final, moments[:2])


# --- row moments (moments.bin) --------------------------------------------------------------


def _moment_rows(n: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    values = np.random.default_rng(seed).standard_normal((n, 4, 64), dtype=np.float32)
    bits = dtype_spec("bfloat16").from_float32(values)
    return np.ascontiguousarray(bits[:, :3]), np.ascontiguousarray(bits[:, 3])


def test_moments_summed_in_another_order_pass_the_check() -> None:
    import torch

    aux, final = _moment_rows(10)
    bits = np.concatenate([aux, final[:, None]], axis=1).view(np.int16)
    wide = torch.from_numpy(bits).view(torch.bfloat16).float()
    other = torch.stack((wide.flip(-1).cumsum(-1)[..., -1], (wide * wide).sum(-1)), -1).numpy()
    rows = spot_rows(10)
    assert moments_error(other, aux, final, "bfloat16", rows, layer_ids=[1, 2, 3],
                         sample_id="s", rid="r") is None  # fmt: skip


@pytest.mark.parametrize(
    ("spoil", "where"),
    [
        (lambda m: np.roll(m, 1, axis=0), "at token 0, aux layer 1"),  # rows moved by one
        (lambda m: m[:, [1, 0, 2, 3]], "at token 0, aux layer 1"),  # two layers swapped
        (lambda m: np.concatenate([m[:, :3], m[:, 3:] * 1.01], axis=1), "the final state"),
    ],
    ids=["rows-moved", "layers-swapped", "final-off-by-1pct"],
)
def test_moments_of_other_values_are_named(spoil, where: str) -> None:
    aux, final = _moment_rows(10)
    moments = np.ascontiguousarray(spoil(row_moments(aux, final, "bfloat16")))
    error = moments_error(moments, aux, final, "bfloat16", spot_rows(10), layer_ids=[1, 2, 3],
                          sample_id="s", rid="r")  # fmt: skip
    assert isinstance(error, MomentsMismatch) and where in str(error)


def test_spot_rows_take_the_ends_and_distinct_rows_between() -> None:
    rows = spot_rows(5000, 16)
    assert len(rows) == 16 and rows[0] == 0 and rows[-1] == 4999
    assert len(set(rows.tolist())) == 16 and np.all(np.diff(rows) > 0)
    assert spot_rows(7, 16).tolist() == list(range(7))
