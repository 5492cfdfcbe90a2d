"""Power loss at many points of a writer's run: what a flush reported durable survives it.

The writer (tests/power_loss_writer.py) runs once, uninterrupted, on crashfs (tests/crashfs.py),
which logs every change it makes and a marker after each flush returns. tests/crashreplay.py then
builds, for each crash point, the tree a power loss after that prefix of the log may leave: data
durable only once fsynced, and names either only once their directory is fsynced (``synced``) or
all as they were made (``made``, the zero-length files of ext4's delayed allocation). The store
found there must open, every sample of the last marker must read back bit-exact, and whatever
else is visible must be whole. A rerun of the writer on a few of these trees completes the store.
"""

from __future__ import annotations

import random
import re
import shutil
import subprocess
import sys
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from crashfs import FuseUnavailable, mounted, require_fuse
from crashreplay import Names, Op, Replay, read_log
from power_loss_writer import DURABLE, FLUSH_EVERY, make_sample, sample_ids, write_all

from hsdump import (
    HiddenStates,
    HiddenStateStore,
    HsdumpError,
    StoreNotFoundError,
    open_store,
    verify_store,
)

pytestmark = pytest.mark.slow

WRITER = Path(__file__).with_name("power_loss_writer.py")
STORE = "s.zarr"
CRASH_POINTS = 60
RERUNS = 5
# The commit point of a part: its zarr.json renamed into place.
COMMIT_POINT = re.compile(rf"/{re.escape(STORE)}/part-[^/]+/zarr\.json")


@dataclass(frozen=True)
class Recording:
    """One uninterrupted writer run: the log of what it did, and the store it left."""

    ops: list[Op]
    store: Path


@dataclass(frozen=True)
class CrashPoint:
    """A power loss after ``ops[:at]``; ``kind`` says how the point was chosen."""

    at: int
    kind: str


@pytest.fixture(scope="module")
def recording(tmp_path_factory: pytest.TempPathFactory) -> Recording:
    require_fuse()
    base = tmp_path_factory.mktemp("power-loss")
    backing = base / "backing"
    backing.mkdir()
    try:
        with mounted(backing, base / "mnt", base / "ops.log") as mount:
            args = [
                sys.executable,
                str(WRITER),
                str(mount.mountpoint / STORE),
                str(mount.mountpoint),
            ]
            done = subprocess.run(args, capture_output=True, text=True, timeout=90)
    except FuseUnavailable as exc:
        pytest.fail(f"power-loss tests need FUSE: {exc} (.ci/run installs fuse3)")
    assert done.returncode == 0, done.stderr[-3000:]
    return Recording(read_log(base / "ops.log"), backing / STORE)


def crash_points(ops: list[Op], rng: random.Random) -> list[CrashPoint]:
    """Just after each marker; inside each commit (between its first write and its marker);
    just before and after each commit point; then random points, `CRASH_POINTS` at least."""
    points: dict[int, str] = {}
    start = 0
    for marker in (op.index for op in ops if op.op == "marker"):
        points[marker + 1] = "after a marker"
        writes = [op.index for op in ops[start:marker] if op.op == "write"]
        assert writes, f"nothing was written before the marker at {marker}"
        for _ in range(2):
            points.setdefault(rng.randint(writes[0] + 1, marker), "inside a commit")
        start = marker + 1
    for op in ops:
        if op.op == "rename" and COMMIT_POINT.fullmatch(op.fields["new"]):
            points.setdefault(op.index, "before a commit point")
            points.setdefault(op.index + 1, "after a commit point")
    while len(points) < CRASH_POINTS:
        points.setdefault(rng.randint(0, len(ops)), "random")
    return [CrashPoint(at, kind) for at, kind in sorted(points.items())]


def crash_states(
    ops: list[Op], points: list[CrashPoint], base: Path, names: Names = "synced"
) -> Iterator[tuple[Path, list[str]]]:
    """For each point in order: a directory holding the tree a crash there leaves (its names
    as `Replay.materialise` keeps them), and the ids of the last marker before it (empty before
    the first)."""
    replay, done = Replay(), 0
    for point in points:
        for op in ops[done : point.at]:
            replay.apply(op)
        done = point.at
        label = replay.markers[-1].fields["label"] if replay.markers else DURABLE
        tree = base / f"crash-{point.at}"
        replay.materialise(tree, names=names)
        yield tree, [sid for sid in label.removeprefix(DURABLE).split(",") if sid]
        shutil.rmtree(tree)


def differs(got: HiddenStates, want: HiddenStates) -> str | None:
    """The first part of ``got`` that is not bit-identical to ``want``, or None."""
    for name in ("aux_hidden_states", "final_hidden_state"):
        if not torch.equal(
            getattr(got, name).view(torch.int16), getattr(want, name).view(torch.int16)
        ):
            return name
    if not torch.equal(got.input_ids, want.input_ids):
        return "input_ids"
    if (got.loss_mask is None) != (want.loss_mask is None) or (
        want.loss_mask is not None and not torch.equal(got.loss_mask, want.loss_mask)
    ):
        return "loss_mask"
    return None


def store_problems(path: Path, durable: list[str]) -> list[str]:
    """What breaks the promise at ``path``: a store that does not open, a sample reported durable
    that is missing or damaged, a visible sample that is not whole."""
    try:
        store = open_store(path, "r")
    except StoreNotFoundError:
        if not durable:
            return []
        left = sorted(str(p.relative_to(path.parent)) for p in path.parent.rglob("*"))
        return [
            f"the store is gone, {len(durable)} samples were reported durable; left: {left[:6]}"
        ]
    except HsdumpError as exc:
        return [f"the store does not open: {type(exc).__name__}: {exc}"]
    with store:
        visible = store.committed_ids()
        problems = []
        if missing := [sid for sid in durable if sid not in visible]:
            problems.append(f"{len(missing)} samples reported durable are missing: {missing[:6]}")
        if unknown := sorted(visible - set(sample_ids())):
            problems.append(f"samples the writer never wrote are visible: {unknown[:6]}")
        try:
            problems += _damage(store, path, durable)
        except HsdumpError as exc:
            problems.append(f"reading the store fails: {type(exc).__name__}: {exc}")
    return problems


def _damage(store: HiddenStateStore, path: Path, durable: list[str]) -> list[str]:
    """Visible samples that fail `verify_store` or do not read back as the writer wrote them."""
    report = verify_store(path)
    problems = [f"samples committed twice: {report.duplicates[:6]}"] if report.duplicates else []
    for bad in report.corrupted:
        was = "reported durable" if bad.sample_id in durable else "visible"
        problems.append(f"{bad.sample_id} ({was}) fails verification: {bad.reason}")
    damaged = {bad.sample_id for bad in report.corrupted}
    for sid in sorted(store.committed_ids() & set(sample_ids()) - damaged):
        if (part := differs(store.get(sid, verify=True), make_sample(sid))) is not None:
            problems.append(f"{sid} reads back with a different {part}")
    return problems


def _where(ops: list[Op], point: CrashPoint) -> str:
    last = ops[point.at - 1].describe() if point.at else "before any operation"
    return f"crash after {point.at} of {len(ops)} operations ({point.kind}; last: {last})"


def test_the_log_replays_to_the_tree_the_writer_left(recording: Recording, tmp_path: Path) -> None:
    replay = Replay()
    for op in recording.ops:
        replay.apply(op)
    replay.materialise(tmp_path, names="made", data="made")
    assert _files(tmp_path) == _files(recording.store.parent)
    assert len(replay.markers) == len(sample_ids()) // FLUSH_EVERY
    assert store_problems(recording.store, sample_ids()) == []


def _files(root: Path) -> dict[str, bytes | None]:
    return {
        str(p.relative_to(root)): None if p.is_dir() else p.read_bytes()
        for p in sorted(root.rglob("*"))
    }


@pytest.mark.parametrize("names", ["synced", "made"])
def test_a_power_loss_at_any_point_keeps_what_flush_reported_durable(
    recording: Recording, tmp_path: Path, names: Names
) -> None:
    """Names kept only where their directory was synced, or every name as made (data only where
    synced, either way): the promise holds at every crash point."""
    points = crash_points(recording.ops, random.Random(41))
    assert len(points) >= CRASH_POINTS
    failed: list[tuple[CrashPoint, list[str]]] = []
    for point, (tree, durable) in zip(
        points, crash_states(recording.ops, points, tmp_path, names), strict=True
    ):
        if problems := store_problems(tree / STORE, durable):
            failed.append((point, problems))
    if failed:
        kinds = dict(Counter(point.kind for point, _ in failed))
        shown = "\n".join(f"{_where(recording.ops, p)}: {'; '.join(why)}" for p, why in failed[:12])
        pytest.fail(f"{len(failed)} of {len(points)} crash points lose a promise {kinds}:\n{shown}")


@pytest.mark.parametrize("names", ["synced", "made"])
def test_a_rerun_after_a_power_loss_completes_to_the_uninterrupted_contents(
    recording: Recording, tmp_path: Path, names: Names
) -> None:
    """The writer rerun on the tree a crash leaves writes only what is not committed, and the
    store ends bit-identical to the one the uninterrupted run left."""
    rng = random.Random(7)
    points = crash_points(recording.ops, rng)
    inside = [p for p in points if p.kind == "inside a commit"]
    after = [p for p in points if p.kind == "after a marker"]
    chosen = sorted(
        [inside[0], *rng.sample(inside[1:], 2), *rng.sample(after, RERUNS - 3)], key=lambda p: p.at
    )
    want = _contents(recording.store)
    states = crash_states(recording.ops, chosen, tmp_path, names)
    for point, (tree, _) in zip(chosen, states, strict=True):
        try:
            before = _committed(tree / STORE)
            written = write_all(str(tree / STORE))
        except HsdumpError as exc:
            raise AssertionError(
                f"{_where(recording.ops, point)}: the rerun fails: {exc!r}"
            ) from None
        assert written == len(want) - len(before), _where(recording.ops, point)
        assert _contents(tree / STORE) == want, _where(recording.ops, point)


def _committed(path: Path) -> set[str]:
    try:
        with open_store(path, "r") as store:
            return store.committed_ids()
    except StoreNotFoundError:
        return set()


def _contents(path: Path) -> dict[str, tuple[bytes, ...]]:
    with open_store(path, "r") as store:
        assert store.verify().clean
        return {sid: _bits(store.get(sid)) for sid in sorted(store.committed_ids())}


def _bits(hs: HiddenStates) -> tuple[bytes, ...]:
    mask = b"" if hs.loss_mask is None else hs.loss_mask.numpy().tobytes()
    return (
        hs.aux_hidden_states.view(torch.int16).numpy().tobytes(),
        hs.final_hidden_state.view(torch.int16).numpy().tobytes(),
        hs.input_ids.numpy().tobytes(),
        mask,
    )
