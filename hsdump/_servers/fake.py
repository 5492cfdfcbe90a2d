"""A fake patched server for tests: real HTTP, real dump files, deterministic states, faults.

Public through `hsdump.testing`.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np

from hsdump._protocol import (
    DEFAULT_RID_PREFIX,
    Capabilities,
    DType,
    DumpMeta,
    DumpWriter,
    ProducerInfo,
    ProducerManifest,
    dtype_spec,
    is_opted_in,
    row_moments,
    write_dump,
    write_error,
    write_manifest,
)
from hsdump._servers.http_app import (
    DropConnection,
    GenerateRequest,
    RequestRejected,
    SGLangCompatibleServer,
    prefill_response,
)

__all__ = ["FakeServer", "Fault", "FaultKind", "fake_states"]

FaultKind = Literal[
    "none",
    "http_500",
    "http_400",
    "drop_connection",
    "no_dump",
    "error_marker",
    "wrong_token_count",
    "wrong_token_ids",
    "wrong_layers",
    "nan",
    "zero_row",
    "wrong_moments",
    "no_moments",
    "response_rid",
    "cached_tokens",
    "dump_first",
    "response_first",
]
PRODUCER = ProducerInfo(name="hsdump-fake", version="1")


@dataclass(frozen=True)
class Fault:
    """How the fake misbehaves for one opted-in request.

    Args:
        kind: What goes wrong (``dump_first``/``response_first`` only reorder, with ``delay``;
            ``wrong_moments`` declares sums of squares off by half, ``no_moments`` leaves
            ``moments.bin`` out, both only where the capabilities announce ``row_moments``).
        delay: Seconds between the first and the second of response and dump.
    """

    kind: FaultKind = "none"
    delay: float = 0.05


def fake_states(
    input_ids: Sequence[int], layer_ids: Sequence[int], hidden_size: int, dtype: str = "bfloat16"
) -> tuple[np.ndarray, np.ndarray]:
    """Deterministic states (as the raw bits of ``dtype``) that depend on each token and position.

    Returns ``aux [T, K, H]`` and ``final [T, H]``; two samples with different tokens differ.
    """
    ids = np.asarray(input_ids, dtype=np.float32)[:, None, None]
    pos = np.arange(len(input_ids), dtype=np.float32)[:, None, None]
    layers = np.asarray([*layer_ids, -1], dtype=np.float32)[None, :, None]
    h = np.arange(hidden_size, dtype=np.float32)[None, None, :]
    values = np.sin(ids * 0.731 + pos * 0.0173 + layers * 1.37 + h * 0.21) * 2.0 + 0.01
    bits = dtype_spec(dtype).from_float32(values)
    return np.ascontiguousarray(bits[:, :-1]), np.ascontiguousarray(bits[:, -1])


class FakeEngine:
    """The engine behind `FakeServer` (see there)."""

    def __init__(
        self,
        dump_dir: Path,
        *,
        layer_ids: Sequence[int],
        hidden_size: int,
        latency: float,
        server_info: dict[str, Any],
        fault_for: Callable[[str, list[int]], Fault | None] | None,
        pool_tokens: int = 0,
        dtype: DType = "bfloat16",
        moments: bool = False,
    ):
        self.dump_dir = dump_dir
        self.moments = moments
        self.layer_ids = list(layer_ids)
        self.hidden_size = hidden_size
        self.dtype: DType = dtype
        self.latency = latency
        self.info = server_info
        self.fault_for = fault_for
        self.faults: deque[Fault] = deque()
        self.received: list[GenerateRequest] = []
        self.dumped: list[str] = []
        self._background: set[asyncio.Task[None]] = set()
        self._pool = _random_pool(pool_tokens, len(self.layer_ids) + 1, hidden_size, dtype)

    def server_info(self) -> dict[str, Any]:
        """See `hsdump._servers.http_app.Engine`."""
        return self.info

    def model_info(self) -> dict[str, Any]:
        """See `hsdump._servers.http_app.Engine`."""
        return {"model_path": "fake", "is_generation": True}

    async def generate(self, request: GenerateRequest) -> dict[str, Any]:
        """See `hsdump._servers.http_app.Engine`."""
        started = time.perf_counter()
        self.received.append(request)
        rid, ids = request.rid or "anonymous", list(request.input_ids or [])
        fault = self._next_fault(rid, ids) if is_opted_in(rid) else Fault()
        await asyncio.sleep(self.latency)
        self._raise_http_fault(fault)
        response = prefill_response(rid, len(ids), started)
        _corrupt_response(response, fault)
        if not is_opted_in(rid) or fault.kind == "no_dump":
            return response
        if fault.kind == "response_first":
            self._later(fault.delay, rid, ids, fault)
            return response
        await asyncio.to_thread(self.dump, rid, ids, fault)
        if fault.kind == "dump_first":
            await asyncio.sleep(fault.delay)
        return response

    def _next_fault(self, rid: str, ids: list[int]) -> Fault:
        if self.faults:
            return self.faults.popleft()
        return (self.fault_for and self.fault_for(rid, ids)) or Fault()

    @staticmethod
    def _raise_http_fault(fault: Fault) -> None:
        if fault.kind == "http_500":
            raise RequestRejected(500, "injected internal error")
        if fault.kind == "http_400":
            raise RequestRejected(400, "injected bad request")
        if fault.kind == "drop_connection":
            raise DropConnection()

    def _later(self, delay: float, rid: str, ids: list[int], fault: Fault) -> None:
        async def dump_later() -> None:
            await asyncio.sleep(delay)
            await asyncio.to_thread(self.dump, rid, ids, fault)

        task = asyncio.get_running_loop().create_task(dump_later())
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    def dump(self, rid: str, ids: list[int], fault: Fault = Fault()) -> Path:
        """Write the dump of request ``rid`` for ``ids``, applying ``fault``."""
        if fault.kind == "error_marker":
            return write_error(self.dump_dir, rid, "injected capture failure", PRODUCER)
        dumped_ids = _corrupt_ids(ids, fault)
        layers = [i + 1 for i in self.layer_ids] if fault.kind == "wrong_layers" else self.layer_ids
        aux, final = self._states(dumped_ids, layers)
        aux = _corrupt_values(aux, fault, self.dtype)
        t, k, h = aux.shape
        meta = DumpMeta(
            rid=rid,
            input_ids=dumped_ids,
            num_tokens=t,
            layer_ids=layers,
            final_norm="post_norm",
            hidden_size=h,
            dtype=self.dtype,
            aux_shape=(t, k, h),
            final_shape=(t, h),
            producer=PRODUCER,
            model_path="fake",
        )
        path = self._publish(meta, aux, final, fault)
        self.dumped.append(rid)
        return path

    def _publish(self, meta: DumpMeta, aux: np.ndarray, final: np.ndarray, fault: Fault) -> Path:
        if not self.moments or fault.kind == "no_moments":
            return write_dump(self.dump_dir, meta, aux, final)
        declared = row_moments(aux, final, meta.dtype)
        if fault.kind == "wrong_moments":
            declared[..., 1] *= 1.5
        t, k, h = meta.aux_shape
        with DumpWriter(
            self.dump_dir,
            meta.rid,
            num_tokens=t,
            num_layers=k,
            hidden_size=h,
            dtype=meta.dtype,
            moments=True,
        ) as writer:
            writer.write_rows(0, aux, final, declared)
            return writer.publish(meta)

    def _states(self, ids: list[int], layers: list[int]) -> tuple[np.ndarray, np.ndarray]:
        if self._pool is None or len(ids) > self._pool[0].shape[0]:
            return fake_states(ids, layers, self.hidden_size, self.dtype)
        aux, final = self._pool
        return aux[: len(ids)], final[: len(ids)]


def _random_pool(
    tokens: int, layers: int, hidden: int, dtype: str
) -> tuple[np.ndarray, np.ndarray] | None:
    """Random-normal states to slice from, for benchmarks (generating states is free)."""
    if tokens <= 0:
        return None
    values = np.random.default_rng(0).standard_normal((tokens, layers, hidden), dtype=np.float32)
    bits = dtype_spec(dtype).from_float32(values)
    return np.ascontiguousarray(bits[:, :-1]), np.ascontiguousarray(bits[:, -1])


def _corrupt_response(response: dict[str, Any], fault: Fault) -> None:
    if fault.kind == "response_rid":
        response["meta_info"]["id"] = "hsdump-someone-else"
    elif fault.kind == "cached_tokens":
        response["meta_info"]["cached_tokens"] = 2


def _corrupt_ids(ids: list[int], fault: Fault) -> list[int]:
    if fault.kind == "wrong_token_count":
        return ids[:-1] or [0, 0]
    if fault.kind == "wrong_token_ids":
        return [ids[0] + 1, *ids[1:]]
    return ids


def _corrupt_values(aux: np.ndarray, fault: Fault, dtype: str) -> np.ndarray:
    if fault.kind not in ("nan", "zero_row"):
        return aux
    aux = aux.copy()
    if fault.kind == "nan":
        aux[-1, 0, 0] = dtype_spec(dtype).from_float32(np.float32(np.nan))
    else:
        aux[0, -1, :] = 0
    return aux


class FakeServer(SGLangCompatibleServer):
    """An SGLang stand-in that dumps through the real protocol, for tests (yours and ours).

    It dumps only opted-in requests (rid prefix ``hsdump-``), like the real plugin, writes a
    producer manifest while running, and misbehaves on demand::

        with FakeServer(tmp_path) as server:
            server.inject(Fault("nan"))              # the next opted-in request
            ...  # HiddenStateClient(server.url, dump_dir=tmp_path)

    Args:
        dump_dir: The dump root.
        layer_ids: Aux layer ids to report.
        hidden_size: H.
        latency: Seconds each request takes before answering (a stand-in for prefill time).
        server_info: Overrides of the ``/server_info`` body.
        capabilities: The manifest's capabilities (by default it dumps row moments, and neither
            assembles chunked prefills nor guards the prefix cache).
        announce: Write the producer manifest (False: look like a server that is not dumping).
        fault_for: Called with (rid, input_ids) of each opted-in request without a queued fault.
        pool_tokens: When positive, dumps slice states from a pre-generated random pool of this
            many tokens instead of computing them from the token ids (fast, for benchmarks).
        dtype: The protocol dtype of the dumps (and of the manifest).
    """

    def __init__(
        self,
        dump_dir: str | Path,
        *,
        layer_ids: Sequence[int] = (2, 4, 6),
        hidden_size: int = 32,
        latency: float = 0.0,
        server_info: dict[str, Any] | None = None,
        capabilities: Capabilities | None = None,
        announce: bool = True,
        fault_for: Callable[[str, list[int]], Fault | None] | None = None,
        pool_tokens: int = 0,
        dtype: DType = "bfloat16",
        host: str = "127.0.0.1",
        port: int = 0,
    ):
        info = {"disable_radix_cache": True, "chunked_prefill_size": -1, "version": "fake"}
        info.update(server_info or {})
        self.dump_dir = Path(dump_dir)
        self.capabilities = capabilities or Capabilities(
            chunked_prefill_assembly=False, prefix_cache_guard=False, row_moments=True
        )
        self.announce = announce
        self.engine: FakeEngine = FakeEngine(
            self.dump_dir,
            layer_ids=layer_ids,
            hidden_size=hidden_size,
            latency=latency,
            server_info=info,
            fault_for=fault_for,
            pool_tokens=pool_tokens,
            dtype=dtype,
            moments=self.capabilities.row_moments,
        )
        self._manifest_path: Path | None = None
        super().__init__(self.engine, host=host, port=port)

    def inject(self, *faults: Fault) -> None:
        """Queue faults for the next opted-in requests, in order."""
        self.engine.faults.extend(faults)

    @property
    def received(self) -> list[GenerateRequest]:
        """Every ``/generate`` body received, in order."""
        return self.engine.received

    def start(self, timeout: float = 30.0) -> None:
        """Announce the producer and start serving."""
        self.dump_dir.mkdir(parents=True, exist_ok=True)
        if self.announce:
            manifest = ProducerManifest(
                producer=PRODUCER,
                rid_prefix=DEFAULT_RID_PREFIX,
                layer_ids=self.engine.layer_ids,
                final_norm="post_norm",
                hidden_size=self.engine.hidden_size,
                dtype=self.engine.dtype,
                model_path="fake",
                capabilities=self.capabilities,
            )
            self._manifest_path = write_manifest(self.dump_dir, manifest)
        super().start(timeout)

    def stop(self, timeout: float = 10.0) -> None:
        """Stop serving and withdraw the manifest."""
        super().stop(timeout)
        if self._manifest_path is not None:
            with contextlib.suppress(OSError):
                self._manifest_path.unlink()
