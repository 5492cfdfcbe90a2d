"""Kill real writer processes with SIGKILL and check what a reopened store holds."""

from __future__ import annotations

import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from store_crash_writer import make_sample, open_test_store

from hsdump import PartLockedError, open_store

WRITER = Path(__file__).with_name("store_crash_writer.py")
pytestmark = pytest.mark.slow


def _spawn(
    path: Path, n: int, writer_id: str = "w0", stride: int = 1, offset: int = 0
) -> subprocess.Popen[str]:
    args = [sys.executable, str(WRITER), str(path), str(n), writer_id, str(stride), str(offset)]
    return subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _kill_after(proc: subprocess.Popen[str], lines: int, delay: float) -> None:
    assert proc.stdout is not None
    for _ in range(lines):
        if not proc.stdout.readline():
            break
    time.sleep(delay)
    proc.send_signal(signal.SIGKILL)
    proc.communicate()


def _assert_committed_intact(path: Path) -> set[str]:
    with open_store(path, "r") as store:
        ids = store.committed_ids()
        for sid in ids:
            got, want = store.get(sid, verify=True), make_sample(int(sid[1:]))
            assert torch.equal(
                got.aux_hidden_states.view(torch.int16), want.aux_hidden_states.view(torch.int16)
            )
            assert torch.equal(
                got.final_hidden_state.view(torch.int16), want.final_hidden_state.view(torch.int16)
            )
            assert torch.equal(got.input_ids, want.input_ids)
            assert (got.loss_mask is None) == (want.loss_mask is None)
    return ids


def _finish(path: Path, n: int, **kw: object) -> int:
    proc = _spawn(path, n, **kw)  # type: ignore[arg-type]
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err[-2000:]
    return int(out.strip().splitlines()[-1].split()[1])


def test_sigkill_at_random_points_loses_nothing_committed_and_resume_writes_only_the_rest(
    tmp_path: Path,
) -> None:
    path, n, rng = tmp_path / "s.zarr", 60, random.Random(3)
    before: set[str] = set()
    for _ in range(3):
        _kill_after(_spawn(path, n), rng.randint(1, 12), rng.uniform(0, 0.03))
        committed = _assert_committed_intact(path)
        assert before <= committed
        before = committed
    # Reopening as a writer removes what the killed process left behind.
    open_test_store(str(path), writer_id="w0").close()
    assert not list(path.rglob("*.partial"))
    written = _finish(path, n)
    assert written == n - len(before)
    assert _assert_committed_intact(path) == {f"s{i}" for i in range(n)}


def test_killed_writer_leaves_no_chunk_files_past_its_last_commit(tmp_path: Path) -> None:
    path = tmp_path / "s.zarr"
    _kill_after(_spawn(path, 40), 9, 0.0)
    open_test_store(str(path), writer_id="w0").close()
    with open_store(path, "r") as store:
        spans = [store.locate(sid) for sid in store]
    end = max((offset + length for part, offset, length in spans if part == "part-w0"), default=0)
    shards = [int(p.name.split(".")[1]) for p in (path / "part-w0" / "hidden").glob("c.*")]
    assert all(s * 128 < end for s in shards)


def test_two_writer_processes_into_one_store_lose_nothing(tmp_path: Path) -> None:
    path, n = tmp_path / "s.zarr", 40
    procs = [_spawn(path, n, writer_id=f"w{k}", stride=2, offset=k) for k in range(2)]
    for proc in procs:
        _, err = proc.communicate(timeout=60)
        assert proc.returncode == 0, err[-2000:]
    assert _assert_committed_intact(path) == {f"s{i}" for i in range(n)}


def test_second_live_writer_of_one_part_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "s.zarr"
    with (
        open_test_store(str(path), writer_id="w0"),
        pytest.raises(PartLockedError, match="own writer_id"),
    ):
        open_test_store(str(path), writer_id="w0")


def test_a_killed_writers_part_opens_again_once_its_process_is_gone(tmp_path: Path) -> None:
    path = tmp_path / "s.zarr"
    code = (
        "import sys; from hsdump import open_store; "
        f"s = open_store({str(path)!r}, 'a', writer_id='w0'); print('open', flush=True); "
        "sys.stdin.read()"
    )
    args = [sys.executable, "-c", code]
    with subprocess.Popen(args, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True) as holder:
        try:
            assert holder.stdout is not None and holder.stdout.readline() == "open\n"
            with pytest.raises(PartLockedError, match="another live process is writing"):
                open_test_store(str(path), writer_id="w0")
            open_test_store(str(path), writer_id="w1").close()  # another part is free
        finally:
            holder.kill()
    open_test_store(str(path), writer_id="w0").close()
