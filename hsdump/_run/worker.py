"""The worker process of a multi-process extraction (see `hsdump._run.parallel`).

A worker opens its own `HiddenStateClient` and its own store part, and runs
`run_extraction` on the samples the parent sends over a pipe. The
same pipe carries its requests to the server (posted by the parent, which sends back each
answer: `hsdump._run.posting`), its progress, and its end.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import logging
import math
import multiprocessing
import os
import signal
import sys
from dataclasses import dataclass
from typing import Any

import anyio
import anyio.to_thread
from anyio.abc import TaskGroup

from hsdump._client.sending import ServerAnswer
from hsdump._cores import EXTRACTION_SWITCH_INTERVAL_S
from hsdump._exceptions import HsdumpError, ServerTimeout, ServerUnavailable
from hsdump._run.common import ExtractionSummary, ExtractorSpec
from hsdump._run.pipeline import run_extraction
from hsdump._types import Sample

__all__ = ["COUNTERS", "STOP_GRACE_S", "WorkerSpec", "worker_main"]

logger = logging.getLogger(__name__)

STOP_GRACE_S = 120.0
COUNTERS = ("samples_done", "tokens_done", "bytes_raw", "bytes_stored", "store_bytes_raw")


class _OpenGate:
    """No local bound: the parent posts the requests and holds the run's bound on them."""

    async def __aenter__(self) -> None:
        return None

    async def __aexit__(self, *exc_info: object) -> None:
        return None


class _ParentSender:
    """A `RequestSender` that hands each request to the parent, which posts it (see
    `hsdump._run.posting`) and sends back the server's answer or why there was none.

    A request whose caller is cancelled is still posted (its answer is dropped here); its dump is
    removed by the client as any abandoned request's is.
    """

    def __init__(self, conn: Any):
        self._conn = conn
        self._waiting: dict[str, tuple[anyio.Event, list[Any]]] = {}

    async def post(self, body: dict[str, Any], *, sample_id: str | None, rid: str) -> ServerAnswer:
        """Send ``body`` to /generate through the parent."""
        event, box = anyio.Event(), list[Any]()
        self._waiting[rid] = (event, box)
        try:
            self._conn.send(("post", rid, sample_id, body))
            await event.wait()
        finally:
            self._waiting.pop(rid, None)
        outcome = box[0]
        if isinstance(outcome, ServerAnswer):
            return outcome
        name, message = outcome
        cls = ServerTimeout if name == "ServerTimeout" else ServerUnavailable
        raise cls(message, sample_id=sample_id, rid=rid)

    def answered(self, rid: str, outcome: Any) -> None:
        """The parent's answer to ``rid``: a `ServerAnswer`, or an error's (class name, message)."""
        waiting = self._waiting.get(rid)
        if waiting is not None:
            waiting[1].append(outcome)
            waiting[0].set()


@dataclass(frozen=True, kw_only=True)
class WorkerSpec(ExtractorSpec):
    """What one worker process needs to open its client and its store part."""

    index: int
    part: str | None = None
    server: int = 0  # which of the run's servers (each has its own bound on requests in flight)
    parent_pid: int = 0
    cores: int = 0  # this worker's share of the host's cores (0: all of them)

    @property
    def writer_id(self) -> str:
        """The worker's store part: the same on every rerun, so a rerun resumes it."""
        return f"{self.part}-w{self.index}" if self.part else f"w{self.index}"


# -- the worker process ------------------------------------------------------------------------


def worker_main(spec: WorkerSpec, conn: Any) -> None:
    """A worker process: extract what the parent sends until it says end (or stop)."""
    _die_with_parent(spec.parent_pid)
    _locks_leave_nothing_in_shm()
    # This process is hsdump's own: its placement threads wait up to one switch interval for the
    # interpreter lock after each numpy call (docs/changelog.md, "Experiment modes retired").
    sys.setswitchinterval(EXTRACTION_SWITCH_INTERVAL_S)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent coordinates a stop
    try:
        anyio.run(_worker, spec, conn)
    finally:
        conn.close()
    # Its store part is committed and closed and the parent has its counters: skip the
    # interpreter's teardown (torch's took 1-1.5 s a worker on 2 cores, and the run's exit waited).
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _locks_leave_nothing_in_shm() -> None:
    """Locks made in this process by default (numcodecs' Blosc lock, made at the first encode)
    are of the ``fork`` kind, whose semaphore is unlinked from /dev/shm as soon as it is made.

    A process started by ``spawn`` makes ``spawn`` its default, and a ``spawn`` lock's semaphore
    stays in /dev/shm until multiprocessing's resource tracker removes it at exit: a SIGKILL of
    the whole run kills the tracker too, and one semaphore per worker stayed behind. A worker
    starts no processes of its own, so the default is only the kind of its locks.
    """
    multiprocessing.set_start_method("fork", force=True)


def _die_with_parent(parent_pid: int) -> None:
    """Ask Linux to send SIGTERM when the parent dies, so no worker outlives a killed run."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    if parent_pid and os.getppid() != parent_pid:
        os.kill(os.getpid(), signal.SIGTERM)  # the parent died before prctl took effect


async def _worker(spec: WorkerSpec, conn: Any) -> None:
    """The inbox runs from the start: opening the client already asks the gate (its probe)."""
    reporter = _Reporter(conn)
    async with anyio.create_task_group() as group:
        inbox = _Inbox(conn, _ParentSender(conn), group)
        group.start_soon(inbox.run)
        group.start_soon(inbox.stop_on_sigterm)
        try:
            await _extract(spec, inbox, reporter)
        except HsdumpError as exc:
            conn.send(("fatal", type(exc).__name__, str(exc)))
        finally:
            reporter.final()
            group.cancel_scope.cancel()


async def _extract(spec: WorkerSpec, inbox: _Inbox, reporter: _Reporter) -> None:
    from hsdump._client.client import HiddenStateClient
    from hsdump._store.options import StoreOptions
    from hsdump._store.store import open_store

    share = spec.cores or None  # this worker's share of the host's cores
    client = HiddenStateClient(
        spec.url,
        dump_dir=spec.dump_dir,
        max_in_flight=spec.concurrency,
        gate=_OpenGate(),
        sender=inbox.sender,
        cores=share,
        **spec.client_options,
    )
    store_options = dict(spec.store_options)
    given = store_options.pop("options", None) or StoreOptions()
    options = dataclasses.replace(given, cores=given.cores or share)
    async with client:
        with open_store(
            spec.store, "a", writer_id=spec.writer_id, options=options, **store_options
        ) as store:
            inbox.conn.send(("ready",))
            run = dataclasses.replace(spec.run_options(), progress=reporter)
            with inbox.stopped:
                await run_extraction(inbox.receive, client=client, store=store, options=run)


class _Inbox:
    """Messages from the parent: samples into the run's stream, answers to the sender.

    ``end`` closes the stream. ``stop`` (or SIGTERM, or the parent's death) cancels the run at
    once, as Ctrl-C does in one process: the store writes under way finish and everything written
    is committed, the samples not written are dropped (their dumps removed by the client), and no
    further request is sent. A stop while the client opens ends the worker after ``STOP_GRACE_S``
    at most.
    """

    def __init__(self, conn: Any, sender: _ParentSender, group: TaskGroup):
        self.conn, self.sender, self.group = conn, sender, group
        self.send, self.receive = anyio.create_memory_object_stream[Sample](math.inf)
        self.stopped = anyio.CancelScope()  # the run's scope (cancelled before it starts, too)

    async def run(self) -> None:
        while True:
            try:
                message = await anyio.to_thread.run_sync(self.conn.recv, abandon_on_cancel=True)
            except EOFError:
                message = ("stop",)  # the parent is gone
            if message[0] == "answer":
                self.sender.answered(message[1], message[2])
            elif message[0] == "samples":
                for sample in message[1]:
                    with contextlib.suppress(anyio.ClosedResourceError):
                        self.send.send_nowait(sample)
            elif message[0] == "end":
                self.send.close()
            else:
                self.stop()
                if message[0] != "stop":
                    return

    def stop(self) -> None:
        self.stopped.cancel()
        self.send.close()
        self.group.start_soon(self._cancel_later)

    async def _cancel_later(self) -> None:
        await anyio.sleep(STOP_GRACE_S)
        self.group.cancel_scope.cancel()

    async def stop_on_sigterm(self) -> None:
        with anyio.open_signal_receiver(signal.SIGTERM) as signals:
            async for _ in signals:
                self.stop()
                return


class _Reporter:
    """The worker's progress callback: sends its counters, and each new failure, to the parent."""

    def __init__(self, conn: Any):
        self._conn = conn
        self._summary: ExtractionSummary | None = None
        self._failures_sent = 0

    def __call__(self, summary: ExtractionSummary) -> None:
        self._summary = summary
        self._send("progress")

    def final(self) -> None:
        self._send("exit")

    def _send(self, kind: str) -> None:
        s = self._summary
        if s is None:
            self._conn.send((kind, {}, []))
            return
        new = s.failures[self._failures_sent :]
        self._failures_sent = len(s.failures)
        counters = {name: getattr(s, name) for name in COUNTERS}
        counters.update(
            written=s.samples_written, skipped=s.skipped, retries=s.retries,
            failed=len(s.failures), stages=dict(s.stages), cpu_s=s.cpu_s,
            peak_rss_bytes=s.peak_rss_bytes,
        )  # fmt: skip
        with contextlib.suppress(OSError):
            self._conn.send((kind, counters, new))
