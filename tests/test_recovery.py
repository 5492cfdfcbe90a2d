"""Recovery after an unclean stop: damaged samples are found, left out, named and written again.

A writer process commits samples and is killed (SIGKILL: nothing runs after it); the bytes of its
shards are then damaged on purpose, as a disk that lost flushed writes would leave them.
"""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from store_crash_writer import (
    as_sample,
    killed_past_its_commit,
    make_sample,
    open_test_store,
    shards_past_commit,
)
from typer.testing import CliRunner

from hsdump import SampleNotFoundError, run_ray_extraction, verify_store
from hsdump.testing import cli_app

IDS = [f"s{i}" for i in range(6)]

_WRITER = """
import sys
from store_crash_writer import make_sample, open_test_store
store = open_test_store(sys.argv[1], writer_id="w")
for i in range(6):
    store.write(make_sample(i))
    store.flush()
print("flushed", flush=True)
sys.stdin.read()  # killed here, with the part still open
"""


def _killed_writer(path: Path) -> None:
    """Commit s0..s5, then die without closing the store."""
    proc = subprocess.Popen(
        [sys.executable, "-c", _WRITER, str(path)],
        cwd=Path(__file__).parent,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None and proc.stdout.readline().strip() == "flushed"
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    proc.stdin.close()  # type: ignore[union-attr]
    proc.stdout.close()


def _closed_writer(path: Path) -> None:
    """Commit s0..s5 and close the store cleanly."""
    with open_test_store(str(path), writer_id="w") as store:
        for i in range(6):
            store.write(make_sample(i))


def _damage_shards(path: Path) -> None:
    """Zero the first half of every shard file of the part (its compressed chunks)."""
    shards = sorted((path / "part-w" / "hidden").glob("c.*"))
    assert shards, "the writer committed shards"
    for shard in shards:
        data = bytearray(shard.read_bytes())
        data[: len(data) // 2] = bytes(len(data) // 2)
        shard.write_bytes(bytes(data))


def _assert_same(path: Path, sample_id: str) -> None:
    want = make_sample(int(sample_id[1:]))
    with open_test_store(str(path), "r") as store:
        got = store[sample_id]
    assert torch.equal(
        got.aux_hidden_states.view(torch.int16), want.aux_hidden_states.view(torch.int16)
    )
    assert torch.equal(
        got.final_hidden_state.view(torch.int16), want.final_hidden_state.view(torch.int16)
    )


def test_samples_damaged_before_an_unclean_stop_are_left_out_and_named(tmp_path: Path) -> None:
    path = tmp_path / "s.zarr"
    _killed_writer(path)
    _damage_shards(path)
    damaged = {c.sample_id for c in verify_store(path).corrupted}
    assert damaged, "zeroed shards fail their checksums"
    with open_test_store(str(path), "r") as store:
        assert {c.sample_id for c in store.recovered} == damaged
        assert not damaged & set(store.committed_ids())
        assert set(store.committed_ids()) == set(IDS) - damaged


def test_the_resumed_writer_drops_them_for_good_and_writes_them_again(tmp_path: Path) -> None:
    path = tmp_path / "s.zarr"
    _killed_writer(path)
    _damage_shards(path)
    damaged = {c.sample_id for c in verify_store(path).corrupted}
    with open_test_store(str(path), writer_id="w") as store:
        assert {c.sample_id for c in store.recovered} == damaged
        for sid in sorted(damaged):
            assert sid not in store
            store.write(make_sample(int(sid[1:])))
    with open_test_store(str(path), "r") as store:
        assert store.recovered == [] and set(store.committed_ids()) == set(IDS)
    for sid in damaged:
        _assert_same(path, sid)
    assert verify_store(path).clean


def test_a_cleanly_closed_part_is_not_reread_at_open(tmp_path: Path) -> None:
    path = tmp_path / "s.zarr"
    _closed_writer(path)
    _damage_shards(path)
    with open_test_store(str(path), "r") as store:
        assert store.recovered == [] and set(store.committed_ids()) == set(IDS)


def test_verify_store_drop_removes_damaged_samples_so_a_rerun_writes_them(tmp_path: Path) -> None:
    path = tmp_path / "s.zarr"
    _closed_writer(path)
    _damage_shards(path)
    result = CliRunner().invoke(cli_app, ["verify-store", str(path), "--drop"])
    assert result.exit_code == 1, result.output
    damaged = {line.split()[1] for line in result.output.splitlines() if "corrupted " in line}
    assert damaged and "rerun the extraction" in result.output
    with open_test_store(str(path), writer_id="w") as store:
        assert set(store.committed_ids()) == set(IDS) - damaged
        for sid in sorted(damaged):
            store.write(make_sample(int(sid[1:])))
    assert verify_store(path).clean
    for sid in damaged:
        _assert_same(path, sid)


def test_dropping_a_sample_of_another_part_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "s.zarr"
    with open_test_store(str(path), writer_id="a") as store:
        store.write(make_sample(0))
    with open_test_store(str(path), writer_id="b") as store:
        with pytest.raises(SampleNotFoundError, match="not committed in this writer"):
            store.drop(["s0"])
        assert "s0" in store


def test_a_run_with_nothing_to_extract_tidies_what_a_killed_writer_left(tmp_path: Path) -> None:
    """A killed Ray actor's part is never opened again (its successor writes the next part):
    the run removes the shards it wrote past its last commit, and leaves a live writer alone."""
    pytest.importorskip("ray")
    path = tmp_path / "s.zarr"
    killed_past_its_commit(str(path), "ray-s0-a0")
    hidden = path / "part-ray-s0-a0" / "hidden"
    stranded = shards_past_commit(str(path), "part-ray-s0-a0", [f.name for f in hidden.glob("c.*")])
    assert stranded, "the writer left no shard past its last commit: nothing was tested"
    with open_test_store(str(path), writer_id="ray-s0-a1") as successor:
        for i in range(3, 8):
            successor.write(make_sample(i))
    samples = [as_sample(i) for i in range(9)]
    with open_test_store(str(path), writer_id="live") as live:  # another run, mid-way
        live.write(make_sample(8))
        live.flush()
        summary = run_ray_extraction(
            samples, servers=[("http://127.0.0.1:9", None, None)], store=path
        )
        assert summary.ok and (summary.samples_done, summary.skipped) == (0, 9), summary.failures
        assert [name for name in stranded if (hidden / name).exists()] == []
        live.write(make_sample(9))  # its part is still its own
    assert verify_store(path).clean
    with open_test_store(str(path), "r") as store:
        assert sorted(store) == sorted(f"s{i}" for i in range(10))
