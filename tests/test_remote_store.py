"""A store part written by a store process (`RemoteStore`): what reaches it, what comes back."""

from __future__ import annotations

import gc
import mmap
import os
import signal
from pathlib import Path

import anyio
import pytest
import torch

from hsdump import (
    DumpValidationError,
    HiddenStateClient,
    HiddenStates,
    InputError,
    Sample,
    SampleExistsError,
    StoreError,
    open_store,
)
from hsdump._mapped import attach, share
from hsdump._store.remote import RemoteStore, StoreProcessLost
from hsdump.testing import FakeServer

pytestmark = pytest.mark.timeout(120)


def _states(i: int, tokens: int = 24, hidden: int = 16) -> HiddenStates:
    gen = torch.Generator().manual_seed(i)
    return HiddenStates(
        sample_id=f"s{i}",
        input_ids=torch.randint(0, 100, (tokens,), generator=gen),
        aux_hidden_states=torch.randn(tokens, 3, hidden, generator=gen).bfloat16(),
        final_hidden_state=torch.randn(tokens, hidden, generator=gen).bfloat16(),
        layer_ids=[1, 2, 3],
    )


def _same(a: HiddenStates, b: HiddenStates) -> bool:
    return (
        torch.equal(a.aux_hidden_states, b.aux_hidden_states)
        and torch.equal(a.final_hidden_state, b.final_hidden_state)
        and a.input_ids.tolist() == b.input_ids.tolist()
    )


def _open_fds() -> set[str]:
    return set(os.listdir("/proc/self/fd"))


def test_a_store_process_stores_what_it_is_sent(tmp_path: Path) -> None:
    with RemoteStore(tmp_path / "s.zarr", writer_id="w0") as store:
        assert all(store.write(_states(i)) for i in range(5))
        store.flush()
        assert "s3" in store and "s9" not in store
        counted = (store.bytes_raw_written, store.bytes_stored)
        assert store.cpu_s > 0 and store.peak_rss_bytes > 0
    with open_store(tmp_path / "s.zarr", "r") as opened:
        assert sorted(opened) == [f"s{i}" for i in range(5)]
        assert all(_same(opened[f"s{i}"], _states(i)) for i in range(5))
        assert counted == (opened.bytes_raw, opened.bytes_stored)


def test_its_errors_come_back_as_the_same_errors(tmp_path: Path) -> None:
    bad = _states(7)
    bad = HiddenStates(
        sample_id="bad", input_ids=bad.input_ids, aux_hidden_states=bad.aux_hidden_states,
        final_hidden_state=bad.final_hidden_state[:5], layer_ids=[1, 2, 3],
    )  # fmt: skip
    with RemoteStore(tmp_path / "s.zarr", writer_id="w0") as store:
        store.write(_states(1))
        with pytest.raises(SampleExistsError, match="already in the store") as exists:
            store.write(_states(1))
        assert exists.value.sample_id == "s1"
        with pytest.raises(InputError, match="shapes do not fit") as shapes:
            store.write(bad)
        assert shapes.value.sample_id == "bad"
        assert not store.write(_states(1), if_exists="skip")


def test_a_store_process_that_dies_is_a_store_error_and_keeps_its_commits(tmp_path: Path) -> None:
    store = RemoteStore(tmp_path / "s.zarr", writer_id="w0").open()
    store.write(_states(1))
    store.flush()
    os.kill(store._process.pid, signal.SIGKILL)
    with pytest.raises(
        StoreProcessLost, match=r"exited \(code -9\).*a rerun redoes the rest"
    ) as lost:
        store.write(_states(2))
    assert lost.value.sample_id == "s2"
    store.close()  # closed already: nothing more to do
    assert isinstance(StoreProcessLost("x"), StoreError)
    with open_store(tmp_path / "s.zarr", "r") as opened:
        assert sorted(opened) == ["s1"]


def test_opening_what_cannot_be_opened_says_why_and_ends_the_process(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("not a store")
    store = RemoteStore(tmp_path / "file", writer_id="w0")
    with pytest.raises(StoreError, match="file"):
        store.open()
    assert store._process.poll() is not None
    with pytest.raises(StoreError, match="closed"):
        store.write(_states(1))


def test_closing_leaves_no_process_and_no_descriptor(tmp_path: Path) -> None:
    before = _open_fds()
    with RemoteStore(tmp_path / "s.zarr", writer_id="w0") as store:
        store.write(_states(1))
    assert store._process.returncode == 0
    gc.collect()
    assert _open_fds() <= before


async def _extracted(server: FakeServer, sample: Sample) -> HiddenStates:
    async with HiddenStateClient(server.url, dump_dir=server.dump_dir) as client:
        return await client.extract(sample)


def test_a_dump_reaches_the_store_process_as_its_own_pages(tmp_path: Path) -> None:
    sample = Sample("a", list(range(40)))
    with FakeServer(tmp_path / "dumps", hidden_size=16) as server:
        states = anyio.run(_extracted, server, sample)
        assert not [p for p in server.dump_dir.iterdir() if p.name.startswith("req_")]
    shared = [share(t) for t in (states.aux_hidden_states, states.final_hidden_state)]
    assert [owned for _, owned, _ in shared] == [False, False]  # the dump's mapping, no copy
    with RemoteStore(tmp_path / "s.zarr", writer_id="w0") as store:
        store.write(states)
    with open_store(tmp_path / "s.zarr", "r") as opened:
        assert _same(opened["a"], states)


def test_other_tensors_are_copied_into_a_memory_file_of_their_own() -> None:
    states = _states(3)
    fd, owned, where = share(states.aux_hidden_states[:, 1:])  # a strided view
    try:
        assert owned
        assert torch.equal(attach(fd, where), states.aux_hidden_states[:, 1:])
    finally:
        os.close(fd)


def test_a_file_cut_short_after_sharing_cannot_be_attached() -> None:
    fd, _, where = share(_states(4, tokens=2048).final_hidden_state)  # 16 pages
    try:
        os.ftruncate(fd, mmap.PAGESIZE)
        with pytest.raises((OSError, ValueError)):
            attach(fd, where)
    finally:
        os.close(fd)


def test_a_cut_dump_is_a_validation_error_of_its_sample(tmp_path: Path, monkeypatch) -> None:
    import hsdump._mapped as mapped

    real = mapped.share

    def cut(tensor: torch.Tensor):
        fd, owned, where = real(tensor)
        os.ftruncate(fd, 0)
        return fd, owned, where

    monkeypatch.setattr(mapped, "share", cut)
    with RemoteStore(tmp_path / "s.zarr", writer_id="w0") as store:
        with pytest.raises(DumpValidationError, match="could not map") as cut_short:
            store.write(_states(5))
        assert cut_short.value.sample_id == "s5"
        monkeypatch.setattr(mapped, "share", real)
        assert store.write(_states(6))
