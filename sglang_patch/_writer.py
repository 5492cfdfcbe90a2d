"""The background thread that turns staged pieces into published dumps.

One thread per writing rank. It waits on each group's CUDA event (which releases the GIL), has a
small pool of threads write the group's rows at their offsets with
:class:`hsdump._protocol.DumpWriter` (``pwrite`` releases the GIL, so the copies into tmpfs run in
parallel: one thread writes ~2.5 GB/s, eight ~18 GB/s), and publishes a request once its rows
cover exactly ``[0, T)``. Opening, failing and publishing stay on the one thread, in order.
Before it starts a request it waits for room in the dump root
(bytes pending and free space), so a slow or absent client throttles the server instead of
filling ``/dev/shm``.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hsdump._protocol import DumpMeta, DumpWriter, ProducerInfo, dtype_itemsize, write_error
from sglang_patch._config import PluginConfig
from sglang_patch._staging import Piece

__all__ = ["DumpFormat", "WriterThread"]

logger = logging.getLogger(__name__)

# Rows per pool job: large enough that a job's overhead is noise, small enough that one request's
# rows (117 MB for 2048 tokens at H=7168) spread over the pool.
_JOB_BYTES = 16 << 20


@dataclass(frozen=True)
class DumpFormat:
    """What every dump of this producer shares."""

    layer_ids: tuple[int, ...]
    hidden_size: int
    dtype: str
    producer: ProducerInfo
    model_path: str = ""
    rank: int = 0

    @property
    def row_bytes(self) -> int:
        """Bytes of one token: K aux rows plus the final row."""
        return (len(self.layer_ids) + 1) * self.hidden_size * dtype_itemsize(self.dtype)


@dataclass
class _Assembly:
    writer: DumpWriter
    input_ids: tuple[int, ...]
    pieces: int = 0


class StageClock:
    """Seconds spent per stage, logged every ``interval_s`` (``HSDUMP_PROFILE_S``; 0: off)."""

    def __init__(self, name: str, interval_s: float):
        self.name, self.interval_s = name, interval_s
        self.seconds: dict[str, float] = {}
        self._lock = threading.Lock()
        self._next = time.monotonic() + interval_s

    def add(self, stage: str, started: float) -> float:
        """Add the time since ``started`` (a ``perf_counter``) to ``stage``; returns now."""
        now = time.perf_counter()
        if not self.interval_s:
            return now
        with self._lock:
            self.seconds[stage] = self.seconds.get(stage, 0.0) + now - started
            if time.monotonic() >= self._next:
                self._next = time.monotonic() + self.interval_s
                stages = ", ".join(f"{k} {v:.2f} s" for k, v in self.seconds.items())
                logger.info("hsdump: %s time per stage so far: %s", self.name, stages)
        return now


class WriterThread:
    """Consumes staged pieces, errors and aborts in order, on a daemon thread.

    Args:
        config: The plugin settings (dump root, space bounds).
        fmt: The dump format.
        release: Called with each piece's ring block once its bytes are written (or dropped).
    """

    def __init__(self, config: PluginConfig, fmt: DumpFormat, *, release: Any):
        self.config, self.fmt = config, fmt
        self._release = release
        self._queue: queue.Queue[tuple[str, Any]] = queue.Queue()
        self._open: dict[str, _Assembly] = {}
        self._failed: deque[str] = deque(maxlen=4096)
        self._published: deque[tuple[Path, int]] = deque()
        self._published_bytes = 0
        self._thread = threading.Thread(target=self._run, name="hsdump-writer", daemon=True)
        self._pool = ThreadPoolExecutor(config.write_threads, thread_name_prefix="hsdump-write")
        self.clock = StageClock("writer", config.profile_s)

    def start(self) -> WriterThread:
        """Start the thread; returns self."""
        self._thread.start()
        return self

    def alive(self) -> bool:
        """Whether the thread is running."""
        return self._thread.is_alive()

    def submit_rows(self, event: Any, pieces: list[Piece]) -> None:
        """Write ``pieces`` once ``event`` has completed."""
        self._queue.put(("rows", (event, pieces)))

    def submit_error(self, rid: str, reason: str) -> None:
        """Publish an error marker for ``rid`` (dropping any rows written for it)."""
        self._queue.put(("error", (rid, reason)))

    def submit_abort(self, rid: str) -> None:
        """Drop ``rid``'s partial dump without publishing anything (the request went away)."""
        self._queue.put(("abort", rid))

    def drain(self, timeout_s: float = 30.0) -> None:
        """Wait until everything submitted so far is handled (for shutdown and tests)."""
        done = threading.Event()
        self._queue.put(("barrier", done))
        done.wait(timeout_s)

    def stop(self, timeout_s: float = 30.0) -> None:
        """Finish the queue, then end the thread."""
        self._queue.put(("stop", None))
        self._thread.join(timeout_s)
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _run(self) -> None:
        while True:
            idle = time.perf_counter()
            kind, payload = self._queue.get()
            self.clock.add("idle", idle)
            if kind == "stop":
                return
            try:
                self._handle(kind, payload)
            except Exception:  # never let one request's failure end the thread
                logger.exception("hsdump: writer failed on a %s item", kind)

    def _handle(self, kind: str, payload: Any) -> None:
        if kind == "rows":
            self._write_group(*payload)
        elif kind == "error":
            self._fail(*payload)
        elif kind == "abort":
            self._drop(payload)
        elif kind == "barrier":
            payload.set()

    def _write_group(self, event: Any, pieces: list[Piece]) -> None:
        """Write a group's pieces on the pool, then account for them in order."""
        try:
            started = time.perf_counter()
            event.synchronize()
            started = self.clock.add("cuda_wait", started)
            jobs = [(piece, self._assembly_for(piece)) for piece in pieces]
            started = self.clock.add("open", started)
            writes = [(p, a, self._submit_writes(p, a)) for p, a in jobs if a is not None]
            wait([future for _, _, futures in writes for future in futures])
            started = self.clock.add("write", started)
            for piece, assembly, futures in writes:
                self._settle(piece, assembly, futures)
            self.clock.add("publish", started)
        finally:
            for piece in pieces:
                self._release(piece.block)

    def _assembly_for(self, piece: Piece) -> _Assembly | None:
        if piece.first:
            self._drop(piece.rid)
            if piece.rid in self._failed:
                self._failed.remove(piece.rid)
            if not self._open_assembly(piece):
                return None
        return self._open.get(piece.rid)  # None: an earlier piece failed and published an error

    def _submit_writes(self, piece: Piece, assembly: _Assembly) -> list[Future[None]]:
        aux, final = piece.aux.numpy(), piece.final.numpy()
        aux_row, final_row = len(aux) // piece.n, len(final) // piece.n
        step = max(1, _JOB_BYTES // (aux_row + final_row))
        return [
            self._pool.submit(
                assembly.writer.write_rows,
                piece.start + row,
                aux[row * aux_row : (row + step) * aux_row],
                final[row * final_row : (row + step) * final_row],
            )
            for row in range(0, piece.n, step)
        ]

    def _settle(self, piece: Piece, assembly: _Assembly, futures: list[Future[None]]) -> None:
        if self._open.get(piece.rid) is not assembly:
            return  # an earlier piece of this group failed
        errors = [exc for exc in (f.exception() for f in futures) if exc is not None]
        for exc in errors:
            if not isinstance(exc, OSError | ValueError):
                raise exc
        if errors:
            end = piece.start + piece.n
            self._fail(piece.rid, f"writing rows [{piece.start}, {end}) failed: {errors[0]}")
            return
        assembly.pieces += 1
        if assembly.writer.coverage_complete():
            self._publish(piece.rid, assembly)

    def _open_assembly(self, piece: Piece) -> bool:
        need = piece.total * self.fmt.row_bytes
        if not self._wait_for_room(need):
            self._fail(
                piece.rid,
                f"the dump root {self.config.dump_dir} had no room for {need} bytes within "
                f"{self.config.space_timeout_s:.0f} s: dumps are not being consumed "
                "(raise HSDUMP_MAX_PENDING_MB or free space in the dump root)",
            )
            return False
        try:
            writer = DumpWriter(
                self.config.dump_dir,
                piece.rid,
                num_tokens=piece.total,
                num_layers=len(self.fmt.layer_ids),
                hidden_size=self.fmt.hidden_size,
                dtype=self.fmt.dtype,
                mapped=True,
            )
        except (OSError, ValueError) as exc:
            self._fail(piece.rid, f"could not create its dump in {self.config.dump_dir}: {exc}")
            return False
        self._open[piece.rid] = _Assembly(writer=writer, input_ids=piece.input_ids or ())
        return True

    def _publish(self, rid: str, assembly: _Assembly) -> None:
        fmt, t = self.fmt, assembly.writer.num_tokens
        meta = DumpMeta(
            rid=rid,
            input_ids=list(assembly.input_ids),
            num_tokens=t,
            layer_ids=list(fmt.layer_ids),
            final_norm="post_norm",
            hidden_size=fmt.hidden_size,
            dtype=fmt.dtype,  # type: ignore[arg-type]
            aux_shape=(t, len(fmt.layer_ids), fmt.hidden_size),
            final_shape=(t, fmt.hidden_size),
            producer=fmt.producer,
            model_path=fmt.model_path,
            rank=fmt.rank,
            extra={"pieces": assembly.pieces},
        )
        del self._open[rid]
        try:
            path = assembly.writer.publish(meta)
        except (OSError, ValueError) as exc:
            assembly.writer.abort()
            self._fail(rid, f"publishing its dump failed: {exc}")
            return
        self._published.append((path, t * fmt.row_bytes))
        self._published_bytes += t * fmt.row_bytes

    def _fail(self, rid: str, reason: str) -> None:
        self._drop(rid)
        if rid in self._failed:
            return  # one error marker per request
        self._failed.append(rid)
        logger.warning("hsdump: %s", reason)
        try:
            write_error(self.config.dump_dir, rid, reason, self.fmt.producer)
        except OSError:
            logger.exception("hsdump: could not publish the error marker of %s", rid)

    def _drop(self, rid: str) -> None:
        assembly = self._open.pop(rid, None)
        if assembly is not None:
            assembly.writer.abort()

    def _wait_for_room(self, need: int) -> bool:
        deadline = time.monotonic() + self.config.space_timeout_s
        while True:
            pending = self._pending_bytes(need)
            fits = pending == 0 or pending + need <= self.config.max_pending_bytes
            if fits and _free_bytes(self.config.dump_dir) - need >= self.config.min_free_bytes:
                return True
            if time.monotonic() > deadline:
                return False
            time.sleep(0.05)

    def _pending_bytes(self, need: int) -> int:
        writing = sum(a.writer.num_tokens * self.fmt.row_bytes for a in self._open.values())
        if writing + self._published_bytes + need > self.config.max_pending_bytes:
            # Published dumps count until the client removes them: forget those consumed.
            kept = deque((p, size) for p, size in self._published if p.exists())
            self._published, self._published_bytes = kept, sum(size for _, size in kept)
        return writing + self._published_bytes


def _free_bytes(path: Path) -> int:
    try:
        st = os.statvfs(path)
    except OSError:
        return 1 << 62  # a missing root is created on the first write; nothing to bound yet
    return st.f_bavail * st.f_frsize
