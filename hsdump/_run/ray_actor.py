"""The extraction actor of a Ray run (see `hsdump._run.ray_driver`): one per server, on
its node.

This module imports no Ray: `hsdump._run.ray_driver` wraps `ExtractionActor` with
``ray.remote`` when a run starts. An actor opens its own `HiddenStateClient` on
its server and dump root and its own part of the store, then extracts the batches the driver
hands it. Each batch is one `run_extraction`, which flushes the store before it
returns: a batch whose result reached the driver is committed, so after a death only the batches
still out need a look at the store.
"""

from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import anyio
from anyio.streams.memory import MemoryObjectReceiveStream

from hsdump._exceptions import HsdumpError, StoreError, StoreIOError
from hsdump._run.common import (
    ExtractionSummary,
    ExtractorSpec,
    Failure,
    peak_rss_bytes,
)
from hsdump._run.pipeline import run_extraction
from hsdump._store.objstore import is_url
from hsdump._types import Sample

if TYPE_CHECKING:
    from hsdump._client.client import ClientStats, HiddenStateClient

__all__ = ["ActorSpec", "BatchResult", "ExtractionActor"]

_PART_TRIES = 16  # parts to try past one still locked by an earlier incarnation that lingers


@dataclass(frozen=True)
class _Start:
    """The counters when the actor opened: its totals are counted from here."""

    cpu_s: float
    stored: tuple[int, int]
    client: ClientStats


@dataclass(frozen=True, kw_only=True)
class ActorSpec(ExtractorSpec):
    """What one actor needs: its server, the store, and the first part name to try."""

    server: int
    part: str  # parts are "<part>-a<n>", n from ``attempt`` on
    attempt: int


@dataclass
class BatchResult:
    """What an actor call reports: additive counts of this call, and the actor's running totals.

    ``error`` is set (an hsdump error's class name, with ``message``) when the actor cannot go
    on: its client or store did not open, or the store refused a write.
    """

    samples_done: int = 0
    tokens_done: int = 0
    bytes_raw: int = 0
    retries: int = 0
    skipped: int = 0
    failures: list[Failure] = field(default_factory=list)
    totals: dict[str, Any] = field(default_factory=dict)
    writer_id: str | None = None
    node_id: str | None = None
    error: str | None = None
    message: str = ""
    logs: list[tuple[int, str]] = field(default_factory=list)  # hsdump's lines: (level, text)

    @classmethod
    def of(cls, summary: ExtractionSummary, totals: dict[str, Any]) -> BatchResult:
        """The counts of one finished batch."""
        return cls(
            samples_done=summary.samples_done, tokens_done=summary.tokens_done,
            bytes_raw=summary.bytes_raw, retries=summary.retries, skipped=summary.skipped,
            failures=list(summary.failures), totals=totals,
        )  # fmt: skip


class _Lines(logging.Handler):
    """hsdump's warnings in the actor, handed back with its next result: the driver does not
    take the Ray workers' output (`hsdump._run.ray_cluster.connected`)."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: list[tuple[int, str]] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append((record.levelno, record.getMessage()))

    def take(self) -> list[tuple[int, str]]:
        lines, self.lines = self.lines, []
        return lines


class ExtractionActor:
    """Extracts batches from one server into one store part (run as a Ray actor).

    Its calls are coroutines on one event loop: two batches may run at once (the driver keeps
    the next one queued), sharing the client, whose ``max_in_flight`` keeps the server's bound.
    """

    def __init__(self, spec: ActorSpec):
        self.spec = spec
        self._stack = contextlib.AsyncExitStack()
        self._client: HiddenStateClient | None = None
        self._store: Any = None
        self._start: _Start | None = None
        self._store_s = {"store_queue": 0.0, "store_write": 0.0}  # the run's, not the client's
        self._feeds: set[MemoryObjectReceiveStream[Sample]] = set()
        self._lines = _Lines()
        logging.getLogger("hsdump").addHandler(self._lines)

    async def open(self) -> BatchResult:
        """Open the client and the first free store part; report the part or why it failed."""
        try:
            await self._open()
        except HsdumpError as exc:
            await self._stack.aclose()
            message = str(exc) + self._s3_note(exc)
            return self._with_lines(BatchResult(error=type(exc).__name__, message=message))
        import ray  # this runs in a Ray worker

        node = ray.get_runtime_context().get_node_id()
        opened = BatchResult(writer_id=self._store.writer_id, node_id=node, totals=self._totals())
        return self._with_lines(opened)

    def _s3_note(self, exc: HsdumpError) -> str:
        """Where an actor's AWS settings come from, when S3 refused it or could not be reached."""
        if not isinstance(exc, StoreIOError) or not is_url(self.spec.store):
            return ""
        import ray  # this runs in a Ray worker

        node = ray.get_runtime_context().get_node_id()
        return (
            f". This actor runs on Ray node {node}: it takes AWS_* from the environment that "
            "`ray start` had on that node, not from the shell that runs `hsdump extract`; "
            "export them there and restart Ray on it (docs/multinode.md)"
        )

    async def _open(self) -> None:
        from hsdump._client.client import HiddenStateClient

        spec = self.spec
        client = HiddenStateClient(
            spec.url, dump_dir=spec.dump_dir, max_in_flight=spec.concurrency,
            **spec.client_options,
        )  # fmt: skip
        self._client = await self._stack.enter_async_context(client)
        self._store = self._stack.enter_context(self._open_part())
        self._start = _Start(
            time.process_time(),
            (self._store.bytes_raw_written, self._store.bytes_stored),
            client.stats.copy(),
        )

    def _open_part(self) -> Any:
        """The part ``<part>-a<n>`` for the first ``n`` whose lock no other process holds."""
        from hsdump._store.store import open_store

        spec = self.spec
        for attempt in range(spec.attempt, spec.attempt + _PART_TRIES):
            writer_id = f"{spec.part}-a{attempt}"
            try:
                return open_store(spec.store, "a", writer_id=writer_id, **spec.store_options)
            except StoreError as exc:
                if not isinstance(exc.__cause__, BlockingIOError):
                    raise  # anything but a part in use by a lingering process
        raise StoreError(
            f"parts {spec.part}-a{spec.attempt} to -a{spec.attempt + _PART_TRIES - 1} of "
            f"{spec.store} are all held by live processes: stop the old runs' actors and rerun"
        )

    async def extract(self, batch: list[Sample]) -> BatchResult:
        """Extract and commit ``batch``; committed when this returns."""
        send, feed = anyio.create_memory_object_stream[Sample](len(batch))
        with send:
            for sample in batch:
                send.send_nowait(sample)
        self._feeds.add(feed)
        try:
            summary = await run_extraction(
                feed, client=self._opened()[0], store=self._store, options=self.spec.run_options()
            )
        except HsdumpError as exc:  # the store refused a write: no later batch would fare better
            refused = BatchResult(error=type(exc).__name__, message=str(exc), totals=self._totals())
            return self._with_lines(refused)
        finally:
            self._feeds.discard(feed)
        for name in self._store_s:
            self._store_s[name] += summary.stages.get(name, 0.0)
        return self._with_lines(BatchResult.of(summary, self._totals()))

    async def stop(self) -> None:
        """Drop the samples not started yet: the batches out finish those in flight and commit.

        No request is cut off, so no dump is left behind in the server's dump root.
        """
        for feed in self._feeds:
            with contextlib.suppress(anyio.WouldBlock, anyio.EndOfStream):
                while True:
                    feed.receive_nowait()

    async def close(self) -> BatchResult:
        """Flush and close the store part and the client; the final totals."""
        try:
            totals = self._totals() if self._store is not None else {}
            await self._stack.aclose()
        except HsdumpError as exc:
            return self._with_lines(BatchResult(error=type(exc).__name__, message=str(exc)))
        return self._with_lines(BatchResult(totals=totals))

    def _with_lines(self, result: BatchResult) -> BatchResult:
        result.logs = self._lines.take()
        return result

    def _opened(self) -> tuple[HiddenStateClient, _Start]:
        if self._client is None or self._start is None:
            raise RuntimeError("ExtractionActor.open() must succeed before any other call")
        return self._client, self._start

    def _totals(self) -> dict[str, Any]:
        """This actor's running totals (absolute, so two batches at once are not counted twice)."""
        client, start = self._opened()
        stages = client.stats.since(start.client).stages()
        stages.update(self._store_s)
        raw, stored = self._store.bytes_raw_written, self._store.bytes_stored
        return {
            "stages": stages,
            "cpu_s": time.process_time() - start.cpu_s,
            "peak_rss_bytes": peak_rss_bytes(),
            "store_bytes_raw": raw - start.stored[0],
            "bytes_stored": stored - start.stored[1],
        }
