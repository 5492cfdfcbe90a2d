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

import logging
import time
from collections.abc import Awaitable, Callable, Iterator, Sequence
from typing import TYPE_CHECKING

import anyio
import anyio.to_thread
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from hsdump._exceptions import HsdumpError, SampleExistsError, StoreError
from hsdump._run.common import (
    ExtractionSummary,
    Extractor,
    Failure,
    FailureLog,
    RunOptions,
    SampleSink,
    peak_rss_bytes,
    token_change,
)

if TYPE_CHECKING:
    from hsdump._client.client import ClientStats
    from hsdump._types import HiddenStates, Sample

__all__ = ["run_extraction"]

logger = logging.getLogger(__name__)

_WRITES_IN_FLIGHT = 2

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


class _Run:
    def __init__(self, client: Extractor, store: SampleSink, options: RunOptions, log: FailureLog):
        self.client = client
        self.store = store
        self.options = options
        self.retries = options.retries
        self.fail_fast = options.fail_fast
        self.lines = options.line_numbers
        self.log = log
        self.summary = ExtractionSummary(failures=list(options.prior_failures))
        self.fatal: StoreError | None = None
        # Two writes in flight: the next waits on the store's own lock in its thread, so the
        # store starts it the moment the last returns instead of after a trip through the event
        # loop (the loop also runs the client, and between writes it idled the store: one
        # worker's store kept a write in progress 60% of the time while samples queued for it).
        # Other sinks get one write at a time: they need not be safe to call twice at once.
        self._writes = _writes_in_flight(store)
        self._write_slots = anyio.Semaphore(self._writes)
        self._cpu_start = time.process_time()
        self._store_start = (store.bytes_raw_written, store.bytes_stored)
        # Written by this run, not committed yet: id -> (tokens, raw bytes). Other runs may write
        # into the same store at once (a Ray actor's batches): each counts only its own.
        self._uncommitted: dict[str, tuple[int, int]] = {}
        stats = _client_stats(client)
        self._client_start = stats.copy() if stats is not None else None
        self._extract = _extract_call(client, store.checks_values and not options.fail_fast)
        self._retried: dict[str, int] = {}  # attempts of samples written after a retry

    def plan(self, samples: Sequence[Sample]) -> list[Sample]:
        todo = [s for s in samples if s.id not in self.store]
        changed = [s for s in samples if s.id in self.store and self._tokens_changed(s)]
        self.summary.skipped = len(samples) - len(todo) - len(changed)
        self.summary.recovered = [c.sample_id for c in self.store.recovered]
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
                await anyio.sleep(self.options.backoff.delay(attempt))
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
        self.summary.samples_written += 1
        self._uncommitted[sample.id] = (states.num_tokens, states.nbytes)
        if attempt > 1 and not states.values_checked:
            self._retried[sample.id] = attempt
        self.count_stored()
        logger.info("wrote sample %r (%d tokens)", sample.id, states.num_tokens)
        return not self.take_refused()

    def take_refused(self) -> int:
        """Record the samples the store refused since the last call as failed; how many.

        Only samples written with their values unchecked (`extract_unchecked`) are refused, once
        their rows are placed: they are never committed, so never counted as done.
        """
        refused = self.store.take_refused()
        for r in refused:
            self.summary.samples_written -= 1  # written, then refused: a failure, not both
            self._uncommitted.pop(r.sample_id, None)
            self.fail(r.sample_id, r.error, self._retried.pop(r.sample_id, 1))
        return len(refused)

    def count_stored(self) -> None:
        """Follow the store: it buffers samples and compresses whole shards, and a sample is done
        only once its commit is durable (when the store holds it)."""
        for sid in [sid for sid in self._uncommitted if sid in self.store]:
            tokens, raw = self._uncommitted.pop(sid)
            self.summary.samples_done += 1
            self.summary.tokens_done += tokens
            self.summary.bytes_raw += raw
        self.summary.store_bytes_raw = self.store.bytes_raw_written - self._store_start[0]
        self.summary.bytes_stored = self.store.bytes_stored - self._store_start[1]

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
        self.summary.cpu_s = time.process_time() - self._cpu_start
        self.summary.peak_rss_bytes = peak_rss_bytes()

    def _report(self) -> None:
        self._report_counters()
        if self.options.progress is not None:
            self.options.progress(self.summary)


async def run_extraction(
    samples: Sequence[Sample] | MemoryObjectReceiveStream[Sample],
    *,
    client: Extractor,
    store: SampleSink,
    options: RunOptions | None = None,
) -> ExtractionSummary:
    """Extract every sample the store does not hold yet, and commit it.

    Args:
        samples: The samples, in order; or a stream of samples that ends when its sender closes
            (then nothing is planned: the sender skips committed samples and counts totals).
        client: An open `HiddenStateClient` (or anything with its ``extract``).
        store: An open store in write mode.
        options: Concurrency (give the client as many ``max_in_flight``), retries, the failures
            file, progress; `RunOptions`' defaults when None.

    Returns:
        The summary; ``summary.ok`` is False when anything failed or the run was cancelled.

    Raises:
        StoreError: The store refused a write for a reason no retry fixes (no space left, a
            sample of other provenance, damage): the run stops at once, committed samples kept.
    """
    options = options or RunOptions()
    with options.failure_log() as log:
        run = _Run(client, store, options, log)
        await _drive(run, samples, options.concurrency)
    if run.fatal is not None:
        raise run.fatal
    return run.summary


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
        run._report()  # what the last flush committed
        summary.finished = time.monotonic()
    if source.left():
        summary.interrupted = True  # fail-fast stopped the run with samples left


def _writes_in_flight(store: SampleSink) -> int:
    """Samples handed to ``store`` at once: two for a `HiddenStateStore` (its lock serialises
    them), one for any other sink."""
    from hsdump._store.store import HiddenStateStore

    return _WRITES_IN_FLIGHT if isinstance(store, HiddenStateStore) else 1


def _extract_call(
    client: Extractor, unchecked: bool
) -> Callable[[Sample], Awaitable[HiddenStates]]:
    """How the run extracts a sample: with ``unchecked``, a `HiddenStateClient` leaves each dump's
    value check to the sink (`SampleSink.checks_values`: a store's placement, which reads every
    byte anyway), which refuses a sample that fails it (`SampleSink.take_refused`). A fail-fast
    run keeps the client's check: the store tells of a refusal only once the sample's shard is
    on disk, and such a run stops at the sample that fails."""
    from hsdump._client.client import HiddenStateClient, extract_unchecked

    if unchecked and isinstance(client, HiddenStateClient):
        return lambda sample: extract_unchecked(client, sample)
    return client.extract


def _client_stats(client: Extractor) -> ClientStats | None:
    """The client's own counters, when it is a client that keeps them."""
    from hsdump._client.client import HiddenStateClient

    return client.stats if isinstance(client, HiddenStateClient) else None
