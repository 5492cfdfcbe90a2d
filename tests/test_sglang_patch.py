"""sglang_patch without SGLang: batch planning, pinned staging, the writer thread, real dump files.

Batches are stand-ins with exactly the attributes the plugin reads from SGLang's ``ScheduleBatch``
and ``Req`` (checked against the real sources in test_sglang_patch_source.py).
"""

from __future__ import annotations

import ast
import os
import shutil
import subprocess
import sys
import threading
import time
import zipfile
from pathlib import Path
from types import SimpleNamespace

import pytest
import test_sglang_patch_hooks as harness
import torch
from test_memfs import NEVER, mounts
from test_sglang_patch_source import _download

import hsdump._protocol._memfs as memfs
import sglang_patch
from hsdump._client.loading import read_dump, to_torch
from hsdump._exceptions import DumpFailed
from hsdump._protocol import DumpWriter, ProducerInfo, request_dir
from sglang_patch.hooks import remove_stale_tmp_dirs
from sglang_patch.testing import (
    ChunkPlanner,
    Dumper,
    DumpFormat,
    PinnedRing,
    PluginConfig,
    Stager,
    load_config,
    vector_moments,
)

K, H = 3, 8
FMT = DumpFormat(
    layer_ids=(1, 2, 3),
    hidden_size=H,
    dtype="float32",
    producer=ProducerInfo(name="t", version="0"),
)


class Req:
    """Stand-in for SGLang's Req: the fields the planner reads."""

    def __init__(self, rid: str, length: int, output: int = 0):
        self.rid = rid
        self.origin_input_ids = list(range(100, 100 + length))
        self.output_ids = [0] * output


def batch(reqs: list[Req], extend: list[int], prefix: list[int], decoding=None) -> SimpleNamespace:
    return SimpleNamespace(
        reqs=reqs, extend_lens=extend, prefix_lens=prefix, decoding_reqs=decoding
    )


def rows(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, (K + 1) * H, generator=torch.Generator().manual_seed(seed))


@pytest.fixture
def dumper(tmp_path: Path):
    """Makes dumpers into ``tmp_path`` (64 KiB pinned unless told), closed after the test."""
    made = []

    def make(**overrides) -> Dumper:
        config = PluginConfig(dump_dir=tmp_path, **{"pinned_bytes": 1 << 16, **overrides})
        made.append(Dumper(config, FMT, pin=False))
        return made[-1]

    yield make
    for d in made:
        d.close()


def forward(d: Dumper, b: SimpleNamespace, hidden: torch.Tensor) -> None:
    d.on_forward(b, SimpleNamespace(hidden_states=hidden))
    d.writer.drain()


def wait_for(condition, timeout_s: float = 10.0) -> bool:
    """Whether ``condition()`` became true within ``timeout_s`` (for what another thread does)."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def assert_dump(root: Path, req: Req, expected: torch.Tensor) -> None:
    dump = read_dump(request_dir(root, req.rid))
    assert dump.meta.input_ids == req.origin_input_ids
    assert dump.meta.layer_ids == list(FMT.layer_ids) and dump.meta.final_norm == "post_norm"
    aux, final = (to_torch(bits, dump.meta.dtype) for bits in (dump.aux, dump.final))
    assert torch.equal(aux.reshape(len(expected), -1), expected[:, : K * H])
    assert torch.equal(final, expected[:, K * H :])


# --- planning -------------------------------------------------------------------------------


def test_plan_maps_rows_to_opted_in_requests_and_skips_others() -> None:
    a, foreign, b, decoding = (
        Req("hsdump-a", 4),
        Req("x", 3),
        Req("hsdump-b", 2),
        Req("hsdump-d", 9, 1),
    )
    plan = ChunkPlanner().plan(batch([a, foreign, b, decoding], [4, 3, 2, 1], [0, 0, 0, 9]))
    assert [(s.rid, s.row, s.n, s.start, s.last) for s in plan.slices] == [
        ("hsdump-a", 0, 4, 0, True),
        ("hsdump-b", 7, 2, 0, True),
    ]
    assert plan.rows == 10 and not plan.errors


def test_plan_skips_requests_listed_as_decoding_in_a_mixed_batch() -> None:
    a, d = Req("hsdump-a", 2), Req("hsdump-d", 5)
    plan = ChunkPlanner().plan(batch([a, d], [2, 1], [0, 0], decoding=[d]))
    assert [s.rid for s in plan.slices] == ["hsdump-a"]


def test_first_chunk_with_cached_prefix_is_an_error_naming_the_fix() -> None:
    plan = ChunkPlanner().plan(batch([Req("hsdump-a", 10)], [3], [7]))
    ((rid, reason),) = plan.errors
    assert rid == "hsdump-a" and not plan.slices
    assert "7 of its 10" in reason and "extra_key" in reason and "--disable-radix-cache" in reason


def test_chunks_stay_open_until_the_prompt_is_covered() -> None:
    planner, req = ChunkPlanner(), Req("hsdump-a", 10)
    first = planner.plan(batch([req], [4], [0])).slices[0]
    assert not first.last and first.input_ids == tuple(req.origin_input_ids)
    assert planner.open_rids == ["hsdump-a"]
    last = planner.plan(batch([req], [6], [4])).slices[0]
    assert last.last and last.input_ids is None and planner.open_rids == []


def test_a_chunk_that_skips_tokens_is_an_error() -> None:
    planner, req = ChunkPlanner(), Req("hsdump-a", 10)
    planner.plan(batch([req], [4], [0]))
    plan = planner.plan(batch([req], [3], [5]))
    assert plan.errors and "next expected chunk starts at token 4" in plan.errors[0][1]
    assert planner.open_rids == []


def test_requests_that_stop_mid_prefill_expire() -> None:
    now = [0.0]
    planner = ChunkPlanner(clock=lambda: now[0])
    planner.plan(batch([Req("hsdump-a", 10)], [4], [0]))
    assert planner.expire(60) == []
    now[0] = 61
    assert planner.expire(60) == ["hsdump-a"] and planner.open_rids == []


# --- the pinned ring ------------------------------------------------------------------------


def test_ring_reuses_freed_space_in_order_and_wraps() -> None:
    ring = PinnedRing(256, pin=False)
    a, _ = ring.try_alloc(128)
    b, _ = ring.try_alloc(64)
    assert ring.try_alloc(128) is None  # 64 left at the end, 0 before the oldest block
    ring.free(a)
    c, view = ring.try_alloc(128)
    assert c.start == 0 and view.numel() == 128
    ring.free(b)
    ring.free(c)
    assert ring.used == 0


def test_ring_frees_out_of_order_only_when_older_blocks_are_free() -> None:
    ring = PinnedRing(256, pin=False)
    a, _ = ring.try_alloc(128)
    b, _ = ring.try_alloc(128)
    ring.free(b)
    assert ring.used == 256
    ring.free(a)
    assert ring.used == 0


def test_ring_alloc_blocks_until_a_consumer_frees() -> None:
    ring = PinnedRing(128, pin=False)
    a, _ = ring.try_alloc(128)
    threading.Timer(0.05, ring.free, (a,)).start()
    block, _ = ring.alloc(128, poll_s=0.01)
    assert block.start == 0


def test_ring_wait_raises_when_the_consumer_is_gone() -> None:
    ring = PinnedRing(128, pin=False, alive=lambda: False)
    ring.try_alloc(128)
    with pytest.raises(RuntimeError, match="writer thread has stopped"):
        ring.alloc(64, poll_s=0.01)


def test_ring_refuses_a_block_larger_than_itself() -> None:
    with pytest.raises(ValueError, match="do not fit"):
        PinnedRing(64, pin=False).try_alloc(65)


# --- dumper and writer on real files --------------------------------------------------------


def test_requests_batched_together_get_their_own_rows(dumper, tmp_path: Path) -> None:
    d, a, foreign, b = dumper(), Req("hsdump-a", 5), Req("other", 3), Req("hsdump-b", 4)
    hidden = rows(5 + 3 + 4 + 2)  # two padding rows at the end
    forward(d, batch([a, foreign, b], [5, 3, 4], [0, 0, 0]), hidden)
    assert_dump(tmp_path, a, hidden[:5])
    assert_dump(tmp_path, b, hidden[8:12])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["req_hsdump-a", "req_hsdump-b"]


def test_a_chunked_prompt_is_published_once_its_last_chunk_is_written(dumper, tmp_path) -> None:
    d, req, full = dumper(), Req("hsdump-a", 10), rows(10)
    forward(d, batch([req], [6], [0]), full[:6])
    assert not request_dir(tmp_path, "hsdump-a").exists()
    forward(d, batch([req], [4], [6]), full[6:])
    assert_dump(tmp_path, req, full)


def test_a_pinned_buffer_smaller_than_a_request_stages_it_in_pieces(dumper, tmp_path) -> None:
    d, req, full = dumper(pinned_bytes=4096), Req("hsdump-a", 300), rows(300)  # 128 B a row
    forward(d, batch([req], [300], [0]), full)
    assert_dump(tmp_path, req, full)
    assert read_dump(request_dir(tmp_path, req.rid)).meta.extra["pieces"] > 1


def test_a_request_larger_than_one_write_job_lands_whole_from_several_threads(
    dumper, tmp_path
) -> None:
    n = (17 << 20) // FMT.row_bytes  # just over one 16 MiB pool job
    d, req, full = dumper(pinned_bytes=128 << 20, write_threads=4), Req("hsdump-a", n), rows(n)
    forward(d, batch([req], [n], [0]), full)
    assert_dump(tmp_path, req, full)


def test_a_row_write_that_fails_on_the_pool_publishes_an_error(dumper, tmp_path, monkeypatch):
    def full_disk(self, start, aux, final, moments=None, **kw) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr("hsdump._protocol.DumpWriter.write_rows", full_disk)
    d, req = dumper(), Req("hsdump-a", 4)
    forward(d, batch([req], [4], [0]), rows(4))
    with pytest.raises(DumpFailed, match="No space left"):
        read_dump(request_dir(tmp_path, req.rid))
    assert [p.name for p in tmp_path.iterdir()] == ["req_hsdump-a"]


@pytest.fixture
def held_writes(monkeypatch):
    """Row writes of the rids in ``held`` wait for ``release``; ``started[rid]`` is set on entry."""
    state = SimpleNamespace(held=set(), release=threading.Event(), started={})
    real = DumpWriter.write_rows

    def write_rows(self, start, aux, final, moments=None, **kw) -> None:
        state.started.setdefault(self.rid, threading.Event()).set()
        if self.rid in state.held:
            assert state.release.wait(10)
        real(self, start, aux, final, moments, **kw)

    monkeypatch.setattr(DumpWriter, "write_rows", write_rows)
    yield state
    state.release.set()


def test_a_bug_in_a_row_write_publishes_an_error_and_leaves_no_partial_dump(
    dumper, tmp_path, monkeypatch
) -> None:
    def buggy(self, start, aux, final, moments=None, **kw) -> None:
        raise TypeError("a bug")

    monkeypatch.setattr(DumpWriter, "write_rows", buggy)
    d, req = dumper(), Req("hsdump-a", 4)
    forward(d, batch([req], [4], [0]), rows(4))
    with pytest.raises(DumpFailed, match="TypeError: a bug"):
        read_dump(request_dir(tmp_path, req.rid))
    assert [p.name for p in tmp_path.iterdir()] == ["req_hsdump-a"]


def test_the_next_groups_rows_are_written_while_an_earlier_group_is_still_writing(
    dumper, tmp_path, held_writes
) -> None:
    d, a, b = dumper(write_threads=2), Req("hsdump-a", 4), Req("hsdump-b", 4)
    held_writes.held.add(a.rid)
    d.on_forward(batch([a], [4], [0]), SimpleNamespace(hidden_states=rows(4)))
    d.on_forward(batch([b], [4], [0]), SimpleNamespace(hidden_states=rows(4, seed=1)))
    started_b = held_writes.started.setdefault(b.rid, threading.Event())
    assert started_b.wait(10)  # while a's write is held
    held_writes.release.set()
    d.writer.drain()
    assert_dump(tmp_path, a, rows(4))
    assert_dump(tmp_path, b, rows(4, seed=1))


def test_a_slow_publish_does_not_hold_the_next_request(dumper, tmp_path, monkeypatch) -> None:
    release, published_b = threading.Event(), threading.Event()
    real = DumpWriter.publish

    def publish(self, meta):
        if self.rid == "hsdump-a":
            assert release.wait(10)
        path = real(self, meta)
        if self.rid == "hsdump-b":
            published_b.set()
        return path

    monkeypatch.setattr(DumpWriter, "publish", publish)
    d, a, b = dumper(write_threads=2), Req("hsdump-a", 4), Req("hsdump-b", 4)
    d.on_forward(batch([a], [4], [0]), SimpleNamespace(hidden_states=rows(4)))
    d.on_forward(batch([b], [4], [0]), SimpleNamespace(hidden_states=rows(4, seed=1)))
    assert published_b.wait(10)  # while a's publish is held
    release.set()
    d.writer.drain()
    assert_dump(tmp_path, a, rows(4))


def test_an_error_for_a_request_whose_rows_are_being_written_publishes_only_the_error(
    dumper, tmp_path, held_writes
) -> None:
    d, a = dumper(write_threads=2), Req("hsdump-a", 4)
    held_writes.held.add(a.rid)
    d.on_forward(batch([a], [4], [0]), SimpleNamespace(hidden_states=rows(4)))
    d.writer.submit_error(a.rid, "the request was cancelled")
    # The error marker is published while the row write is still held.
    assert wait_for(request_dir(tmp_path, a.rid).exists)
    held_writes.release.set()  # the write lands in files that must still be mapped
    d.writer.drain()
    with pytest.raises(DumpFailed, match="cancelled"):
        read_dump(request_dir(tmp_path, a.rid))
    assert [p.name for p in tmp_path.iterdir()] == ["req_hsdump-a"]


def test_hidden_states_of_the_wrong_width_publish_an_error(dumper, tmp_path: Path) -> None:
    d, req = dumper(), Req("hsdump-a", 4)
    forward(d, batch([req], [4], [0]), torch.zeros(4, K * H))
    with pytest.raises(DumpFailed, match="shape"):
        read_dump(request_dir(tmp_path, req.rid))


def test_missing_hidden_states_name_the_server_flag(dumper, tmp_path: Path) -> None:
    d, req = dumper(), Req("hsdump-a", 4)
    d.on_forward(batch([req], [4], [0]), SimpleNamespace(hidden_states=None))
    d.writer.drain()
    with pytest.raises(DumpFailed, match="--enable-return-hidden-states"):
        read_dump(request_dir(tmp_path, req.rid))


def test_a_prefix_cache_hit_publishes_an_error_never_a_short_dump(dumper, tmp_path) -> None:
    d, req = dumper(), Req("hsdump-a", 10)
    forward(d, batch([req], [3], [7]), rows(3))
    with pytest.raises(DumpFailed, match="prefix cache"):
        read_dump(request_dir(tmp_path, req.rid))


def test_an_aborted_request_leaves_no_directory_behind(dumper, tmp_path: Path) -> None:
    d, req = dumper(partial_ttl_s=0.01), Req("hsdump-a", 10)
    forward(d, batch([req], [4], [0]), rows(4))
    assert next(p.name for p in tmp_path.iterdir()).startswith(".tmp-req_hsdump-a")
    time.sleep(0.02)  # past the TTL: the next forward drops the stalled request
    forward(d, batch([Req("y", 1)], [1], [0]), rows(1))
    assert list(tmp_path.iterdir()) == []


def test_the_writer_waits_for_consumed_dumps_then_reports_a_full_root(dumper, tmp_path) -> None:
    one_request = 10 * FMT.row_bytes
    d = dumper(max_pending_bytes=one_request, space_timeout_s=0.3, min_free_bytes=1)
    first, second, third = Req("hsdump-1", 10), Req("hsdump-2", 10), Req("hsdump-3", 10)
    forward(d, batch([first], [10], [0]), rows(10))
    forward(d, batch([second], [10], [0]), rows(10))  # nobody consumed the first: times out
    with pytest.raises(DumpFailed, match="no room"):
        read_dump(request_dir(tmp_path, second.rid))
    for req in (first, second):
        shutil.rmtree(request_dir(tmp_path, req.rid))  # what the client does after reading
    forward(d, batch([third], [10], [0]), rows(10, seed=3))
    assert_dump(tmp_path, third, rows(10, seed=3))


def test_a_pinned_buffer_too_small_for_one_token_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="HSDUMP_PINNED_MB"):
        Dumper(PluginConfig(dump_dir=tmp_path, pinned_bytes=64), FMT, pin=False)


def test_stale_temporary_dirs_of_dead_processes_are_removed(tmp_path: Path) -> None:
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True
    )
    stale = tmp_path / f".tmp-req_hsdump-x-{int(dead.stdout)}-abcd1234"
    mine = tmp_path / f".tmp-req_hsdump-y-{os.getpid()}-abcd1234"
    for path in (stale, mine):
        path.mkdir()
        os.utime(path, (0, 0))
    assert remove_stale_tmp_dirs(tmp_path) == 1
    assert not stale.exists() and mine.exists()


# --- settings and imports -------------------------------------------------------------------


def test_settings_come_from_the_environment(monkeypatch, tmp_path: Path) -> None:
    monkeypatch.setenv("HSDUMP_DUMP_DIR", str(tmp_path))
    monkeypatch.setenv("HSDUMP_LAYER_IDS", "2, 30,58")
    monkeypatch.setenv("HSDUMP_PINNED_MB", "64")
    monkeypatch.setenv("HSDUMP_MAX_PENDING_MB", "128")
    monkeypatch.setenv("HSDUMP_WRITE_THREADS", "3")
    config = load_config()
    assert config.dump_dir == tmp_path and config.layer_ids == (2, 30, 58)
    assert config.pinned_bytes == 64 << 20 and config.max_pending_bytes == 128 << 20
    assert config.write_threads == 3


@pytest.mark.parametrize(
    ("name", "value", "message"),
    [
        ("HSDUMP_LAYER_IDS", "2,x", "comma-separated"),
        ("HSDUMP_LAYER_IDS", "0,3", ">= 1"),
        ("HSDUMP_LAYER_IDS", "5,3", "increasing"),
        ("HSDUMP_PINNED_MB", "lots", "not an integer"),
        ("HSDUMP_MAX_PENDING_MB", "-1", "positive"),
        ("HSDUMP_WRITE_THREADS", "0", "positive"),
    ],
)
def test_malformed_settings_name_the_variable(monkeypatch, tmp_path, name, value, message) -> None:
    monkeypatch.setenv("HSDUMP_DUMP_DIR", str(tmp_path))
    monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match=message) as info:
        load_config()
    assert name in str(info.value)


def test_plugin_modules_import_without_the_clients_dependencies() -> None:
    code = (
        "import sys, sglang_patch.plugin, sglang_patch.hooks, sglang_patch.testing;"
        "print(sorted(m for m in ('httpx', 'inotify_simple', 'zarr') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_the_plugin_imports_from_hsdump_only_the_protocol() -> None:
    imported = set()
    for path in Path(sglang_patch.__file__).parent.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                imported.add(node.module)
            elif isinstance(node, ast.Import):
                imported.update(alias.name for alias in node.names)
    from_hsdump = {name for name in imported if name.split(".")[0] == "hsdump"}
    assert from_hsdump == {"hsdump._protocol"}


def test_the_plugin_is_inert_without_a_dump_root(monkeypatch) -> None:
    monkeypatch.delenv("HSDUMP_DUMP_DIR", raising=False)
    code = "import sglang_patch.plugin as p; p.register(); print(p._registered)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"  # and it never imported sglang, which is absent here


# --- row moments ----------------------------------------------------------------------------


def _declared_moments(root: Path, req: Req) -> torch.Tensor:
    dump = read_dump(request_dir(root, req.rid), moments=True)  # checked against the values
    assert dump.moments is not None
    return torch.from_numpy(dump.moments)


def _moments(hidden: torch.Tensor) -> torch.Tensor:
    values = hidden.double().reshape(len(hidden), K + 1, H)
    return torch.stack((values.sum(-1), values.square().sum(-1)), -1).float()


def test_each_dump_holds_the_moments_of_its_own_rows(dumper, tmp_path: Path) -> None:
    d, a, b = dumper(), Req("hsdump-a", 3), Req("hsdump-b", 5)
    hidden = rows(8)
    forward(d, batch([a, b], [3, 5], [0, 0]), hidden)
    assert torch.allclose(_declared_moments(tmp_path, a), _moments(hidden[:3]), rtol=1e-5)
    assert torch.allclose(_declared_moments(tmp_path, b), _moments(hidden[3:]), rtol=1e-5)


def test_taking_moments_leaves_the_forwards_rows_as_they_were() -> None:
    hidden = rows(6)
    before = hidden.clone()
    got = vector_moments([hidden.reshape(6, K + 1, H)])
    assert torch.equal(hidden, before)
    assert torch.allclose(got, _moments(hidden), rtol=1e-5)


def test_without_gpu_memory_for_moments_the_writer_computes_them(
    dumper, tmp_path: Path, monkeypatch
) -> None:
    def no_memory(*args, **kwargs):
        raise torch.cuda.OutOfMemoryError("no memory")

    monkeypatch.setattr(torch.linalg, "vector_norm", no_memory)  # the moments' reduction
    d, a = dumper(), Req("hsdump-a", 4)
    hidden = rows(4)
    forward(d, batch([a], [4], [0]), hidden)
    assert torch.allclose(_declared_moments(tmp_path, a), _moments(hidden), rtol=1e-5)


class _Gate:
    """A stand-in for a CUDA event whose work completes when the test says so."""

    def __init__(self) -> None:
        self.entered, self.done = threading.Event(), threading.Event()

    def synchronize(self) -> None:
        self.entered.set()
        assert self.done.wait(10)


def test_rows_are_written_while_their_moments_are_still_being_taken(
    dumper, tmp_path: Path, monkeypatch
) -> None:
    rows_written, real = threading.Event(), DumpWriter.write_rows

    def write_rows(self, *args, **kw) -> None:
        real(self, *args, **kw)
        rows_written.set()

    monkeypatch.setattr(DumpWriter, "write_rows", write_rows)
    d, gate, hidden = dumper(), _Gate(), rows(4)

    def gated(event, pieces) -> None:
        for piece in pieces:
            piece.moments_ready = gate  # as `SideCopies` sets the moments' own event
        d.writer.submit_rows(event, pieces)

    stager = Stager(d.ring, num_layers=K, hidden_size=H, submit=gated)
    stager.stage(hidden, "hsdump-a", 0, 4, 0, total=4, input_ids=tuple(range(4)))
    stager.flush()
    assert gate.entered.wait(10) and rows_written.wait(10)  # the rows did not wait
    assert not request_dir(tmp_path, "hsdump-a").exists()  # nor is the dump out before them
    gate.done.set()
    d.writer.drain()
    assert torch.allclose(_declared_moments(tmp_path, Req("hsdump-a", 4)), _moments(hidden))


# --- the start-up warning about a dump root on a tmpfs with 4 KB pages -----------------------


def _shm_with_files(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A directory on a 4 KB-page tmpfs, as the mount table and shmem setting files say, which
    the module reads instead of the kernel's."""
    shm = tmp_path.resolve() / "shm"
    shm.mkdir()
    (shm.parent / "mounts").write_text(mounts((shm, "tmpfs", "rw")))
    (shm.parent / "shmem_enabled").write_text(NEVER + "\n")
    monkeypatch.setattr(memfs, "MOUNTS_FILE", shm.parent / "mounts")
    monkeypatch.setattr(memfs, "SHMEM_ENABLED_FILE", shm.parent / "shmem_enabled")
    return shm


def test_the_mount_table_and_the_shmem_setting_are_read_from_their_files(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    shm = _shm_with_files(tmp_path, monkeypatch)
    assert memfs.small_page_tmpfs(shm / "hsdump") == str(shm)


@pytest.mark.parametrize("missing", ["MOUNTS_FILE", "SHMEM_ENABLED_FILE"])
def test_an_unreadable_mount_table_or_shmem_setting_gives_no_answer(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, missing: str
) -> None:
    shm = _shm_with_files(tmp_path, monkeypatch)
    monkeypatch.setattr(memfs, missing, shm.parent / "absent")
    assert memfs.small_page_tmpfs(shm / "hsdump") is None


@pytest.fixture(scope="module")
def hook_registry_source() -> bytes:
    with zipfile.ZipFile(_download("0.5.17")) as wheel:
        return wheel.read("sglang/srt/plugins/hook_registry.py")


@pytest.mark.parametrize(
    ("options", "parallel", "warns"),
    [
        ("rw,relatime", {}, True),
        ("rw,relatime,huge=within_size", {}, False),
        ("rw,relatime", {"attn_tp_rank": 1, "tp_rank": 1}, False),  # this rank does not write
    ],
    ids=["4kb", "huge", "other-rank"],
)
def test_the_writing_rank_warns_once_at_start_up_about_a_4kb_tmpfs(
    tmp_path: Path,
    hook_registry_source: bytes,
    monkeypatch: pytest.MonkeyPatch,
    options: str,
    parallel: dict[str, int],
    warns: bool,
) -> None:
    point = tmp_path.resolve()
    (tmp_path / "mounts").write_text(mounts((point, "tmpfs", options)))
    (tmp_path / "shmem_enabled").write_text(NEVER + "\n")
    # The stand-in server reads the mount table and the shmem setting from these files.
    prelude = (
        "import hsdump._protocol._memfs as memfs, pathlib\n"
        f"memfs.MOUNTS_FILE = pathlib.Path({str(tmp_path / 'mounts')!r})\n"
        f"memfs.SHMEM_ENABLED_FILE = pathlib.Path({str(tmp_path / 'shmem_enabled')!r})\n"
    )
    monkeypatch.setattr(harness, "DRIVER", prelude + harness.DRIVER)
    proc, _, dump = harness.run_server(tmp_path, hook_registry_source, {"parallel": parallel})
    assert proc.returncode == 0, proc.stderr[-3000:]
    warnings = [line for line in proc.stderr.splitlines() if "4 KB pages" in line]
    if not warns:
        assert warnings == []
        return
    (line,) = warnings
    assert line.startswith("WARNING:sglang_patch.hooks:hsdump: the dump root ")
    assert f"{dump} lies on the tmpfs {point}, which has 4 KB pages" in line
    assert line.endswith("docs/sglang.md#put-the-dump-root-on-a-tmpfs-with-huge-pages shows")
