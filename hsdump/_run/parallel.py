"""Extraction in several processes: each worker has its own client and its own part of the store.

One interpreter cannot read, check and compress hidden states as fast as a GPU produces them: its
threads queue on one lock. `run_parallel_extraction` starts ``workers`` processes. Each one
opens a `HiddenStateClient` on the same server and dump root, and writes its own
part (``w<i>``) of the same store, so ingest and compression run on every core. This process keeps
the dataset, hands samples to the workers that have room (a slow worker takes fewer), and adds up
their progress.

Requests in flight stay bounded for the whole run: every worker's client hands its requests to
this process, which posts them from threads of its own, at most ``concurrency`` at each server
(`hsdump._run.posting`), so ``concurrency=1`` is still one request at a time, and a request goes
out, and its answer comes back, without waiting for a worker's busy interpreter.

Failures: a worker that dies keeps its part's committed samples. This process reads the store to
see which of the samples it gave that worker are committed, gives the rest to the others, and
restarts the worker on the same part (a few times at most). Stopping (Ctrl-C, SIGTERM) sends no
further request and tells every worker to cancel its run, as Ctrl-C does in one process: it
finishes the store writes in flight, commits, removes its dumps and exits; a worker whose parent
dies gets SIGTERM from the kernel and does the same.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import multiprocessing.connection
import os
import time
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from hsdump._client.sending import ServerAnswer
from hsdump._cores import cores
from hsdump._exceptions import ConfigError, HsdumpError, WorkerError
from hsdump._protocol import remove_dump, request_dir
from hsdump._run.common import (
    ExtractionSummary,
    Failure,
    FailureLog,
    RunOptions,
    Tally,
    plan_samples,
    sigterm_as_interrupt,
)
from hsdump._run.posting import Ask, ParentPosts
from hsdump._run.worker import STOP_GRACE_S, WorkerSpec, worker_main
from hsdump._settings import setting
from hsdump._types import Sample

__all__ = ["committed_ids", "run_parallel_extraction"]

logger = logging.getLogger(__name__)

_POLL_S = 0.05
_REQUEST_TIMEOUT_S = 600.0  # HiddenStateClient's default
_MAX_RESTARTS = 3


@dataclass
class _Worker:
    spec: WorkerSpec
    process: Any
    conn: Any
    given: dict[str, Sample] = field(default_factory=dict)
    failed: set[str] = field(default_factory=set)
    counters: dict[str, Any] = field(default_factory=dict)
    restarts: int = 0
    exited: bool = False

    @property
    def finished(self) -> int:
        """Samples the worker is done with: written (committed or not yet), skipped or failed."""
        c = self.counters
        return int(c.get("written", 0) + c.get("skipped", 0) + c.get("failed", 0))

    @property
    def outstanding(self) -> int:
        return len(self.given) - self.finished


class _Parallel:
    def __init__(
        self,
        specs: list[WorkerSpec],
        todo: list[Sample],
        options: RunOptions,
        *,
        summary: ExtractionSummary,
        log: FailureLog,
        store_path: str,
    ):
        self.specs = specs
        self.pending: deque[Sample] = deque(todo)
        self.summary = summary
        self.log = log
        self.lines = options.line_numbers
        self.store_path = store_path
        self.fail_fast = options.fail_fast
        self.credit = specs[0].concurrency + 2
        self.posts = ParentPosts(
            {spec.server: spec.url for spec in specs}, slots=options.concurrency,
            timeout=float(specs[0].client_options.get("request_timeout", _REQUEST_TIMEOUT_S)),
        )  # fmt: skip
        self.context = multiprocessing.get_context("spawn")
        self.workers: list[_Worker] = []
        self.tally = Tally(summary, options.progress)
        self.lost: dict[int, str] = {}  # servers whose workers could not open
        self.stopping = False  # no more samples are given out (a stop, or fail-fast)
        self.cancelled = False  # a stop: the workers cancel their runs, no more requests are sent
        self._ready = False
        self._probed: set[int] = set()  # servers whose probing worker opened: samples may go

    def run(self) -> None:
        self.workers = [self._spawn(spec) for spec in self.specs]
        try:
            while self._live() and not self._done():
                self._dispatch()
                self._wait_once()
            self._end()
        except BaseException:
            self.summary.interrupted = True
            self._stop()
            raise
        finally:
            try:
                self._reap()
            finally:
                self.posts.close()  # its connections too, whatever the last report raised

    def _spawn(self, spec: WorkerSpec, restarts: int = 0) -> _Worker:
        ours, theirs = self.context.Pipe()
        process = self.context.Process(
            target=worker_main, args=(spec, theirs), name=f"hsdump-{spec.writer_id}"
        )
        process.start()
        theirs.close()
        return _Worker(spec=spec, process=process, conn=ours, restarts=restarts)

    def _live(self) -> list[_Worker]:
        return [w for w in self.workers if not w.exited]

    def _done(self) -> bool:
        return not self.pending and all(w.outstanding <= 0 for w in self._live())

    def _dispatch(self) -> None:
        for worker in self._live():
            if worker.spec.server not in self._probed:
                continue  # a server that does not dump here fails its probe before any sample
            room = self.credit - worker.outstanding
            batch = [self.pending.popleft() for _ in range(min(room, len(self.pending)))]
            if batch:
                worker.given.update((s.id, s) for s in batch)
                worker.conn.send(("samples", batch))

    def _wait_once(self) -> None:
        live = self._live()
        handles = {w.conn: w for w in live} | {w.process.sentinel: w for w in live}
        for ready in multiprocessing.connection.wait([self.posts.wakeup, *handles], timeout=1.0):
            if ready is self.posts.wakeup:
                self._answer()
                continue
            worker = handles[ready]
            if worker.exited:
                continue
            if ready is worker.conn:
                self._receive(worker)
            elif not worker.conn.poll():
                self._died(worker)
        self._report()

    def _receive(self, worker: _Worker) -> None:
        try:
            message = worker.conn.recv()
        except (EOFError, OSError):
            self._died(worker)
            return
        kind = message[0]
        if kind == "post":
            if self.cancelled:
                return  # a stopped worker cancels what waits for an answer: nothing more is sent
            _, rid, sample_id, body = message
            asked = time.perf_counter()
            self.posts.ask(Ask(worker, worker.spec.server, rid, sample_id, body, asked))
        elif kind == "ready":
            if worker.spec.client_options.get("probe", True):
                self._probed.add(worker.spec.server)
            if not self._ready:
                self._ready = True
                self.summary.started = time.monotonic()  # rates exclude the workers' start-up
        elif kind == "fatal":
            self._lost(worker, f"{message[1]}: {message[2]}")
        elif kind in ("progress", "exit"):
            worker.counters = message[1] or worker.counters
            for failure in message[2]:
                self._failed(worker, failure)
        if kind == "exit":
            self._exited(worker)

    def _lost(self, worker: _Worker, reason: str) -> None:
        """A worker could not open: its server is left out while other servers' workers run."""
        self.lost[worker.spec.server] = reason
        if not self._done() and not [w for w in self._live() if w.spec.server not in self.lost]:
            raise WorkerError(f"worker {worker.spec.writer_id}: {reason}")
        logger.warning("leaving %s out of this run: %s", worker.spec.url, reason)

    def _answer(self) -> None:
        """Each answer in goes to the worker that asked; if it is gone or stopped, nobody reads
        the dump, which is removed here."""
        for ask, outcome in self.posts.answers():
            if ask.owner.exited or self.cancelled:
                if isinstance(outcome, ServerAnswer):
                    remove_dump(request_dir(_dump_root(ask.owner.spec), ask.rid))
                continue
            if isinstance(outcome, HsdumpError):
                payload: Any = (type(outcome).__name__, outcome.message)
            else:
                payload = outcome
            with contextlib.suppress(OSError):
                ask.owner.conn.send(("answer", ask.rid, payload))

    def _failed(self, worker: _Worker, failure: Failure) -> None:
        if failure.sample_id is not None:
            worker.failed.add(failure.sample_id)
            failure = replace(failure, line=self.lines.get(failure.sample_id))
        self.summary.failures.append(failure)
        self.log.record(failure)
        if self.fail_fast:
            self.pending.clear()
            self.stopping = True

    def _exited(self, worker: _Worker) -> None:
        """A worker ended its run: what it did not finish goes back to the queue."""
        worker.conn.close()  # its inbox thread, blocked reading, sees the end and lets it exit
        worker.process.join(STOP_GRACE_S)
        worker.exited = True
        self._requeue(worker, flushed=True)
        self.posts.forget(worker)

    def _died(self, worker: _Worker) -> None:
        worker.process.join(_POLL_S)
        code = worker.process.exitcode
        level = logging.DEBUG if self.stopping else logging.WARNING
        logger.log(level, "worker %s died (exit code %s)", worker.spec.writer_id, code)
        worker.exited = True
        self._requeue(worker)
        self.posts.forget(worker)
        if self.stopping or not self.pending or worker.spec.server in self.lost:
            return
        if worker.restarts >= _MAX_RESTARTS:
            if not self._live():
                raise WorkerError(
                    f"worker {worker.spec.writer_id} died {worker.restarts + 1} times (last exit "
                    f"code {code}); committed samples are kept. See the messages above, fix the "
                    "cause and rerun to resume."
                )
            return
        self.workers.append(self._spawn(worker.spec, worker.restarts + 1))

    def _requeue(self, worker: _Worker, *, flushed: bool = False) -> None:
        """Samples given to ``worker`` that its part does not hold go back to the queue."""
        if flushed and worker.outstanding <= 0 and worker.spec.server not in self.lost:
            # It reported every sample and committed before it said exit (a worker that died
            # may not have): no need to read the store.
            committed = set(worker.given) - worker.failed
        else:
            committed = committed_ids(self.store_path)
        left = [
            s
            for sid, s in worker.given.items()
            if sid not in committed and sid not in worker.failed
        ]
        done = [s for sid, s in worker.given.items() if sid in committed]
        counters = worker.counters
        per_token = counters.get("bytes_raw", 0) / max(counters.get("tokens_done", 0), 1)
        self.tally.commit(done, per_token)
        self.tally.fold(
            counters, ("bytes_stored", "store_bytes_raw", "retries", "skipped", "cpu_s")
        )
        if not self.stopping:
            self.pending.extendleft(reversed(left))
        worker.given, worker.counters = {}, {}

    def _end(self) -> None:
        for worker in self._live():
            with contextlib.suppress(OSError):
                worker.conn.send(("end",))
        self._drain()

    def _stop(self) -> None:
        self.stopping = self.cancelled = True
        self.pending.clear()
        for worker in self._live():
            self.posts.forget(worker)  # requests not posted yet are not sent
            with contextlib.suppress(OSError):
                worker.conn.send(("stop",))
        self._drain()

    def _drain(self) -> None:
        """Wait for the workers to end, then for the requests still at a server (their dumps are
        removed as their answers come in)."""
        deadline = time.monotonic() + STOP_GRACE_S
        while self._live() and time.monotonic() < deadline:
            self._wait_once()
        while self.posts.posted and time.monotonic() < deadline:
            if multiprocessing.connection.wait([self.posts.wakeup], timeout=1.0):
                self._answer()

    def _reap(self) -> None:
        for worker in self.workers:
            if worker.process.is_alive():
                worker.process.terminate()
                worker.process.join(10)
            if worker.process.is_alive():
                worker.process.kill()
                worker.process.join()
            worker.conn.close()
        self._report(force=True)

    def _report(self, *, force: bool = False) -> None:
        self.tally.report([w.counters for w in self.workers if not w.exited], force=force)


def run_parallel_extraction(
    samples: Sequence[Sample],
    *,
    url: str | None = None,
    dump_dir: str | os.PathLike[str] | None = None,
    store: str | os.PathLike[str],
    workers: int,
    writer_id: str | None = None,
    servers: Sequence[tuple[str, str | os.PathLike[str] | None]] = (),
    options: RunOptions | None = None,
    client_options: Mapping[str, Any] | None = None,
    store_options: Mapping[str, Any] | None = None,
) -> ExtractionSummary:
    """Extract every sample ``store`` does not hold yet, in ``workers`` processes.

    Each worker opens its own `HiddenStateClient` on ``url`` and ``dump_dir`` (with
    ``client_options``) and writes its own part ``w<i>`` of the store at ``store`` (opened with
    ``store_options``); all of them together keep at most ``options.concurrency`` requests at
    the server. A rerun, with any number of workers, resumes.

    Args:
        samples: The samples.
        url: The server's base URL.
        dump_dir: The server's dump root.
        store: The store's path.
        workers: Worker processes (at least 1).
        writer_id: Prefix of the workers' store parts (``<writer_id>-w<i>``; default ``w<i>``),
            so that runs on several nodes write distinct parts of one store.
        servers: Several servers as ``(url, dump_dir)`` pairs, instead of ``url`` and
            ``dump_dir``: each gets ``workers`` workers and its own bound of ``concurrency``,
            and samples go to whichever worker has room, so a slow server takes fewer. A server
            whose workers cannot open is left out (with a warning) while others run.
        options: Concurrency (requests at each server, over its workers), retries, the failures
            file, progress (at most every 0.1 s); `RunOptions`' defaults when None.
        client_options: Further `HiddenStateClient` arguments (timeouts...).
        store_options: Further `open_store` arguments (``shard_tokens``...).

    Returns:
        The summary over all workers; ``progress`` has seen it last with the final counts.

    Raises:
        WorkerError: A worker could not open its client or store, or kept dying.
        KeyboardInterrupt: Ctrl-C or SIGTERM, once every worker has committed and exited.
    """
    options = options or RunOptions()
    if workers < 1:
        raise ConfigError(f"workers must be >= 1, got {workers}")
    if url is None and not servers:
        raise ConfigError("name the server: url (and dump_dir), or servers")
    summary = ExtractionSummary(failures=list(options.prior_failures), workers=workers)
    todo = plan_samples(samples, str(store), summary, options.line_numbers)
    planned = summary.failures[len(options.prior_failures) :]
    per_worker = -(-options.concurrency // workers) + 1
    targets = list(servers) or [(str(url), dump_dir)]
    count = min(workers, max(len(todo), 1))
    specs = [
        WorkerSpec(
            index=j * count + i, url=target, dump_dir=None if root is None else str(root),
            store=str(store), concurrency=per_worker, retries=options.retries,
            fail_fast=options.fail_fast, part=writer_id, server=j,
            client_options=_worker_client_options(client_options or {}, workers, first=i == 0),
            store_options=dict(store_options or {}),
            parent_pid=os.getpid(), cores=max(1, cores() // (count * len(targets))),
        )
        for j, (target, root) in enumerate(targets)
        for i in range(count)
    ]  # fmt: skip
    summary.workers = len(specs)
    with options.failure_log() as log, sigterm_as_interrupt():
        for failure in planned:
            log.record(failure)
        if todo and not (options.fail_fast and summary.failures):
            runner = _Parallel(
                specs, todo, options, summary=summary, log=log, store_path=str(store)
            )
            try:
                runner.run()
            finally:
                summary.finished = time.monotonic()
            summary.interrupted = summary.interrupted or bool(runner.pending)
    summary.finished = time.monotonic()
    return summary


def committed_ids(store: str) -> set[str]:
    """The ids committed in ``store`` (none if there is no store yet)."""
    from hsdump._store.store import open_store

    try:
        with open_store(store, "r") as opened:
            return opened.committed_ids()
    except HsdumpError:
        return set()


def _dump_root(spec: WorkerSpec) -> Path:
    """The dump root a worker's client reads (as `HiddenStateClient` resolves it)."""
    return Path(spec.dump_dir) if spec.dump_dir is not None else Path(setting("dump_dir"))


def _worker_client_options(
    options: Mapping[str, Any], workers: int, *, first: bool
) -> dict[str, Any]:
    """A worker's client options: its share of an explicit dump budget, so their sum stays the
    bound; and only a server's first worker probes it (the others share its dump root, and get
    samples once it has opened)."""
    shared = dict(options)
    if shared.get("dump_budget_bytes"):
        shared["dump_budget_bytes"] = max(1, shared["dump_budget_bytes"] // workers)
    if not first:
        shared["probe"] = False
    return shared
