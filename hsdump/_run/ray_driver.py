"""Extraction over a Ray cluster: one actor per server, on that server's node, into one store.

A server's dump root is local to its node, so the process that reads its dumps must run there.
`run_ray_extraction` starts one `ExtractionActor` per server,
pinned to the server's node with ``NodeAffinitySchedulingStrategy(node_id, soft=False)``: a node
named in the servers list by its Ray node id, its ``hsdump-node:<name>`` custom resource, its
hostname or its IP address (resolved to one node id at the start; no ``node``: this process's
node). A hard affinity rather than a custom-resource request, so that any node of an existing
cluster works with no resources declared at ``ray start``.

This process (the driver) keeps the queue: it hands batches of samples to the actors that have
room (two batches out per actor), so a slow server takes fewer. A batch is committed when its
result arrives (the actor flushes the store before it answers).

Failures: Ray does not restart actors here (``max_restarts=0``); the driver does, so that each
incarnation writes a part of its own (``<writer_id>-s<server>-a<n>``) and a lingering dead one
never shares a part lock with its successor. When an actor or its node dies, the driver waits
until the dead actor's part lock is free (the OS frees it with the process: nothing more can be
committed there), reads the store, and puts the samples of its batches that are not committed
back at the front of the queue; the actor is started again on its node (a few times at most),
and a server whose node is gone is left out. The store is the one truth of what is committed,
as in `hsdump._run.parallel`, so each sample is committed once, also over reruns.

docs/multinode.md has the recipe: SGLang on N nodes, ``ray start``, the servers file.
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import time
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from hsdump._exceptions import ConfigError, WorkerError
from hsdump._run.common import (
    ExtractionSummary,
    Failure,
    FailureLog,
    RunOptions,
    Tally,
    plan_samples,
    sigterm_as_interrupt,
)
from hsdump._run.parallel import committed_ids
from hsdump._run.ray_actor import ActorSpec, BatchResult, ExtractionActor
from hsdump._run.ray_cluster import ServerEntry, connected, require_ray, resolve_nodes
from hsdump._run.worker import STOP_GRACE_S
from hsdump._store.locks import part_released
from hsdump._types import Sample

__all__ = ["run_ray_extraction"]

logger = logging.getLogger(__name__)

_MAX_RESTARTS = 3
_CREDIT = 2  # batches out per actor: the next one is queued there while one finishes


@dataclass(eq=False)
class _Actor:
    server: int
    node: str
    handle: Any
    attempt: int
    restarts: int = 0
    writer_id: str | None = None  # its part, once open
    out: dict[Any, list[Sample]] = field(default_factory=dict)  # batches out, by call ref
    totals: dict[str, Any] = field(default_factory=dict)
    dead: bool = False


@dataclass(frozen=True)
class _Batches:
    """How the driver hands out work: the most tokens per batch, and how long a dead actor's
    part lock may take to be released."""

    tokens: int
    writer_grace_s: float


class _RayRun:
    def __init__(
        self,
        ray: Any,
        specs: list[ActorSpec],
        nodes: list[str],
        todo: list[Sample],
        options: RunOptions,
        *,
        summary: ExtractionSummary,
        log: FailureLog,
        store: str,
        batches: _Batches,
    ):
        self.ray, self.specs, self.nodes = ray, specs, nodes
        self.remote = ray.remote(max_restarts=0, num_cpus=1)(ExtractionActor)
        self.pending: deque[Sample] = deque(todo)
        self.summary = summary
        self.log = log
        self.lines = options.line_numbers
        self.store = store
        self.fail_fast = options.fail_fast
        # Smaller batches for a small dataset, so that every actor gets a share of it.
        share = -(-self.summary.tokens_total // (len(specs) * _CREDIT * 4))
        self.batch_tokens: int = max(1, min(batches.tokens, share))
        self.grace_s: float = batches.writer_grace_s
        self.calls: dict[Any, tuple[_Actor, str]] = {}
        self.actors: list[_Actor] = []
        self.tally = Tally(summary, options.progress)
        self.lost: dict[int, str] = {}
        self.held_back: list[Sample] = []  # leases of an actor that may still be writing
        self.gone: list[str] = []  # the parts of dead actors, tidied at the end
        self.stopping = False
        self._ready = False
        self.token = secrets.token_hex(3)

    def run(self) -> None:
        try:
            for server in range(len(self.specs)):
                self._start(server, attempt=0, restarts=0)
            while not self._done():
                self._dispatch()
                self._wait_once()
            self._close_all()
        except BaseException:
            self.summary.interrupted = True
            self._stop()
            raise
        finally:
            self._kill_all()
            self._report(force=True)

    # -- actors --------------------------------------------------------------------------------

    def _start(self, server: int, *, attempt: int, restarts: int) -> None:
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        node = self.nodes[server]
        strategy = NodeAffinitySchedulingStrategy(node_id=node, soft=False)
        spec = replace(self.specs[server], attempt=attempt)
        # Named so that its log lines and `ray.get_actor` find it; the run's token keeps a name
        # free while Ray is still retiring the actor of the run before.
        name = f"hsdump-{spec.part}-{attempt}-{self.token}"
        handle = self.remote.options(name=name, scheduling_strategy=strategy).remote(spec)
        actor = _Actor(server, node, handle, attempt, restarts)
        self.actors.append(actor)
        self.calls[handle.open.remote()] = (actor, "open")

    def _live(self) -> list[_Actor]:
        return [a for a in self.actors if not a.dead]

    def _done(self) -> bool:
        return not self.pending and all(not a.out for a in self._live())

    def _dispatch(self) -> None:
        for actor in self._live():
            while actor.writer_id is not None and len(actor.out) < _CREDIT and self.pending:
                batch = self._next_batch()
                ref = actor.handle.extract.remote(batch)
                actor.out[ref] = batch
                self.calls[ref] = (actor, "extract")

    def _next_batch(self) -> list[Sample]:
        batch = [self.pending.popleft()]
        tokens = len(batch[0].input_ids)
        while self.pending and tokens + len(self.pending[0].input_ids) <= self.batch_tokens:
            tokens += len(self.pending[0].input_ids)
            batch.append(self.pending.popleft())
        return batch

    def _wait_once(self) -> None:
        if not self.calls:  # no actor is opening or extracting: none is left to take the rest
            raise WorkerError(
                f"no extraction actor is left for the {len(self.pending)} samples not extracted; "
                "committed samples are kept: rerun to resume"
            )
        ready, _ = self.ray.wait(list(self.calls), num_returns=1, timeout=1.0)
        for ref in ready:
            self._settle(ref)
        self._report()

    def _settle(self, ref: Any) -> None:
        entry = self.calls.pop(ref, None)
        if entry is None:
            return  # a call of an actor already handled as dead
        actor, kind = entry
        try:
            result: BatchResult = self.ray.get(ref)
        except self.ray.exceptions.RayError as exc:
            self._died(actor, _reason(exc), restart=True)
            return
        actor.totals = result.totals or actor.totals
        self._relay(actor, result)
        if result.error is not None:
            self._died(actor, f"{result.error}: {result.message}", restart=False)
        elif kind == "open":
            actor.writer_id = result.writer_id
            url = self.specs[actor.server].url
            logger.info(
                "the actor of %s runs on node %s: part %s", url, result.node_id, actor.writer_id
            )
            if not self._ready:
                self._ready = True
                self.summary.started = time.monotonic()  # rates exclude the actors' start-up
        else:
            del actor.out[ref]  # committed
            self._add(result)

    def _relay(self, actor: _Actor, result: BatchResult) -> None:
        """Log the actor's own hsdump lines here, naming its part (or its server)."""
        for level, line in result.logs:
            logger.log(level, "%s: %s", actor.writer_id or self.specs[actor.server].url, line)

    def _add(self, result: BatchResult) -> None:
        for name in Tally.ADDITIVE:
            self.tally.closed[name] += getattr(result, name)
        for failure in result.failures:
            self._failed(failure)

    def _failed(self, failure: Failure) -> None:
        if failure.sample_id is not None:
            failure = replace(failure, line=self.lines.get(failure.sample_id))
        self.summary.failures.append(failure)
        self.log.record(failure)
        if self.fail_fast:
            self.pending.clear()
            self.stopping = True

    # -- failures ------------------------------------------------------------------------------

    def _died(self, actor: _Actor, reason: str, *, restart: bool) -> None:
        """An actor is gone (or refused to go on): redo what it did not commit, then replace it."""
        if actor.dead:
            return
        actor.dead = True
        with contextlib.suppress(Exception):
            self.ray.kill(actor.handle, no_restart=True)
        if actor.writer_id is not None:
            self.gone.append(actor.writer_id)
        url = self.specs[actor.server].url
        level = logging.DEBUG if self.stopping else logging.WARNING
        part = f" (part {actor.writer_id})" if actor.writer_id else " (before it opened its part)"
        logger.log(level, "the actor of %s%s ended: %s", url, part, reason)
        leased = [s for batch in actor.out.values() for s in batch]
        for ref in actor.out:
            self.calls.pop(ref, None)
        actor.out = {}
        self.tally.fold(actor.totals)
        if leased:
            self._resolve(actor, leased)
        if self.stopping:
            return
        if restart and actor.restarts < _MAX_RESTARTS and self._node_alive(actor.node):
            self._start(actor.server, attempt=actor.attempt + 1, restarts=actor.restarts + 1)
        else:
            self._lose(actor.server, reason)

    def _resolve(self, actor: _Actor, leased: list[Sample]) -> None:
        """Count what the dead actor committed; the rest goes back to the queue."""
        if actor.writer_id and not part_released(self.store, actor.writer_id, self.grace_s):
            logger.warning(
                "part %s of %s is still locked %.0f s after its actor died: %d samples are left "
                "for a rerun, so that none is committed twice",
                actor.writer_id, self.store, self.grace_s, len(leased),
            )  # fmt: skip
            self.held_back.extend(leased)
            return
        committed = committed_ids(self.store)
        done = [s for s in leased if s.id in committed]
        closed = self.tally.closed
        self.tally.commit(done, closed["bytes_raw"] / max(closed["tokens_done"], 1))
        if not self.stopping:
            self.pending.extendleft(reversed([s for s in leased if s.id not in committed]))

    def _node_alive(self, node: str) -> bool:
        return any(n["NodeID"] == node and n["Alive"] for n in self.ray.nodes())

    def _lose(self, server: int, reason: str) -> None:
        """A server is left out; the run ends when none is left."""
        self.lost[server] = reason
        url = self.specs[server].url
        if self._live():
            logger.warning("leaving %s out of this run: %s", url, reason)
            return
        reasons = "; ".join(f"{self.specs[j].url}: {why}" for j, why in self.lost.items())
        raise WorkerError(
            f"every extraction actor is dead ({reasons}); committed samples are kept: fix the "
            "cause and rerun to resume"
        )

    # -- the end -------------------------------------------------------------------------------

    def _close_all(self) -> None:
        """Close every open actor: it flushes its part and closes its client."""
        closing = {a.handle.close.remote(): a for a in self._live() if a.writer_id is not None}
        for ref in self._wait_all(list(closing)):
            actor = closing[ref]
            try:
                result: BatchResult = self.ray.get(ref)
            except self.ray.exceptions.RayError as exc:
                logger.warning("the actor of part %s did not close: %s", actor.writer_id, exc)
                result = BatchResult()
            actor.totals = result.totals or actor.totals
            self._relay(actor, result)
            if result.error is not None:
                logger.warning("part %s: %s: %s", actor.writer_id, result.error, result.message)
        for actor in self._live():
            actor.dead = True
            self.tally.fold(actor.totals)

    def _wait_all(self, refs: list[Any]) -> list[Any]:
        """The calls of ``refs`` that end within the stop grace."""
        if not refs:
            return []
        ready, _ = self.ray.wait(refs, num_returns=len(refs), timeout=STOP_GRACE_S)
        return list(ready)

    def _stop(self) -> None:
        """Interrupted: the actors finish the samples in flight and commit, then close."""
        self.stopping = True
        self.pending.clear()
        for actor in self._live():
            if actor.writer_id is not None:
                with contextlib.suppress(Exception):  # a dead actor: its batches fail below
                    actor.handle.stop.remote()
        out = [ref for ref, (_, kind) in self.calls.items() if kind == "extract"]
        for ref in self._wait_all(out):
            self._settle(ref)
        self._close_all()

    def _kill_all(self) -> None:
        for actor in self.actors:
            with contextlib.suppress(Exception):
                self.ray.kill(actor.handle, no_restart=True)

    # -- counters ------------------------------------------------------------------------------

    def _report(self, *, force: bool = False) -> None:
        self.tally.report([a.totals for a in self._live()], force=force)


def _reason(exc: BaseException) -> str:
    """One line for a Ray error: what the actor raised, or what Ray says, without a traceback."""
    cause = getattr(exc, "cause", None)  # a RayTaskError's original exception
    shown = cause if isinstance(cause, BaseException) else exc
    text = str(shown).strip().splitlines()
    return f"{type(shown).__name__}: {text[0] if text else ''}"


def _absolute(store: str | os.PathLike[str]) -> str:
    """A local store's absolute path: the actors do not run in this process's directory."""
    text = os.fspath(store)
    return text if "://" in text else str(Path(text).absolute())


def run_ray_extraction(
    samples: Sequence[Sample],
    *,
    servers: Sequence[ServerEntry],
    store: str | os.PathLike[str],
    address: str | None = None,
    writer_id: str | None = None,
    batch_tokens: int = 32768,
    writer_grace_s: float = 120.0,
    options: RunOptions | None = None,
    client_options: Mapping[str, Any] | None = None,
    store_options: Mapping[str, Any] | None = None,
) -> ExtractionSummary:
    """Extract every sample ``store`` does not hold yet on a Ray cluster, one actor per server.

    Each server's actor runs on the server's node (its dump root is local there), opens its own
    `HiddenStateClient` and writes its own part of the store, which every node
    must see at the same path (a shared file system, or object storage). This process keeps the
    queue and hands batches to the actors with room. A dead actor or node loses nothing: its
    uncommitted samples go to the others and the actor is started again where its node lives.
    A rerun resumes; each sample is committed once.

    Args:
        samples: The samples.
        servers: ``(url, dump_dir, node)`` per server. ``node`` names the server's Ray node by
            node id, ``hsdump-node:<node>`` custom resource, hostname or IP address; None: the
            node of this process.
        store: The store's path.
        address: The Ray cluster (``ray.init``'s address: ``"auto"``, ``"HOST:6379"``); None:
            ``RAY_ADDRESS``, else the cluster running on this node, else a new local one.
            Ignored when Ray is already initialised in this process.
        writer_id: Prefix of the actors' parts (``<writer_id>-s<server>-a<n>``; default
            ``ray``), so that several runs into one store write distinct parts.
        batch_tokens: The most tokens per batch handed to an actor (at least one sample;
            fewer when the dataset is small, so that every actor gets a share); each batch
            ends with a commit.
        writer_grace_s: How long to wait for a dead actor's part lock to be released before its
            uncommitted samples are redone (after that they are left for a rerun).
        options: Concurrency (requests at each server at once), retries, the failures file,
            progress (at most every 0.1 s); `RunOptions`' defaults when None.
        client_options: Further `HiddenStateClient` arguments (timeouts...).
        store_options: Further `open_store` arguments (``shard_tokens``...).

    Returns:
        The summary over all actors; ``progress`` has seen it last with the final counts.

    Raises:
        ConfigError: Ray is not installed, the cluster cannot be joined, or a server's node is
            not in it.
        WorkerError: Every actor died or could not open its client or store.
        KeyboardInterrupt: Ctrl-C or SIGTERM, once the actors have committed what they wrote.
    """
    options = options or RunOptions()
    if batch_tokens < 1 or not servers:
        raise ConfigError(
            f"servers must be non-empty and batch_tokens >= 1, got {len(servers)} servers, "
            f"{batch_tokens}"
        )
    ray = require_ray()
    summary = ExtractionSummary(failures=list(options.prior_failures), workers=len(servers))
    path = _absolute(store)
    todo = plan_samples(samples, path, summary, options.line_numbers)
    planned = summary.failures[len(options.prior_failures) :]
    specs = [
        ActorSpec(
            server=j, url=url, dump_dir=None if root is None else os.fspath(root), store=path,
            part=f"{writer_id or 'ray'}-s{j}", attempt=0, concurrency=options.concurrency,
            retries=options.retries, fail_fast=options.fail_fast,
            client_options=dict(client_options or {}), store_options=dict(store_options or {}),
        )
        for j, (url, root, _) in enumerate(servers)
    ]  # fmt: skip
    gone: list[str] = []
    with options.failure_log() as log, sigterm_as_interrupt():
        for failure in planned:
            log.record(failure)
        if todo and not (options.fail_fast and summary.failures):
            with connected(ray, address):
                nodes = resolve_nodes(ray, servers)
                runner = _RayRun(
                    ray,
                    specs,
                    nodes,
                    todo,
                    options,
                    summary=summary,
                    log=log,
                    store=path,
                    batches=_Batches(batch_tokens, writer_grace_s),
                )
                try:
                    runner.run()
                except ray.exceptions.RayError as exc:
                    raise WorkerError(f"the Ray cluster failed: {_reason(exc)}") from exc
                finally:
                    summary.finished = time.monotonic()
            left = runner.pending or runner.held_back
            summary.interrupted = summary.interrupted or bool(left)
            gone = runner.gone
    summary.finished = time.monotonic()
    from hsdump._store.store import tidy_store

    # What dead actors wrote past their last commit: no later run opens their parts again.
    tidy_store(path, gone=gone, storage_options=(store_options or {}).get("storage_options"))
    return summary
