"""Export a store to the files a drafter trainer reads: SpecForge offline data, speculators data.

An export streams sample by sample: the next sample is read and decoded while a few threads
write the previous ones, each file atomically (a temporary file, then a rename). The sample
order is recorded first, in ``hsdump-export.json``: a rerun skips the files that exist and
appends the samples committed since. The layouts and conventions are in
`hsdump._training.trainers`.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import time
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, ValidationError

from hsdump._exceptions import ExportError, InputError, SampleNotFoundError
from hsdump._store.durable import PARTIAL_SUFFIX, write_file_atomic
from hsdump._store.provenance import SETTING_FIELDS
from hsdump._training.trainers import TARGETS, FinalNorm, Target, resolve_final_norm

if TYPE_CHECKING:
    from hsdump._store.store import HiddenStateStore
    from hsdump._types import HiddenStates

__all__ = [
    "MANIFEST_NAME",
    "ExportFormat",
    "ExportSummary",
    "FinalNorm",
    "export_store",
    "read_ids_file",
]

ExportFormat = Literal["specforge", "speculators"]
MANIFEST_NAME = "hsdump-export.json"


def _default_writers() -> int:
    return max(1, min(4, os.cpu_count() or 1))


@dataclass
class ExportSummary:
    """Progress and result of an export; passed to ``progress`` after each sample.

    Attributes:
        format: ``"specforge"`` or ``"speculators"``.
        out: The export directory.
        samples_total: Samples in the export (this run's and earlier runs').
        written: Sample files written by this run.
        skipped: Sample files already complete from an earlier run.
        bytes_written: Hidden-state bytes written by this run (raw, as in the files).
        wall_s: Seconds since the export started.
        layer_ids: The aux layer ids in the trainer's convention (SGLang API ids for SpecForge,
            vLLM ids for speculators): configure the drafter with these.
        complete: Every file is written (and, for speculators, the dataset rows).
    """

    format: ExportFormat
    out: Path
    samples_total: int
    layer_ids: list[int]
    written: int = 0
    skipped: int = 0
    bytes_written: int = 0
    wall_s: float = 0.0
    complete: bool = False
    _start: float = field(default_factory=time.perf_counter, init=False, repr=False)

    @property
    def samples_done(self) -> int:
        """Samples whose file exists (written or skipped)."""
        return self.written + self.skipped

    @property
    def bytes_per_s(self) -> float:
        """Hidden-state bytes written per second by this run."""
        return self.bytes_written / self.wall_s if self.wall_s > 0 else 0.0


class _Manifest(BaseModel):
    """``hsdump-export.json``: what an export directory holds, in which order."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    format: Literal["hsdump-export"] = "hsdump-export"
    version: Literal[1] = 1
    target: ExportFormat
    store: str
    settings: dict[str, Any]
    final_norm: FinalNorm
    layer_ids: list[int]
    sample_ids: list[str]


def export_store(
    path: str | os.PathLike[str] | Any,
    out: str | os.PathLike[str],
    *,
    format: ExportFormat,
    sample_ids: list[str] | None = None,
    final_norm: FinalNorm | None = None,
    progress: Callable[[ExportSummary], Any] | None = None,
) -> ExportSummary:
    """Write a store's samples as the files a drafter trainer reads.

    - ``"specforge"``: ``OUT/rows_{g}-{g+2000}/data_{idx}.ckpt``, one ``torch.save`` dict per
      sample (SpecForge's ``data.hidden_states_path``, in its YAML or as a dotted override).
    - ``"speculators"``: ``OUT/hidden_states/hs_{idx}.safetensors`` and the dataset rows in
      ``OUT`` (``datasets.load_from_disk``; speculators' ``--data-path``).

    Args:
        path: The store, as for `hsdump.open_store`.
        out: The export directory (created; a rerun resumes it).
        format: Which trainer's files to write.
        sample_ids: Export only these, in this order (default: every committed sample). A rerun
            must list the earlier run's samples first.
        final_norm: For a store that does not record whether its final state is ``post_norm`` or
            ``pre_norm`` (samples written without server metadata): say which it is.
        progress: Called with the summary after each sample.

    Raises:
        ExportError: The trainer needs a convention the store cannot be converted to, ``out``
            holds another export or other files, or writing failed (finished files are kept).
        SampleNotFoundError: A requested sample is not committed.
        InputError: ``sample_ids`` names a sample twice.
    """
    from hsdump._store.store import open_store

    target = TARGETS[format]()
    with open_store(path, "r") as store:
        prov = store.provenance
        if prov is None:
            raise ExportError(
                f"the store at {store.where} holds no committed sample: nothing to export"
            )
        out_dir = Path(out)
        previous = _read_manifest(out_dir, format)
        norm = resolve_final_norm(prov, final_norm, store.where)
        layer_ids = target.check(prov, norm, store.where)
        target.prepare(prov, store.where)
        ids = _choose_ids(store, sample_ids, previous)
        manifest = _Manifest(
            target=format,
            store=store.where,
            settings={name: getattr(prov, name) for name in SETTING_FIELDS},
            final_norm=norm,
            layer_ids=layer_ids,
            sample_ids=ids,
        )
        if previous is not None:
            _check_same_source(previous, manifest, out_dir)
        summary = ExportSummary(format, out_dir, len(ids), layer_ids)
        with _writing(out_dir):
            _write_json_atomic(out_dir / MANIFEST_NAME, manifest.model_dump(mode="json"))
            _remove_partials(out_dir)
            _export_files(store, target, out_dir, ids, summary, progress)
            target.finish(path, store, out_dir, ids)
    summary.complete = True
    summary.wall_s = time.perf_counter() - summary._start
    return summary


def _export_files(
    store: HiddenStateStore,
    target: Target,
    out: Path,
    ids: list[str],
    summary: ExportSummary,
    progress: Callable[[ExportSummary], Any] | None,
) -> None:
    def done(nbytes: int | None) -> None:  # None: the file was there
        if nbytes is None:
            summary.skipped += 1
        else:
            summary.written += 1
            summary.bytes_written += nbytes
        summary.wall_s = time.perf_counter() - summary._start
        if progress is not None:
            progress(summary)

    writers = _default_writers()
    made: set[Path] = set()
    pending: deque[Future[int]] = deque()
    with ThreadPoolExecutor(writers, thread_name_prefix="hsdump-export") as pool:
        for idx, sid in enumerate(ids):
            dest = target.path(out, idx)
            if dest.exists():  # files appear whole (renamed into place): one there is complete
                done(None)
                continue
            if dest.parent not in made:
                dest.parent.mkdir(parents=True, exist_ok=True)
                made.add(dest.parent)
            hs = store.get(sid)  # decoding this one overlaps the writes of the ones before
            pending.append(pool.submit(_write, target, hs, dest))
            while len(pending) > writers or (pending and pending[0].done()):
                done(pending.popleft().result())
        while pending:
            done(pending.popleft().result())


def _write(target: Target, hs: HiddenStates, dest: Path) -> int:
    target.write(hs, dest)
    return int(hs.nbytes)


def read_ids_file(path: str | os.PathLike[str]) -> list[str]:
    """Sample ids from a file, one per line (blank lines and ``#`` comments are skipped).

    Raises:
        ExportError: The file cannot be read.
        InputError: The file names an id twice.
    """
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise ExportError(f"cannot read the ids file {path}: {exc}") from exc
    ids: list[str] = []
    first_line: dict[str, int] = {}
    for number, line in enumerate(lines, 1):
        sid = line.strip()
        if not sid or sid.startswith("#"):
            continue
        if sid in first_line:
            raise InputError(
                f"{path}:{number}: sample id {sid!r} is listed twice (first on line "
                f"{first_line[sid]}): list each sample once"
            )
        first_line[sid] = number
        ids.append(sid)
    return ids


# -- the export directory --------------------------------------------------------------------


def _read_manifest(out: Path, format: ExportFormat) -> _Manifest | None:
    path = out / MANIFEST_NAME
    if out.exists() and not out.is_dir():
        raise ExportError(f"{out} is a file: the export needs a directory")
    if not path.exists():
        if out.exists() and any(out.iterdir()):
            raise ExportError(
                f"{out} holds files but no {MANIFEST_NAME}, so it is no hsdump export (resuming "
                "could count foreign files as exported): export into a new or empty directory"
            )
        return None
    try:
        manifest = _Manifest.model_validate_json(path.read_bytes())
    except (OSError, ValidationError) as exc:
        raise ExportError(
            f"cannot read {path} ({exc.__class__.__name__}): it is not an hsdump export "
            "manifest; export into a new directory"
        ) from exc
    if manifest.target != format:
        raise ExportError(
            f"{out} holds a {manifest.target} export, not {format}: export into another directory"
        )
    return manifest


def _choose_ids(
    store: HiddenStateStore, sample_ids: list[str] | None, previous: _Manifest | None
) -> list[str]:
    if sample_ids is not None:
        ids = list(sample_ids)
    elif previous is not None:
        known = set(previous.sample_ids)
        ids = previous.sample_ids + [s for s in store if s not in known]
    else:
        ids = list(store)
    if not ids:
        raise ExportError(f"no sample to export from the store at {store.where}: the list is empty")
    seen: set[str] = set()
    for sid in ids:
        if sid in seen:
            raise InputError(f"sample id {sid!r} is listed twice: list each sample once")
        seen.add(sid)
    missing = [s for s in ids if s not in store]
    if missing:
        raise SampleNotFoundError(
            f"{len(missing)} samples of the export are not committed in the store at "
            f"{store.where}, first {missing[0]!r}: list only committed ids (or, if an earlier "
            "export holds them, export into another directory)",
            sample_id=missing[0],
        )
    return ids


def _check_same_source(previous: _Manifest, now: _Manifest, out: Path) -> None:
    if previous.settings != now.settings or previous.final_norm != now.final_norm:
        changed = [k for k in now.settings if previous.settings.get(k) != now.settings[k]]
        raise ExportError(
            f"{out} was exported from a store with other settings (differing: "
            f"{', '.join(changed or ['final_norm'])}): export this store into another directory"
        )
    old, new = previous.sample_ids, now.sample_ids
    if new[: len(old)] != old:
        at = next((i for i, (a, b) in enumerate(zip(old, new, strict=False)) if a != b), len(new))
        found = repr(new[at]) if at < len(new) else "nothing"
        raise ExportError(
            f"{out} holds an export whose index {at} is sample {old[at]!r}, this run puts "
            f"{found} there: a rerun must list the earlier samples first, in the same order "
            f"(the order is in {MANIFEST_NAME}), or export into another directory"
        )


@contextlib.contextmanager
def _writing(out: Path) -> Iterator[None]:
    """Create the export directory; turn I/O errors into an `ExportError` naming it."""
    try:
        out.mkdir(parents=True, exist_ok=True)
        yield
    except OSError as exc:
        what = "no space left on the device" if exc.errno == errno.ENOSPC else str(exc)
        raise ExportError(
            f"writing the export in {out} failed: {what}. The files finished so far are kept: "
            "fix the cause and rerun the same export to resume"
        ) from exc


def _write_json_atomic(path: Path, value: Any) -> None:
    write_file_atomic(path, [(json.dumps(value, indent=1) + "\n").encode()])


def _remove_partials(out: Path) -> None:
    """Temporary files of a killed run. Their names end in neither ``.ckpt`` nor
    ``.safetensors``, so no trainer lists one as a sample."""
    for leftover in out.rglob(f"*{PARTIAL_SUFFIX}"):
        if leftover.is_dir():
            shutil.rmtree(leftover, ignore_errors=True)
        else:
            leftover.unlink(missing_ok=True)
