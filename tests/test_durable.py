"""What the store reports as committed is on disk: the order of its flushes and renames.

The file system calls of a local store are recorded as they happen (``fdatasync``, ``fsync``,
``rename``), and the commit protocol is read off the record: a shard's data is flushed before it
is renamed into place, its directory after; a part's ``zarr.json`` (the commit point) is renamed
only after every file it references is on disk, and its directory is flushed before ``flush``
returns. The power-loss harness (tests/test_power_loss.py) checks the outcome of the same
protocol after simulated crashes.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from store_crash_writer import make_sample, open_test_store

Event = tuple[str, str]  # (call, path)


@pytest.fixture
def syscalls(monkeypatch: pytest.MonkeyPatch) -> list[Event]:
    """Every fdatasync, fsync and rename of this process, in order, with the path it touched."""
    events: list[Event] = []
    real = {name: getattr(os, name) for name in ("fdatasync", "fsync", "replace", "link")}

    def on_fd(name: str):  # type: ignore[no-untyped-def]
        def call(fd: int) -> None:
            events.append((name, os.readlink(f"/proc/self/fd/{fd}")))
            real[name](fd)

        return call

    def on_rename(name: str):  # type: ignore[no-untyped-def]
        def call(src: str, dst: str) -> None:
            real[name](src, dst)
            events.append(("rename", os.fspath(dst)))

        return call

    monkeypatch.setattr(os, "fdatasync", on_fd("fdatasync"))
    monkeypatch.setattr(os, "fsync", on_fd("fsync"))
    monkeypatch.setattr(os, "replace", on_rename("replace"))
    monkeypatch.setattr(os, "link", on_rename("link"))
    return events


def _index(events: list[Event], call: str, path: Path | str) -> int:
    return events.index((call, os.fspath(path)))


def test_a_shard_is_flushed_then_renamed_then_its_directory_flushed(
    tmp_path: Path, syscalls: list[Event]
) -> None:
    with open_test_store(str(tmp_path / "s.zarr")) as store:
        store.write(make_sample(0))
        store.flush()
    shards = sorted((tmp_path / "s.zarr" / "part-default" / "hidden").glob("c.*"))
    assert shards
    for shard in shards:
        renamed = _index(syscalls, "rename", shard)
        flushed = [i for i, (c, p) in enumerate(syscalls) if c == "fdatasync" and shard.name in p]
        assert flushed and flushed[-1] < renamed, (
            f"{shard.name}: renamed before its data was flushed"
        )
        assert ("fsync", os.fspath(shard.parent)) in syscalls[renamed:]


def test_the_commit_point_is_written_after_what_it_references_and_flushed_before_flush_returns(
    tmp_path: Path, syscalls: list[Event]
) -> None:
    store = open_test_store(str(tmp_path / "s.zarr"))
    store.write(make_sample(1))
    store.write(make_sample(2))
    before = len(syscalls)
    store.flush()
    after = syscalls[before:]
    part = tmp_path / "s.zarr" / "part-default"
    commits = [i for i, e in enumerate(after) if e == ("rename", os.fspath(part / "zarr.json"))]
    assert commits, "flush commits by renaming the part's zarr.json"
    last = commits[-1]
    data = [
        i for i, (c, p) in enumerate(after) if c == "rename" and p != os.fspath(part / "zarr.json")
    ]
    assert data and max(data) < last, "a file the commit references was renamed after it"
    assert ("fsync", os.fspath(part)) in after[last:], "the commit's directory is not flushed"
    store.close()
    with open_test_store(str(tmp_path / "s.zarr"), "r") as reader:
        assert set(reader.committed_ids()) == {"s1", "s2"}


def test_a_store_opened_from_a_zarr_local_store_is_written_durably_too(
    tmp_path: Path, syscalls: list[Event]
) -> None:
    from zarr.storage import LocalStore

    with open_test_store(LocalStore(tmp_path / "s.zarr")) as store:  # type: ignore[arg-type]
        store.write(make_sample(3))
    zarr_json = os.fspath(tmp_path / "s.zarr" / "part-default" / "zarr.json")
    flushed = [p for c, p in syscalls if c == "fdatasync"]
    assert any(p.startswith(zarr_json) for p in flushed)


@pytest.mark.anyio
async def test_a_run_counts_a_sample_done_only_once_its_commit_is_on_disk(tmp_path: Path) -> None:
    from hsdump import (
        ExtractionSummary,
        HiddenStateClient,
        RunOptions,
        Sample,
        StoreOptions,
        open_store,
        run_extraction,
    )
    from hsdump.testing import FakeServer

    samples = [Sample(f"s{i}", [i + 1] * 6) for i in range(6)]
    seen: list[tuple[int, int]] = []  # (samples done, samples committed) at each report
    # No commit until the run's last flush: a sample written to a shard is not yet done.
    options = StoreOptions(commit_interval_s=3600)
    with (
        FakeServer(tmp_path / "dumps", hidden_size=8) as server,
        open_store(tmp_path / "s.zarr", "a", options=options) as store,
    ):

        def report(summary: ExtractionSummary) -> None:
            seen.append((summary.samples_done, len(store)))

        async with HiddenStateClient(server.url, dump_dir=server.dump_dir) as client:
            run = RunOptions(progress=report)
            summary = await run_extraction(samples, client=client, store=store, options=run)
    assert summary.samples_done == 6 and summary.tokens_done == 36
    assert all(done == committed for done, committed in seen)
    assert seen[-2][0] == 0, "samples written but not committed were counted as done"
