"""What the three runners share: their options, their summary and failures, the protocols of
what they drive, and the steps every run takes before and around its samples.

`run_extraction` (one process), `run_parallel_extraction` (worker processes) and
`run_ray_extraction` (a Ray cluster) take the same `RunOptions`, report the same
`ExtractionSummary`, write the same failures file (`FailureLog`) and plan a run the same way
(`plan_samples`).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import random
import resource
import signal
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import IO, TYPE_CHECKING, Any, Protocol

from hsdump._exceptions import ConfigError, SampleExistsError, StoreError
from hsdump._store.objstore import store_may_exist

if TYPE_CHECKING:
    from hsdump._store.part import Refused
    from hsdump._store.reader import CorruptSample
    from hsdump._types import HiddenStates, Sample

__all__ = [
    "QUEUES",
    "Backoff",
    "ExtractionSummary",
    "Extractor",
    "ExtractorSpec",
    "Failure",
    "FailureLog",
    "ProgressCallback",
    "RunOptions",
    "SampleSink",
    "Tally",
    "failures_path_for",
    "peak_rss_bytes",
    "plan_samples",
    "sigterm_as_interrupt",
    "token_change",
]

#: The queue before each stage, and that stage: samples pile up before the one that limits a run.
QUEUES: dict[str, str] = {
    "slot_wait": "server",
    "ingest_queue": "ingest",
    "store_queue": "store_write",
}


@dataclass(frozen=True)
class Backoff:
    """Exponential backoff with jitter between attempts of one sample.

    Attributes:
        initial: Seconds before the first retry.
        factor: Growth per retry.
        maximum: Upper bound of one delay.
        jitter: Fraction of random spread, so retries of many samples do not arrive together.
    """

    initial: float = 0.5
    factor: float = 2.0
    maximum: float = 30.0
    jitter: float = 0.1

    def delay(self, retry: int) -> float:
        """Seconds to wait before retry number ``retry`` (1-based)."""
        base = min(self.initial * self.factor ** (retry - 1), self.maximum)
        return base * (1 + self.jitter * (2 * random.random() - 1))


@dataclass(frozen=True)
class Failure:
    """A sample (or dataset line) that could not be extracted.

    Attributes:
        sample_id: The sample's ID, when known.
        line: Its line number in the dataset, when known.
        error: The error's class name.
        message: The error's message.
        attempts: How many requests were tried (0 for a bad dataset line).
    """

    sample_id: str | None
    line: int | None
    error: str
    message: str
    attempts: int

    def to_json(self) -> str:
        """One line of the failures file."""
        record = {
            "id": self.sample_id,
            "line": self.line,
            "error": self.error,
            "message": self.message,
            "attempts": self.attempts,
        }
        return json.dumps(record)


ProgressCallback = Callable[["ExtractionSummary"], None]


@dataclass(frozen=True, kw_only=True)
class RunOptions:
    """How a run treats its samples: what `run_extraction`, `run_parallel_extraction` and
    `run_ray_extraction` share.

    Attributes:
        concurrency: Requests at each server at once.
        retries: Retries of a sample after a transient failure (a fresh request each time).
        backoff: Delays between attempts.
        fail_fast: Stop at the first failure.
        failures_path: The JSONL failures file, rewritten by each run; none when None.
        progress: Called with the live summary after each sample (at most every 0.1 s with
            several workers).
        line_numbers: Dataset line of each sample id, for the failures file.
        prior_failures: Failures found before the run (bad dataset lines), recorded first.

    Raises:
        ConfigError: ``concurrency`` below 1 or ``retries`` below 0.
    """

    concurrency: int = 1
    retries: int = 3
    backoff: Backoff = field(default_factory=lambda: Backoff())
    fail_fast: bool = False
    failures_path: str | os.PathLike[str] | None = None
    progress: ProgressCallback | None = None
    line_numbers: Mapping[str, int] = field(default_factory=dict)
    prior_failures: Sequence[Failure] = ()

    def __post_init__(self) -> None:
        if self.retries < 0 or self.concurrency < 1:
            raise ConfigError(
                f"retries must be >= 0 and concurrency >= 1, got {self.retries}, {self.concurrency}"
            )

    def failure_log(self) -> FailureLog:
        """The run's failures file, with the failures found before the run recorded first."""
        path = Path(self.failures_path) if self.failures_path is not None else None
        return FailureLog(path, self.prior_failures)


@dataclass(frozen=True, kw_only=True)
class ExtractorSpec:
    """What a process that extracts (a worker, a Ray actor) needs to open its client and store."""

    url: str
    dump_dir: str | None
    store: str
    concurrency: int
    retries: int
    fail_fast: bool
    client_options: Mapping[str, Any] = field(default_factory=dict)
    store_options: Mapping[str, Any] = field(default_factory=dict)

    def run_options(self) -> RunOptions:
        """The options of each `run_extraction` this process runs."""
        return RunOptions(
            concurrency=self.concurrency, retries=self.retries, fail_fast=self.fail_fast
        )


@dataclass
class ExtractionSummary:
    """Live counters of a run; the progress callback receives it after each sample.

    Attributes:
        samples_total: Samples to extract in this run (committed ones excluded).
        tokens_total: Their tokens.
        skipped: Samples already in the store.
        recovered: Ids of samples committed before an unclean stop whose stored bytes failed
            their checksums: extracted again in this run (`HiddenStateStore.recovered`).
        samples_written: Samples handed to the store in this run (committed, or waiting for its
            next commit): what a worker is done with.
        samples_done: Samples committed in this run: counted once their commit is durable.
        tokens_done: Their tokens.
        bytes_raw: Hidden-state bytes committed, before compression.
        bytes_stored: Bytes the store has written to disk in this run, when it reports them.
        store_bytes_raw: Raw bytes of the samples behind ``bytes_stored``.
        retries: Retries made.
        failures: Samples and lines that failed.
        interrupted: Whether the run was cancelled before its end.
        stages: Seconds per stage, summed over samples: ``server`` (request to response),
            ``dump_wait`` (response to dump visible), ``ingest`` (read + validate), from the
            client's stats when it keeps them, and ``store_write``; and in the queue before each
            (`QUEUES`): ``slot_wait`` (for a request slot), ``ingest_queue`` (for an ingest
            thread), ``store_queue`` (extracted, for the store). Stages overlap in time.
        started: ``time.monotonic()`` at the start.
        finished: ``time.monotonic()`` at the end, or None while running.
        workers: Processes that extracted and stored (1: this one).
        cpu_s: CPU seconds those processes used (``cores_busy`` divides it by the wall time).
        peak_rss_bytes: Sum of their peak resident memory.
    """

    samples_total: int = 0
    tokens_total: int = 0
    skipped: int = 0
    recovered: list[str] = field(default_factory=list)
    samples_written: int = 0
    samples_done: int = 0
    tokens_done: int = 0
    bytes_raw: int = 0
    bytes_stored: int = 0
    store_bytes_raw: int = 0
    retries: int = 0
    failures: list[Failure] = field(default_factory=list)
    interrupted: bool = False
    stages: dict[str, float] = field(default_factory=dict)
    started: float = field(default_factory=time.monotonic)
    finished: float | None = None
    workers: int = 1
    cpu_s: float = 0.0
    peak_rss_bytes: int = 0

    @property
    def wall_s(self) -> float:
        """Seconds since the start (until the end once finished)."""
        return (self.finished or time.monotonic()) - self.started

    @property
    def tokens_per_s(self) -> float:
        """Tokens committed per second of wall time."""
        return self.tokens_done / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def bytes_per_s(self) -> float:
        """Raw hidden-state bytes committed per second."""
        return self.bytes_raw / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def cores_busy(self) -> float:
        """Cores the extracting processes kept busy on average."""
        return self.cpu_s / self.wall_s if self.wall_s > 0 else 0.0

    def stage_rates(self) -> dict[str, tuple[float, float]]:
        """Per stage (queues left out): GB/s of raw hidden states while the stage was busy, and
        its occupancy (how many samples were in that stage on average)."""
        rates = {}
        for name, seconds in self.stages.items():
            if name not in QUEUES:
                rate = self.bytes_raw / seconds / 1e9 if seconds > 0 else 0.0
                rates[name] = (rate, self.occupancy(name))
        return rates

    def occupancy(self, stage: str) -> float:
        """How many samples were in ``stage`` (or its queue) on average."""
        return self.stages.get(stage, 0.0) / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def limit(self) -> str | None:
        """The stage whose queue samples waited in longest (`QUEUES`); None when none waited."""
        queued = {stage: self.stages.get(queue, 0.0) for queue, stage in QUEUES.items()}
        stage = max(queued, key=queued.__getitem__)
        return stage if queued[stage] > 0 else None

    @property
    def ratio(self) -> float:
        """Compression ratio (raw / stored); NaN before anything is stored."""
        return self.store_bytes_raw / self.bytes_stored if self.bytes_stored else math.nan

    @property
    def eta_s(self) -> float | None:
        """Seconds left at the current token rate; None before the first sample."""
        if not self.tokens_per_s:
            return None
        return max(self.tokens_total - self.tokens_done, 0) / self.tokens_per_s

    @property
    def ok(self) -> bool:
        """True when the run finished with no failure."""
        return not self.failures and not self.interrupted


class Extractor(Protocol):
    """What turns a sample into hidden states (a `HiddenStateClient`)."""

    async def extract(self, sample: Sample) -> HiddenStates:
        """One attempt; raises `HsdumpError` (with ``transient``) on failure."""
        ...


class SampleSink(Protocol):
    """Where a run commits samples (a `HiddenStateStore`; `hsdump.testing.MemorySink` in tests).

    Everything a runner calls is declared here.

    Attributes:
        checks_values: Whether the sink checks the values of states handed over unchecked
            (`HiddenStates.values_checked` False: finite, no vector all zeros) and refuses those
            that fail (`take_refused`), as a `HiddenStateStore` does in the pass that places
            them. A run hands such a sink its client's dumps unchecked; any other sink gets
            them checked by the client.
    """

    checks_values: bool

    def __contains__(self, sample_id: object) -> bool:
        """Whether the sample is committed (durable where the sink is: a run counts a sample done
        only then)."""
        ...

    @property
    def recovered(self) -> Sequence[CorruptSample]:
        """Samples committed before an unclean stop that failed their checksums when the sink
        opened: they are not in it, and the run extracts them again."""
        ...

    async def awrite(self, states: HiddenStates) -> Any:
        """Write one sample; it is all or nothing, also when the caller is cancelled."""
        ...

    async def aflush(self) -> None:
        """Commit buffered samples."""
        ...

    def token_mismatch(self, sample: Sample) -> str | None:
        """How a committed sample's tokens differ from ``sample``'s; None when they do not."""
        ...

    def take_refused(self) -> Sequence[Refused]:
        """Samples written with their values unchecked that failed the check since the last
        call: they were counted as written and are not committed."""
        ...

    @property
    def bytes_raw_written(self) -> int:
        """Raw bytes of the samples written so far (committed or buffered)."""
        ...

    @property
    def bytes_stored(self) -> int:
        """Bytes written to storage so far: with ``bytes_raw_written``, the compression ratio."""
        ...


class Tally:
    """The counters of a run spread over processes (worker processes, Ray actors): what ended
    processes committed and counted, plus the running counters of the live ones, folded into the
    run's summary, which the progress callback sees at most every 0.1 s."""

    ADDITIVE = ("samples_done", "tokens_done", "bytes_raw", "retries", "skipped")
    TOTALS = ("bytes_stored", "store_bytes_raw", "cpu_s")

    def __init__(self, summary: ExtractionSummary, progress: ProgressCallback | None):
        self.summary, self._progress = summary, progress
        self.closed: dict[str, Any] = dict.fromkeys((*self.ADDITIVE, *self.TOTALS), 0)
        self.closed.update(stages={}, peak_rss_bytes=0)
        self._skipped_at_start = summary.skipped
        self._reported = 0.0

    def commit(self, done: Sequence[Sample], bytes_per_token: float) -> None:
        """Count the samples an ended process committed, as the store says."""
        tokens = sum(len(s.input_ids) for s in done)
        self.closed["samples_done"] += len(done)
        self.closed["tokens_done"] += tokens
        self.closed["bytes_raw"] += int(tokens * bytes_per_token)

    def fold(self, counters: Mapping[str, Any], names: Sequence[str] = TOTALS) -> None:
        """An ended process's running ``counters`` (``names``, its stages and peak memory)."""
        for name in names:
            self.closed[name] += counters.get(name, 0)
        for name, seconds in counters.get("stages", {}).items():
            self.closed["stages"][name] = self.closed["stages"].get(name, 0.0) + seconds
        peak = self.closed["peak_rss_bytes"]
        self.closed["peak_rss_bytes"] = max(peak, counters.get("peak_rss_bytes", 0))

    def report(self, live: Sequence[Mapping[str, Any]], *, force: bool = False) -> None:
        """Set the summary from the closed counters and the ``live`` processes' own."""
        s, closed = self.summary, self.closed
        for name in (*self.ADDITIVE, *self.TOTALS):
            setattr(s, name, closed[name] + sum(c.get(name, 0) for c in live))
        s.skipped += self._skipped_at_start
        s.cpu_s += time.process_time()  # this process's own
        s.stages = dict(closed["stages"])
        for c in live:
            for name, seconds in c.get("stages", {}).items():
                s.stages[name] = s.stages.get(name, 0.0) + seconds
        s.peak_rss_bytes = closed["peak_rss_bytes"] + sum(c.get("peak_rss_bytes", 0) for c in live)
        now = time.monotonic()
        if self._progress is not None and (force or now - self._reported > 0.1):
            self._reported = now
            self._progress(s)


def token_change(store: SampleSink, sample: Sample) -> SampleExistsError | None:
    """The error for a sample whose id the store holds with other tokens; None if they match."""
    reason = store.token_mismatch(sample)
    if reason is None:
        return None
    return SampleExistsError(
        f"the store holds this id with other tokens: {reason}. The dataset line changed "
        "since the sample was written, so it is not skipped and not extracted (a store "
        "never replaces a committed sample): restore the line, give it a new id, or "
        "extract into a new store",
        sample_id=sample.id,
    )


def peak_rss_bytes() -> int:
    """This process's peak resident memory."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def failures_path_for(store_path: str | os.PathLike[str]) -> Path:
    """The failures file beside a store: ``<store>.failures.jsonl``."""
    path = Path(store_path)
    return path.with_name(f"{path.name}.failures.jsonl")


class FailureLog:
    """Appends failures to the JSONL file as they happen, so a killed run keeps them.

    The file is this run's record: a stale one is removed at the start, and none is written
    when nothing fails.
    """

    def __init__(self, path: Path | None, prior: Sequence[Failure] = ()):
        self.path = path
        self._prior = prior
        self._file: IO[str] | None = None

    def __enter__(self) -> FailureLog:
        if self.path is not None:
            self._guard(self.path.unlink, missing_ok=True)
        for failure in self._prior:
            self.record(failure)
        return self

    def record(self, failure: Failure) -> None:
        if self.path is None:
            return
        if self._file is None:
            self._file = self._guard(open, self.path, "w", encoding="utf-8")
        self._file.write(failure.to_json() + "\n")
        self._file.flush()

    def _guard(self, call: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        try:
            return call(*args, **kwargs)
        except OSError as exc:
            raise ConfigError(f"cannot write the failures file {self.path}: {exc}") from exc

    def __exit__(self, *exc_info: object) -> None:
        if self._file is not None:
            self._file.close()


def plan_samples(
    samples: Sequence[Sample],
    store: str,
    summary: ExtractionSummary,
    line_numbers: Mapping[str, int],
) -> list[Sample]:
    """What is left to do; a stored id whose dataset tokens changed is a failure, not a skip."""
    opened_store = None
    if store_may_exist(store):  # zarr is imported only for a store that may be there
        from hsdump._store.store import open_store

        # An object-store URL with no store yet holds nothing (the workers report other errors).
        with contextlib.suppress(StoreError):
            opened_store = open_store(store, "r")
    if opened_store is None:
        todo = list(samples)
    else:
        with opened_store as opened:
            summary.recovered = [c.sample_id for c in opened.recovered]
            todo = [s for s in samples if s.id not in opened]
            for sample in (s for s in samples if s.id in opened):
                exc = token_change(opened, sample)
                if exc is not None:
                    line = line_numbers.get(sample.id)
                    summary.failures.append(
                        Failure(sample.id, line, type(exc).__name__, str(exc), 0)
                    )
                else:
                    summary.skipped += 1
    summary.samples_total = len(todo)
    summary.tokens_total = sum(len(s.input_ids) for s in todo)
    return todo


@contextlib.contextmanager
def sigterm_as_interrupt() -> Iterator[None]:
    """SIGTERM stops the run like Ctrl-C, unless the caller handles SIGTERM already."""
    try:
        installed = signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
        if installed:
            signal.signal(signal.SIGTERM, _interrupt)
    except ValueError:  # not the main thread: signals are the main thread's business
        installed = False
    try:
        yield  # outside the try above: a ValueError of the run (a ConfigError) is not caught
    finally:
        if installed:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)


def _interrupt(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt(f"signal {signum}")
