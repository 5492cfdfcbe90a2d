"""The extraction loop: samples in, committed samples out, failures recorded, resumable.

Used by ``hsdump extract`` and from Python. It skips samples the store already holds, retries
transient failures with backoff (each retry is a fresh request: the client picks a new rid and
cache key per call), records samples that keep failing in a JSONL failures file and goes on, and
on cancellation (Ctrl-C) lets the store write in flight finish, so the store stays consistent and a
rerun resumes where this one stopped.

Two stages joined by a bounded stream: ``concurrency + 1`` extraction workers pull samples from one
shared iterator (the client's own gate keeps ``max_in_flight`` requests at the server, and the
extra worker has the next request waiting at that gate), and one writer commits to the store. So
while sample k is validated and written, sample k+1 is already at the server, also one at a time,
and memory stays bounded by the workers plus the stream's one slot.
"""

from __future__ import annotations

import functools
import json
import logging
import math
import os
import random
import resource
import time
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, Protocol

import anyio
import anyio.to_thread
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from hsdump._cores import switch_interval
from hsdump._exceptions import ConfigError, HsdumpError, SampleExistsError, StoreError

if TYPE_CHECKING:
    from hsdump._client.client import ClientStats
    from hsdump._types import HiddenStates, Sample

__all__ = [
    "QUEUES",
    "Backoff",
    "ExtractionSummary",
    "Extractor",
    "ExtractorSpec",
    "Failure",
    "SampleSink",
    "failures_path_for",
    "run_extraction",
]

logger = logging.getLogger(__name__)

_WRITES_IN_FLIGHT = 2

#: The queue before each stage, and that stage: samples pile up before the one that limits a run.
QUEUES: dict[str, str] = {
    "slot_wait": "server",
    "ingest_queue": "ingest",
    "store_queue": "store_write",
}


class Extractor(Protocol):
    """What turns a sample into hidden states (a `HiddenStateClient`)."""

    async def extract(self, sample: Sample) -> HiddenStates:
        """One attempt; raises `HsdumpError` (with ``transient``) on failure."""
        ...


class SampleSink(Protocol):
    """Where committed samples go (a `HiddenStateStore`).

    ``bytes_raw`` (or ``bytes_raw_written``) and ``bytes_stored`` attributes, when present, feed
    the compression ratio. A ``token_mismatch(sample)`` method, when present, says how a committed
    sample's tokens differ from the dataset's (None when they do not): such a sample is a failure.
    """

    def __contains__(self, sample_id: object) -> bool:
        """Whether the sample is committed."""
        ...

    async def awrite(self, states: HiddenStates) -> Any:
        """Write one sample; it is all or nothing, also when the caller is cancelled."""
        ...

    async def aflush(self) -> None:
        """Commit buffered samples."""
        ...


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


@dataclass
class ExtractionSummary:
    """Live counters of a run; the progress callback receives it after each sample.

    Attributes:
        samples_total: Samples to extract in this run (committed ones excluded).
        tokens_total: Their tokens.
        skipped: Samples already in the store.
        samples_done: Samples committed in this run.
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


ProgressCallback = Callable[[ExtractionSummary], None]
_Extracted = tuple["Sample", "HiddenStates", int, float]  # ..., attempts, extracted at


class _Source:
    """The samples the extraction workers share: a planned list, or a stream fed from elsewhere
    (the multi-process runner's queue), which ends when its sending side closes."""

    def __init__(self, samples: Iterator[Sample] | MemoryObjectReceiveStream[Sample]):
        self._samples = samples

    async def next(self) -> Sample | None:
        if isinstance(self._samples, MemoryObjectReceiveStream):
            try:
                return await self._samples.receive()
            except (anyio.EndOfStream, anyio.ClosedResourceError):
                return None
        return next(self._samples, None)

    def left(self) -> bool:
        """Whether samples were left unextracted (fail-fast stopped the run)."""
        if isinstance(self._samples, MemoryObjectReceiveStream):
            return self._samples.statistics().current_buffer_used > 0
        return any(True for _ in self._samples)


def _store_bytes(store: object) -> tuple[int, int]:
    """Raw and stored bytes of the same samples (a store may commit after writing)."""
    raw: Any = getattr(store, "bytes_raw_written", None)
    if raw is None:
        raw = getattr(store, "bytes_raw", 0)
    return int(raw), int(getattr(store, "bytes_stored", 0))


def token_change(store: object, sample: Sample) -> SampleExistsError | None:
    """The error for a sample whose id the store holds with other tokens; None if they match."""
    mismatch = getattr(store, "token_mismatch", None)
    reason = mismatch(sample) if mismatch is not None else None
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


def _cpu_s(store: object) -> float:
    """CPU seconds of this process and of the store's own process, when it has one."""
    return time.process_time() + float(getattr(store, "cpu_s", 0.0))


def failures_path_for(store_path: str | os.PathLike[str]) -> Path:
    """The failures file beside a store: ``<store>.failures.jsonl``."""
    path = Path(store_path)
    return path.with_name(f"{path.name}.failures.jsonl")


class _FailureLog:
    """Appends failures to the JSONL file as they happen, so a killed run keeps them.

    The file is this run's record: a stale one is removed at the start, and none is written
    when nothing fails.
    """

    def __init__(self, path: Path | None):
        self.path = path
        self._file: IO[str] | None = None

    def __enter__(self) -> _FailureLog:
        if self.path is not None:
            self._guard(self.path.unlink, missing_ok=True)
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


@dataclass(frozen=True)
class _Policy:
    """How a run treats each sample: `run_extraction`'s arguments about samples."""

    retries: int
    backoff: Backoff
    fail_fast: bool
    progress: ProgressCallback | None
    line_numbers: Mapping[str, int]


class _Run:
    def __init__(
        self,
        client: Extractor,
        store: SampleSink,
        policy: _Policy,
        log: _FailureLog,
        summary: ExtractionSummary,
    ):
        self.client = client
        self.store = store
        self.retries = policy.retries
        self.backoff = policy.backoff
        self.fail_fast = policy.fail_fast
        self.progress = policy.progress
        self.lines = policy.line_numbers
        self.log = log
        self.summary = summary
        self.fatal: StoreError | None = None
        # Two writes in flight: the next waits on the store's own lock in its thread, so the
        # store starts it the moment the last returns instead of after a trip through the event
        # loop (the loop also runs the client, and between writes it idled the store: one
        # worker's store kept a write in progress 60% of the time while samples queued for it).
        # Other sinks get one write at a time: they need not be safe to call twice at once.
        self._writes = _writes_in_flight(store)
        self._write_slots = anyio.Semaphore(self._writes)
        self._cpu_start = _cpu_s(store)
        self._store_start = _store_bytes(store)
        stats = _client_stats(client)
        self._client_start = stats.copy() if stats is not None else None
        self._extract = _extract_call(client, store, policy.fail_fast)
        self._retried: dict[str, int] = {}  # attempts of samples written after a retry

    def plan(self, samples: Sequence[Sample]) -> list[Sample]:
        todo = [s for s in samples if s.id not in self.store]
        changed = [s for s in samples if s.id in self.store and self._tokens_changed(s)]
        self.summary.skipped = len(samples) - len(todo) - len(changed)
        self.summary.samples_total = len(todo)
        self.summary.tokens_total = sum(len(s.input_ids) for s in todo)
        return todo

    def _tokens_changed(self, sample: Sample) -> bool:
        """Record a failure if the store holds ``sample.id`` with other tokens (a changed line)."""
        exc = token_change(self.store, sample)
        if exc is not None:
            self.fail(sample.id, exc, 0)
        return exc is not None

    async def extractor(
        self,
        source: _Source,
        out: MemoryObjectSendStream[_Extracted],
        scope: anyio.CancelScope,
    ) -> None:
        async with out:
            while (sample := await source.next()) is not None:
                extracted = await self.attempts(sample)
                if extracted is not None:
                    await out.send((*extracted, time.perf_counter()))
                    # The states hold the dump's pages: not over the wait for the next sample.
                    del extracted
                    continue
                self._report()
                if self.fail_fast:
                    scope.cancel()
                    return

    async def writer(
        self, results: MemoryObjectReceiveStream[_Extracted], scope: anyio.CancelScope
    ) -> None:
        async with results, anyio.create_task_group() as writes:
            async for sample, states, attempt, extracted_at in results:
                await self._write_slots.acquire()
                writes.start_soon(self._write_one, sample, states, attempt, extracted_at, scope)
                del states  # the write holds them for as long as it needs them

    async def _write_one(
        self,
        sample: Sample,
        states: HiddenStates,
        attempt: int,
        extracted_at: float,
        scope: anyio.CancelScope,
    ) -> None:
        try:
            committed = await self.commit(sample, states, attempt, extracted_at)
        finally:
            self._write_slots.release()
        self._report()
        if not committed and (self.fail_fast or self.fatal is not None):
            scope.cancel()

    async def attempts(self, sample: Sample) -> tuple[Sample, HiddenStates, int] | None:
        """Extract ``sample``, retrying transient failures; None when it failed for good."""
        for attempt in range(1, self.retries + 2):
            try:
                return sample, await self._extract(sample), attempt
            except HsdumpError as exc:
                if not exc.transient or attempt > self.retries:
                    self.fail(sample.id, exc, attempt)
                    return None
                self.summary.retries += 1
                logger.warning("sample %r, attempt %d: %s; retrying", sample.id, attempt, exc)
                await anyio.sleep(self.backoff.delay(attempt))
        raise AssertionError("unreachable: the last attempt returns")

    async def commit(
        self, sample: Sample, states: HiddenStates, attempt: int, extracted_at: float
    ) -> bool:
        started = time.perf_counter()
        self._add_stage("store_queue", started - extracted_at)
        try:
            await self.store.awrite(states)
        except SampleExistsError:
            self.summary.skipped += 1  # another writer committed it meanwhile
            return True
        except StoreError as exc:
            # The store refuses every later sample too (disk full, other provenance, damage):
            # stop now rather than prefill the rest only to drop it.
            self.fatal = exc
            return False
        except HsdumpError as exc:
            self.fail(sample.id, exc, attempt)
            return False
        self._add_stage("store_write", time.perf_counter() - started)
        self.summary.samples_done += 1
        self.summary.tokens_done += states.num_tokens
        self.summary.bytes_raw += states.nbytes
        if attempt > 1 and not states.values_checked:
            self._retried[sample.id] = attempt
        self.count_stored()
        logger.info("wrote sample %r (%d tokens)", sample.id, states.num_tokens)
        return not self.take_refused()

    def take_refused(self) -> int:
        """Count the samples the store refused since the last call as failed; how many.

        Only samples written with their values unchecked (``defer_value_checks``) are refused,
        once their rows are placed: they were counted as written, and are not in the store.
        """
        take = getattr(self.store, "take_refused", None)
        refused = take() if take is not None else []
        for r in refused:
            self.summary.samples_done -= 1
            self.summary.tokens_done -= r.num_tokens
            self.summary.bytes_raw -= r.raw_bytes
            self.fail(r.sample_id, r.error, self._retried.pop(r.sample_id, 1))
        return len(refused)

    def count_stored(self) -> None:
        """Follow the store's own counters: it buffers samples and compresses whole shards."""
        raw, stored = _store_bytes(self.store)
        self.summary.store_bytes_raw = raw - self._store_start[0]
        self.summary.bytes_stored = stored - self._store_start[1]

    async def flush(self) -> None:
        with anyio.CancelScope(shield=True):
            for _ in range(self._writes):  # every write done, none started meanwhile
                await self._write_slots.acquire()
            try:
                await self.store.aflush()
            except StoreError:
                if self.fatal is None:
                    raise  # else a failed store refuses to flush: report what failed first
            finally:
                for _ in range(self._writes):
                    self._write_slots.release()
            self.take_refused()
            self.count_stored()

    def fail(self, sample_id: str, exc: HsdumpError, attempts: int) -> None:
        failure = Failure(
            sample_id, self.lines.get(sample_id), type(exc).__name__, str(exc), attempts
        )
        self.summary.failures.append(failure)
        self.log.record(failure)
        logger.error("sample %r failed after %d attempt(s): %s", sample_id, attempts, exc)

    def _add_stage(self, name: str, seconds: float) -> None:
        self.summary.stages[name] = self.summary.stages.get(name, 0.0) + seconds

    def _client_stages(self) -> None:
        stats = _client_stats(self.client)
        if stats is not None and self._client_start is not None:
            self.summary.stages.update(stats.since(self._client_start).stages())

    def _report_counters(self) -> None:
        self._client_stages()
        self.summary.cpu_s = _cpu_s(self.store) - self._cpu_start
        store_rss = int(getattr(self.store, "peak_rss_bytes", 0))  # a store process's
        self.summary.peak_rss_bytes = peak_rss_bytes() + store_rss

    def _report(self) -> None:
        self._report_counters()
        if self.progress is not None:
            self.progress(self.summary)


async def run_extraction(
    samples: Sequence[Sample] | MemoryObjectReceiveStream[Sample],
    *,
    client: Extractor,
    store: SampleSink,
    retries: int = 3,
    backoff: Backoff | None = None,
    concurrency: int = 1,
    failures_path: str | os.PathLike[str] | None = None,
    fail_fast: bool = False,
    progress: ProgressCallback | None = None,
    line_numbers: Mapping[str, int] | None = None,
    prior_failures: Sequence[Failure] = (),
) -> ExtractionSummary:
    """Extract every sample the store does not hold yet, and commit it.

    Args:
        samples: The samples, in order; or a stream of samples that ends when its sender closes
            (then nothing is planned: the sender skips committed samples and counts totals).
        client: An open `HiddenStateClient` (or anything with its ``extract``).
        store: An open store in write mode.
        retries: Retries of a sample after a transient failure (a fresh request each time).
        backoff: Delays between attempts.
        concurrency: Samples in progress at once (give the client as many ``max_in_flight``).
        failures_path: The JSONL failures file, rewritten by each run; none when None.
        fail_fast: Stop at the first failure.
        progress: Called with the live summary after each sample.
        line_numbers: Dataset line of each sample id, for the failures file.
        prior_failures: Failures found before the run (bad dataset lines), recorded first.

    Returns:
        The summary; ``summary.ok`` is False when anything failed or the run was cancelled.

    Raises:
        StoreError: The store refused a write for a reason no retry fixes (no space left, a
            sample of other provenance, damage): the run stops at once, committed samples kept.
    """
    if retries < 0 or concurrency < 1:
        raise ConfigError(
            f"retries must be >= 0 and concurrency >= 1, got {retries}, {concurrency}"
        )
    summary = ExtractionSummary(failures=list(prior_failures))
    path = Path(failures_path) if failures_path is not None else None
    with switch_interval(), _FailureLog(path) as log:
        for failure in prior_failures:
            log.record(failure)
        policy = _Policy(retries, backoff or Backoff(), fail_fast, progress, line_numbers or {})
        run = _Run(client, store, policy, log, summary)
        await _drive(run, samples, concurrency)
    if run.fatal is not None:
        raise run.fatal
    return summary


async def _drive(
    run: _Run, samples: Sequence[Sample] | MemoryObjectReceiveStream[Sample], concurrency: int
) -> None:
    summary = run.summary
    if isinstance(samples, MemoryObjectReceiveStream):
        source, workers = _Source(samples), concurrency + 1
    else:
        source = _Source(iter(run.plan(samples)))
        workers = min(concurrency + 1, max(summary.samples_total, 1))
    run._report()
    if summary.failures and run.fail_fast:
        summary.finished = time.monotonic()
        return
    send, receive = anyio.create_memory_object_stream[_Extracted](max_buffer_size=1)
    try:
        async with anyio.create_task_group() as group:
            group.start_soon(run.writer, receive, group.cancel_scope)
            async with send:
                for _ in range(workers):
                    group.start_soon(run.extractor, source, send.clone(), group.cancel_scope)
    except BaseException:
        summary.interrupted = True
        raise
    finally:
        await run.flush()
        run._report_counters()
        summary.finished = time.monotonic()
    if source.left():
        summary.interrupted = True  # fail-fast stopped the run with samples left


def _writes_in_flight(store: SampleSink) -> int:
    """Samples handed to ``store`` at once: two for a `HiddenStateStore` (its lock serialises
    them), one for any other sink."""
    from hsdump._store.store import HiddenStateStore

    return _WRITES_IN_FLIGHT if isinstance(store, HiddenStateStore) else 1


def _extract_call(
    client: Extractor, store: SampleSink, fail_fast: bool
) -> Callable[[Sample], Awaitable[HiddenStates]]:
    """How the run extracts a sample: with each dump's value check left to the store's placement
    (``HSDUMP_VALUE_CHECKS=store``) when the client is a `HiddenStateClient` and the store refuses
    such samples itself (``take_refused``), else with the client's own check. A fail-fast run
    keeps the client's check: the store tells of a refusal only once the sample's shard is on
    disk, and such a run stops at the sample that fails."""
    from hsdump._client.client import HiddenStateClient
    from hsdump._settings import settings

    if (
        not fail_fast
        and settings().value_checks == "store"
        and isinstance(client, HiddenStateClient)
        and callable(getattr(store, "take_refused", None))
    ):
        return functools.partial(client.extract, defer_value_checks=True)
    return client.extract


def _client_stats(client: Extractor) -> ClientStats | None:
    """The client's own counters, when it is a client that keeps them."""
    from hsdump._client.client import ClientStats

    stats = getattr(client, "stats", None)
    return stats if isinstance(stats, ClientStats) else None
