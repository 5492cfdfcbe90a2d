"""HiddenStateClient: send a sample to the server, observe its dump, verify it, load it.

A request's dump is found by the request id the client chose, never by order or by a counter. The
response and the dump may arrive in either order; both are checked against the sample before any
tensor is handed out.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import importlib
import json
import logging
import os
import time
import uuid
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import anyio
import httpx

from hsdump._client.budget import ByteBudget, default_budget_bytes
from hsdump._client.janitor import ClientLease, remove_stale
from hsdump._client.limits import InputLimits
from hsdump._client.loading import load_dump
from hsdump._client.sending import HttpSender, RequestSender, ServerAnswer
from hsdump._client.validate import Expected, check_response
from hsdump._client.watcher import DumpWatcher, default_watcher
from hsdump._cores import cores
from hsdump._exceptions import (
    ConfigError,
    DumpTimeout,
    HsdumpError,
    ServerConfigError,
    ServerNotDumping,
    ServerResponseError,
    ServerTimeout,
    ServerUnavailable,
)
from hsdump._protocol import (
    DEFAULT_RID_PREFIX,
    ProducerManifest,
    dtype_itemsize,
    read_manifests,
    remove_dump,
    request_dir,
)
from hsdump._settings import setting
from hsdump._types import Sample

if TYPE_CHECKING:
    from hsdump._types import HiddenStates

__all__ = ["ClientStats", "HiddenStateClient", "extract_unchecked"]

logger = logging.getLogger(__name__)
# What a dump holds beside its tensors: meta.json (token ids as JSON text) and the markers.
_META_BYTES, _META_BYTES_PER_TOKEN = 4096, 16
_MOMENT_BYTES = 8  # moments.bin, a layer of a token: float32 sum and sum of squares
# The probe at open: one token, and a short wait, since a dump normally follows its response.
_PROBE, _PROBE_DUMP_WAIT = Sample(id="hsdump-probe", input_ids=[0]), 5.0
_DECLARED_LAYERS = "return_aux_hidden_state_layer_ids"  # in /server_info, when the server says


class _State(enum.Enum):
    UNOPENED = "unopened"
    OPEN = "open"
    CLOSED = "closed"


@dataclass
class ClientStats:
    """The client's own counters of `HiddenStateClient.extract`, summed over requests.

    Only what the client itself sees: a run's summary (`ExtractionSummary`) reads
    its stage times from here (`since`, `stages`) instead of timing them again, and
    counts what the client cannot see (commits, retries, skipped samples) itself.

    Attributes:
        requests: Completed extractions.
        tokens: Tokens extracted.
        bytes: Hidden-state bytes loaded.
        slot_wait_s: Waiting for a request slot (``max_in_flight`` or the run's gate) before
            sending.
        server_s: Sending the request until the HTTP response.
        dump_wait_s: The response until the dump was visible (0 when the dump came first).
        ingest_queue_s: The dump visible until an ingest thread took it.
        ingest_s: Reading, validating and loading the dump, on that thread.
        failures: Failed attempts by error class name.
    """

    requests: int = 0
    tokens: int = 0
    bytes: int = 0
    slot_wait_s: float = 0.0
    server_s: float = 0.0
    dump_wait_s: float = 0.0
    ingest_queue_s: float = 0.0
    ingest_s: float = 0.0
    failures: dict[str, int] = field(default_factory=dict)

    def copy(self) -> ClientStats:
        """A snapshot that later requests do not change."""
        return dataclasses.replace(self, failures=dict(self.failures))

    def since(self, earlier: ClientStats) -> ClientStats:
        """What was counted after the snapshot ``earlier``."""
        failures = {
            name: count - earlier.failures.get(name, 0)
            for name, count in self.failures.items()
            if count > earlier.failures.get(name, 0)
        }
        return ClientStats(
            requests=self.requests - earlier.requests,
            tokens=self.tokens - earlier.tokens,
            bytes=self.bytes - earlier.bytes,
            slot_wait_s=self.slot_wait_s - earlier.slot_wait_s,
            server_s=self.server_s - earlier.server_s,
            dump_wait_s=self.dump_wait_s - earlier.dump_wait_s,
            ingest_queue_s=self.ingest_queue_s - earlier.ingest_queue_s,
            ingest_s=self.ingest_s - earlier.ingest_s,
            failures=failures,
        )

    def stages(self) -> dict[str, float]:
        """Seconds per stage of a request, and in the queues before them, as a run's summary
        names them."""
        return {
            "slot_wait": self.slot_wait_s,
            "server": self.server_s,
            "dump_wait": self.dump_wait_s,
            "ingest_queue": self.ingest_queue_s,
            "ingest": self.ingest_s,
        }


class HiddenStateClient:
    """Extracts hidden states from a server that dumps them (SGLang with hsdump's plugin, or the
    reference server).

    Example::

        async with HiddenStateClient("http://127.0.0.1:30000", dump_dir="/dev/shm/hs") as client:
            states = await client.extract(Sample(id="s1", input_ids=[1, 2, 3]))

    Args:
        base_url: The server's base URL.
        dump_dir: The dump root the server writes to (default: ``$HSDUMP_DUMP_DIR`` or
            ``/dev/shm/hsdump``).
        max_in_flight: Requests at the server at once (1: one at a time, through a lock).
        request_timeout: Seconds to wait for the HTTP response.
        dump_timeout: Seconds to wait for the dump once the response has arrived.
        watcher: A `DumpWatcher`, or "inotify"/"poll"/"watchfiles" (default:
            ``$HSDUMP_WATCHER``, else inotify on Linux).
        expected_layer_ids: Refuse dumps of other aux layers (default: the producer manifest's).
        dump_budget_bytes: Most bytes of requested-but-not-ingested dumps (default: half of the
            free space of the dump root's filesystem).
        stale_after: Age in seconds after which orphaned dumps of unknown owners are removed.
        http_client: An ``httpx.AsyncClient`` to use instead of a private one (not closed here).
        gate: An async context manager held while a request is at the server, instead of this
            client's own lock or semaphore of ``max_in_flight``, so that several clients (in
            several processes) share one bound.
        probe: At open, send one tiny opted-in request and wait briefly (at most
            ``dump_timeout``, 5 s by default) for its dump, so a server paired with another
            server's dump root is refused at once, not after a dump timeout per sample. False
            skips it (for tests that count requests or queue faults before opening).
        sender: A `RequestSender` that sends each /generate request instead of this client's
            HTTP client (``server_info`` is still read through it). A multi-process extraction
            gives each worker one that sends through the parent process, with ``gate`` left
            open: the parent holds the run's bound on requests in flight.
        cores: Cores its ingest threads are sized by (default: ``$HSDUMP_CORES``, else this
            process's CPU affinity).
    """

    def __init__(
        self,
        base_url: str,
        *,
        dump_dir: str | os.PathLike[str] | None = None,
        max_in_flight: int = 1,
        request_timeout: float = 600.0,
        dump_timeout: float = 60.0,
        watcher: DumpWatcher | str | None = None,
        expected_layer_ids: list[int] | None = None,
        dump_budget_bytes: int | None = None,
        stale_after: float = 3600.0,
        http_client: httpx.AsyncClient | None = None,
        gate: AbstractAsyncContextManager[Any] | None = None,
        probe: bool = True,
        sender: RequestSender | None = None,
        cores: int | None = None,
    ):
        if max_in_flight < 1:
            raise ConfigError(f"max_in_flight must be at least 1, got {max_in_flight}")
        self.base_url = base_url.rstrip("/")
        self.dump_dir = Path(dump_dir) if dump_dir is not None else setting("dump_dir")
        self.max_in_flight = max_in_flight
        self.request_timeout = request_timeout
        self.dump_timeout = dump_timeout
        self.rid_prefix = DEFAULT_RID_PREFIX  # the opt-in prefix every producer dumps
        self.stale_after = stale_after
        self.probe = probe
        self.stats = ClientStats()
        self.server_info: dict[str, Any] = {}
        self.limits = InputLimits()
        self.manifest: ProducerManifest | None = None
        self._watcher_arg = watcher
        self._budget_arg = dump_budget_bytes
        self._expected = Expected(layer_ids=expected_layer_ids)
        self._http = http_client
        self._own_http = http_client is None
        self._sender_arg = sender
        self._gate: AbstractAsyncContextManager[Any] = gate or (
            anyio.Lock() if max_in_flight == 1 else anyio.Semaphore(max_in_flight)
        )
        # Reading and checking a dump is memory-bound work: more threads than cores only add page
        # faults and allocator contention (8 at once cost twice the CPU per dump of 1 on 2 cores).
        self._ingest_limiter = anyio.CapacityLimiter(_ingest_threads(cores))
        self._abandoned: set[str] = set()
        self._state = _State.UNOPENED

    # -- lifecycle ---------------------------------------------------------------------------

    async def __aenter__(self) -> HiddenStateClient:
        await self.open()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    async def open(self) -> None:
        """Check the server and the dump root, and take a client id (``async with`` does this)."""
        if self._state is not _State.UNOPENED:
            raise ConfigError(f"this client is {self._state.value}; create a new one")
        try:
            self.manifest = self._live_manifest()
        except ServerNotDumping as exc:
            await self._say_if_unreachable(exc)
            raise
        if self._http is None:
            self._http = httpx.AsyncClient(base_url=self.base_url, timeout=self.request_timeout)
        self._sender = self._sender_arg or HttpSender(self._http, timeout=self.request_timeout)
        async with contextlib.AsyncExitStack() as stack:  # a failed step undoes those before it
            stack.push_async_callback(self._close_http)
            self.server_info = await self._fetch_server_info()
            self.limits = InputLimits.from_server_info(self.server_info)
            check_server_settings(self.server_info, self.manifest, self.base_url)
            check_same_producer(self.server_info, self.manifest, self.base_url, self.dump_dir)
            self._expected = Expected.from_manifest(
                self.manifest, layer_ids=self._expected.layer_ids, server_info=self.server_info
            )
            # torch takes seconds to import; pay that here rather than inside the first
            # extraction, where every request in flight would wait on the import lock.
            await anyio.to_thread.run_sync(importlib.import_module, "torch")
            self._lease = ClientLease(self.dump_dir, self.rid_prefix)
            stack.callback(self._lease.release)
            remove_stale(self.dump_dir, rid_prefix=self.rid_prefix, stale_after=self.stale_after)
            self._watcher = self._make_watcher()
            stack.push_async_callback(self._watcher.aclose)
            limit = self._budget_arg or default_budget_bytes(self.dump_dir)
            self.budget = ByteBudget(limit)
            if self.probe:
                await self._probe()
            self._resources = stack.pop_all()
        self._state = _State.OPEN

    async def aclose(self) -> None:
        """Release the watcher, the HTTP client and the client id; remove abandoned dumps."""
        if self._state is not _State.OPEN:
            self._state = _State.CLOSED
            return
        self._state = _State.CLOSED
        self._sweep_abandoned()
        await self._resources.aclose()  # the watcher, the client id, then the HTTP client

    async def _close_http(self) -> None:
        if self._own_http and self._http is not None:
            await self._http.aclose()
            self._http = None  # a later open() makes a new one

    def _make_watcher(self) -> DumpWatcher:
        if self._watcher_arg is None or isinstance(self._watcher_arg, str):
            return default_watcher(self.dump_dir, self._watcher_arg)
        return self._watcher_arg

    async def _say_if_unreachable(self, cause: ServerNotDumping) -> None:
        """With no producer in the dump root, first say so if the server cannot be reached: a
        server that is not running (or a wrong URL) explains an empty root too."""
        async with httpx.AsyncClient(base_url=self.base_url, timeout=5.0) as probe:
            try:
                await probe.get("/health")
            except httpx.TransportError as exc:
                raise ServerUnavailable(
                    f"cannot reach the server at {self.base_url} ({exc!r}), and no server dumps "
                    f"into {self.dump_dir}. Is it running, and is this its URL?"
                ) from cause

    def _live_manifest(self) -> ProducerManifest:
        manifests = read_manifests(self.dump_dir)
        live = [m for m in manifests if m.is_alive()]
        if not live:
            pids = ", ".join(f"{m.producer.name} pid {m.pid}" for m in manifests)
            raise ServerNotDumping(
                f"the producers that announced themselves in {self.dump_dir} ({pids}) have exited: "
                "no server is dumping there. Restart the server with dumping enabled."
            )
        return live[0]

    async def _fetch_server_info(self) -> dict[str, Any]:
        for path in ("/server_info", "/get_server_info"):
            response = await self._get(path)
            if response.status_code == 404:
                continue
            if response.status_code >= 400:
                raise ServerResponseError(
                    f"GET {self.base_url}{path} answered {response.status_code}",
                    status_code=response.status_code,
                )
            info: dict[str, Any] = _json(response, f"GET {path}")
            return info
        logger.warning("%s exposes no server_info: its settings cannot be checked", self.base_url)
        return {}

    async def _get(self, path: str) -> httpx.Response:
        assert self._http is not None
        try:
            return await self._http.get(path)
        except httpx.TimeoutException as exc:
            raise ServerTimeout(f"GET {self.base_url}{path} timed out") from exc
        except httpx.TransportError as exc:
            raise ServerUnavailable(
                f"cannot reach the server at {self.base_url} ({exc!r}). Is it running?"
            ) from exc

    # -- extraction --------------------------------------------------------------------------

    async def extract(self, sample: Sample) -> HiddenStates:
        """Run ``sample`` through the server and return its verified hidden states.

        One attempt with a fresh request id; errors are `HsdumpError` subclasses whose
        ``transient`` attribute says whether a retry may succeed.
        """
        return await self._extract(sample, check_values=True)

    async def _extract(self, sample: Sample, *, check_values: bool) -> HiddenStates:
        if self._state is not _State.OPEN:
            raise ConfigError(f"this client is {self._state.value}: use it inside `async with`")
        self.limits.check(sample.input_ids, sample_id=sample.id)
        self._sweep_abandoned()
        nbytes = _META_BYTES + len(sample.input_ids) * self._dump_bytes_per_token()
        await self.budget.acquire(nbytes)
        try:
            return await self._extract_once(sample, check_values)
        except HsdumpError as exc:
            name = type(exc).__name__
            self.stats.failures[name] = self.stats.failures.get(name, 0) + 1
            raise
        finally:
            with anyio.CancelScope(shield=True):
                await self.budget.release(nbytes)

    async def _extract_once(self, sample: Sample, check_values: bool) -> HiddenStates:
        rid = self._lease.new_rid()
        path = None
        try:
            path = await self._request(sample, rid)
        finally:
            if path is None:
                self._abandon(rid)
        queued = time.perf_counter()
        states, began = await anyio.to_thread.run_sync(
            self._ingest, sample, rid, path, check_values, limiter=self._ingest_limiter
        )
        self._account(states, began - queued, time.perf_counter() - began)
        return states

    def _ingest(
        self, sample: Sample, rid: str, path: Path, check_values: bool
    ) -> tuple[HiddenStates, float]:
        began = time.perf_counter()
        expected = self._expected
        # What a dump must hold is only learnt from a checked one (`Expected.remember`).
        check_values = check_values or not expected.complete
        try:
            states = load_dump(
                path, sample=sample, rid=rid, expected=expected, check_values=check_values
            )
            return states, began
        finally:
            remove_dump(path)

    def _account(self, states: HiddenStates, queued_s: float, ingest_s: float) -> None:
        self.stats.requests += 1
        self.stats.tokens += states.num_tokens
        self.stats.bytes += states.nbytes
        self.stats.ingest_queue_s += queued_s
        self.stats.ingest_s += ingest_s

    async def _request(self, sample: Sample, rid: str, dump_timeout: float | None = None) -> Path:
        """Send the request and wait for both its response and its dump.

        The gate is held until the response: then the server is done with the request, and the
        next one can prefill while this dump is written and read (the byte budget bounds them).
        """
        dump_timeout = self.dump_timeout if dump_timeout is None else dump_timeout
        found: dict[str, Path] = {}
        dump_seen = anyio.Event()
        error: BaseException | None = None
        async with anyio.create_task_group() as tg:
            try:
                asked = time.perf_counter()
                async with self._gate:
                    self.stats.slot_wait_s += time.perf_counter() - asked
                    tg.start_soon(self._wait_for_dump, rid, found, dump_seen)
                    await self._send(sample, rid)
                waited = time.perf_counter()
                with anyio.fail_after(dump_timeout):
                    await dump_seen.wait()
                self.stats.dump_wait_s += time.perf_counter() - waited
            except HsdumpError as exc:  # first: ServerTimeout is a TimeoutError too
                error = exc
            except TimeoutError:
                error = DumpTimeout(
                    "the server answered, but no dump appeared in "
                    f"{request_dir(self.dump_dir, rid)}"
                    f" within {dump_timeout:g} s. Is the server dumping into this directory "
                    f"(HSDUMP_DUMP_DIR) with the rid prefix {self.rid_prefix!r}?",
                    sample_id=sample.id,
                    rid=rid,
                )
            tg.cancel_scope.cancel()
        if error is not None:
            raise error
        return found["path"]

    async def _wait_for_dump(self, rid: str, found: dict[str, Path], seen: anyio.Event) -> None:
        # The overall deadline is the caller's; this bound only keeps a lost wait from living on.
        try:
            found["path"] = await self._watcher.wait(rid, self.request_timeout + self.dump_timeout)
        except DumpTimeout:
            return
        seen.set()

    async def _send(self, sample: Sample, rid: str) -> None:
        body = {
            "rid": rid,
            "input_ids": list(sample.input_ids),
            "sampling_params": {"max_new_tokens": 0, "temperature": 0.0},
            "extra_key": uuid.uuid4().hex,  # no prefix-cache hit can shorten the capture
            "stream": False,
        }
        answer = await self._sender.post(body, sample_id=sample.id, rid=rid)
        self.stats.slot_wait_s += answer.slot_wait_s
        self.stats.server_s += answer.server_s
        if answer.status_code >= 400:
            raise ServerResponseError(
                f"the server answered {answer.status_code}: {answer.text[:300]}",
                status_code=answer.status_code,
                sample_id=sample.id,
                rid=rid,
            )
        parsed = _parsed(answer, "POST /generate", sample_id=sample.id, rid=rid)
        check_response(parsed, rid=rid, num_tokens=len(sample.input_ids), sample_id=sample.id)

    async def _probe(self) -> None:
        """One prefill of a single token whose dump must appear in this client's dump root."""
        rid, wait = self._lease.new_rid(), min(self.dump_timeout, _PROBE_DUMP_WAIT)
        path = None
        try:
            path = await self._request(_PROBE, rid, dump_timeout=wait)
        except DumpTimeout as exc:
            raise ServerNotDumping(self._not_here(rid, wait)) from exc
        finally:
            if path is None:
                self._abandon(rid)
        remove_dump(path)

    def _not_here(self, rid: str, wait: float) -> str:
        m = self.manifest
        assert m is not None
        declared = self.server_info.get(_DECLARED_LAYERS)
        says = f"layers {declared}" if declared is not None else "no aux layers in /server_info"
        return (
            f"the server at {self.base_url} answered the probe request {rid}, but no dump "
            f"appeared in {self.dump_dir} within {wait:g} s: that server dumps somewhere else (or "
            f"not with the rid prefix {self.rid_prefix!r}). {self.dump_dir} is filled by "
            f"{m.producer.name} (pid {m.pid} on {m.host}, layers {m.layer_ids}, model "
            f"{m.model_path or 'unknown'}); the server at {self.base_url} reports {says}. Pass "
            f"the dump root of the server at {self.base_url} (--dump-dir, HSDUMP_DUMP_DIR), or "
            f"the URL of the server that fills {self.dump_dir}."
        )

    # -- helpers -----------------------------------------------------------------------------

    @property
    def max_input_len(self) -> int | None:
        """The longest prompt the server accepts, when it says (``limits.max_tokens``)."""
        return self.limits.max_tokens

    def _dump_bytes_per_token(self) -> int:
        """What a dump holds a token: its rows, its token id in meta.json and, where the producer
        announces them, its row moments (a float32 sum and sum of squares a layer)."""
        m = self.manifest
        assert m is not None
        layers = len(m.layer_ids) + 1
        moments = layers * _MOMENT_BYTES if m.capabilities.row_moments else 0
        return layers * m.hidden_size * dtype_itemsize(m.dtype) + _META_BYTES_PER_TOKEN + moments

    def _abandon(self, rid: str) -> None:
        path = request_dir(self.dump_dir, rid)
        remove_dump(path)
        if not path.exists():
            self._abandoned.add(rid)  # it may still be published later: remove it then

    def _sweep_abandoned(self) -> None:
        for rid in list(self._abandoned):
            path = request_dir(self.dump_dir, rid)
            if path.exists():
                remove_dump(path)
                self._abandoned.discard(rid)


def _ingest_threads(configured: int | None) -> int:
    """Dumps read and checked at once: half the cores, 1 to 4 (one reads ~2 GB/s here)."""
    return max(1, min(4, cores(configured) // 2))


def _json(response: httpx.Response, what: str, **context: Any) -> Any:
    try:
        return response.json()
    except ValueError as exc:
        raise ServerResponseError(
            f"{what} did not return JSON: {response.text[:200]!r}",
            status_code=response.status_code,
            **context,
        ) from exc


def _parsed(answer: ServerAnswer, what: str, **context: Any) -> Any:
    try:
        return json.loads(answer.text)
    except ValueError as exc:
        raise ServerResponseError(
            f"{what} did not return JSON: {answer.text[:200]!r}",
            status_code=answer.status_code,
            **context,
        ) from exc


def check_same_producer(
    info: dict[str, Any], manifest: ProducerManifest, url: str, dump_dir: Path
) -> None:
    """Refuse a dump root announced by a producer with other aux layers than the server's."""
    declared = info.get(_DECLARED_LAYERS)
    if declared is None or list(declared) == manifest.layer_ids:
        return
    raise ServerConfigError(
        f"the server at {url} reports aux layers {list(declared)} ({_DECLARED_LAYERS}), but "
        f"{dump_dir} is announced by {manifest.producer.name} (pid {manifest.pid} on "
        f"{manifest.host}) with layers {manifest.layer_ids}: the dump root belongs to another "
        f"server. Pass the dump root of the server at {url} (--dump-dir, HSDUMP_DUMP_DIR), or "
        f"the URL of the server that fills {dump_dir}."
    )


def check_server_settings(info: dict[str, Any], manifest: ProducerManifest, url: str) -> None:
    """Refuse server settings under which captures would be truncated."""
    caps = manifest.capabilities
    if info.get("disable_radix_cache") is False and not caps.prefix_cache_guard:
        raise ServerConfigError(
            f"the server at {url} runs with the radix (prefix) cache on and its producer "
            f"({manifest.producer.name}) cannot detect cached prefixes, so captures could be "
            "short. Restart it with --disable-radix-cache."
        )
    chunk = info.get("chunked_prefill_size")
    if isinstance(chunk, int) and chunk > 0 and not caps.chunked_prefill_assembly:
        raise ServerConfigError(
            f"the server at {url} runs with --chunked-prefill-size {chunk} and its producer "
            f"({manifest.producer.name}) cannot assemble chunks, so long prompts would lose rows. "
            "Restart it with --chunked-prefill-size -1."
        )


async def extract_unchecked(client: HiddenStateClient, sample: Sample) -> HiddenStates:
    """`HiddenStateClient.extract`, with the check of the values (finite, no vector all zeros)
    left to the `HiddenStateStore` that writes them: it takes the check in the pass that places
    them and refuses the sample there (`HiddenStates.values_checked` is False). Identity, tokens,
    shapes, layers and dtype are checked here as always. An extraction run uses it; the values
    are checked here as well until what the dumps must hold is known from the producer manifest.
    """
    return await client._extract(sample, check_values=False)
