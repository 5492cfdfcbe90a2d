"""The background threads that turn staged pieces into published dumps.

Per writing rank, a coordinating thread takes each group of pieces in order: it waits on the
group's CUDA event (which releases the GIL), opens the requests that start in it, and queues their
rows on a pool that copies them into the memory-mapped dump files (``memmove`` releases the GIL:
D2H plus the copy ran at 3.6 GB/s on one thread of an H200 host and 10.6 GB/s on eight). It does
not wait for the writes: a publishing thread settles each piece once its rows are written, frees
its pinned memory and publishes a request whose rows cover exactly ``[0, T)``, so one group's
writes and publishing overlap the next group's. Before it opens a request the coordinating
thread waits for room in the dump root (bytes pending and free space), so a slow or absent client
throttles the server instead of filling ``/dev/shm``.

Copying straight from the GPU into the mapped files was measured and refused: registering a
fresh 117 MB mapping with CUDA took 48 ms and did not run in parallel (2.1-2.3 GB/s on 1-8
threads), and unregistered (pageable) copies reached 1.1-1.25 GB/s.
"""

from __future__ import annotations

import functools
import logging
import os
import queue
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from hsdump._protocol import DumpMeta, DumpWriter, FinalNorm, ProducerInfo, dtype_itemsize
from sglang_patch._config import PluginConfig
from sglang_patch._ledger import Assembly, Ledger
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
    final_norm: FinalNorm = "post_norm"

    @property
    def row_bytes(self) -> int:
        """Bytes of one token: K aux rows plus the final row."""
        return (len(self.layer_ids) + 1) * self.hidden_size * dtype_itemsize(self.dtype)


class WriterThread:
    """Consumes staged pieces, errors and aborts in order, on a daemon thread.

    Args:
        config: The plugin settings (dump root, space bounds).
        fmt: The dump format.
        release: Called with each piece's ring block once its bytes are written (or dropped).
    """

    def __init__(self, config: PluginConfig, fmt: DumpFormat, *, release: Any):
        self.config, self.fmt = config, fmt
        self._queue: queue.Queue[tuple[str, Any]] = queue.Queue()
        self._ledger = Ledger(config.dump_dir, fmt.producer, fmt.row_bytes)
        self._thread = threading.Thread(target=self._run, name="hsdump-writer", daemon=True)
        self._pool = ThreadPoolExecutor(config.write_threads, thread_name_prefix="hsdump-write")
        self._publisher = _Publisher(self._ledger, fmt, release, self._pool)

    def start(self) -> WriterThread:
        """Start the threads; returns self."""
        self._publisher.start()
        self._thread.start()
        return self

    def alive(self) -> bool:
        """Whether both threads are running."""
        return self._thread.is_alive() and self._publisher.alive()

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
        """Wait until everything submitted so far is written and settled (shutdown, tests)."""
        done = threading.Event()
        self._queue.put(("barrier", done))
        done.wait(timeout_s)

    def stop(self, timeout_s: float = 30.0) -> None:
        """Finish the queue, then end the threads."""
        self._queue.put(("stop", None))
        self._thread.join(timeout_s)
        self._publisher.stop(timeout_s)
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _run(self) -> None:
        while True:
            kind, payload = self._queue.get()
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
            self._ledger.fail(*payload)
        elif kind == "abort":
            self._ledger.retire(payload)
        elif kind == "barrier":
            self._publisher.put(("barrier", payload))

    def _write_group(self, event: Any, pieces: list[Piece]) -> None:
        """Queue a group's rows on the pool; the publisher settles each piece in order."""
        event.synchronize()
        for piece in pieces:
            assembly = self._assembly_for(piece)
            futures = self._submit_writes(piece, assembly) if assembly is not None else []
            self._publisher.put(("piece", (piece, assembly, futures)))

    def _assembly_for(self, piece: Piece) -> Assembly | None:
        if piece.first:
            self._ledger.retire(piece.rid)  # a request started over under the same rid
            if not self._open_assembly(piece):
                return None
        return self._ledger.take(piece.rid)  # None: an earlier piece failed

    def _submit_writes(self, piece: Piece, assembly: Assembly) -> list[Future[None]]:
        """The pool's jobs for a piece: its rows in ``_JOB_BYTES`` slices, written as soon as they
        are staged, and its GPU moments, written once their own event completes. Without the
        GPU's moments (no GPU memory for them) each rows job computes them."""
        aux, final = piece.aux.numpy(), piece.final.numpy()
        aux_row, final_row = len(aux) // piece.n, len(final) // piece.n
        step = max(1, _JOB_BYTES // (aux_row + final_row))
        later = piece.moments is not None
        jobs = [
            self._pool.submit(
                functools.partial(assembly.writer.write_rows, moments_later=later),
                piece.start + row,
                aux[row * aux_row : (row + step) * aux_row],
                final[row * final_row : (row + step) * final_row],
            )
            for row in range(0, piece.n, step)
        ]
        if later:
            jobs.append(self._pool.submit(_write_moments, piece, assembly))
        return jobs

    def _open_assembly(self, piece: Piece) -> bool:
        need = piece.total * self.fmt.row_bytes
        if not self._wait_for_room(need):
            self._ledger.fail(
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
                moments=True,
            )
        except (OSError, ValueError) as exc:
            reason = f"could not create its dump in {self.config.dump_dir}: {exc}"
            self._ledger.fail(piece.rid, reason)
            return False
        self._ledger.start(piece.rid, Assembly(writer=writer, input_ids=piece.input_ids or ()))
        return True

    def _wait_for_room(self, need: int) -> bool:
        deadline = time.monotonic() + self.config.space_timeout_s
        while True:
            pending = self._ledger.pending_bytes(need, self.config.max_pending_bytes)
            fits = pending == 0 or pending + need <= self.config.max_pending_bytes
            if fits and _free_bytes(self.config.dump_dir) - need >= self.config.min_free_bytes:
                return True
            if time.monotonic() > deadline:
                return False
            time.sleep(0.05)


class _Publisher:
    """Settles pieces in the order they were queued: waits for their writes, frees their pinned
    memory, and has the pool publish each request whose rows are complete (publishing unmaps
    the files, ~15 ms for 117 MB, so one thread doing it all would set the pace)."""

    def __init__(
        self,
        ledger: Ledger,
        fmt: DumpFormat,
        release: Any,
        pool: ThreadPoolExecutor,
    ):
        self._ledger, self._fmt, self._release = ledger, fmt, release
        self._pool = pool
        self._publishing: set[Future[None]] = set()
        self._publishing_lock = threading.Lock()  # done callbacks run on pool threads
        self._queue: queue.Queue[tuple[str, Any]] = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="hsdump-publish", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def alive(self) -> bool:
        return self._thread.is_alive()

    def put(self, item: tuple[str, Any]) -> None:
        self._queue.put(item)

    def stop(self, timeout_s: float) -> None:
        self._queue.put(("stop", None))
        self._thread.join(timeout_s)

    def _run(self) -> None:
        while True:
            kind, payload = self._queue.get()
            if kind == "stop":
                return
            if kind == "barrier":
                with self._publishing_lock:
                    publishing = list(self._publishing)
                wait(publishing)
                payload.set()
                continue
            try:
                self._settle(*payload)
            except Exception:  # never let one request's failure end the thread
                logger.exception("hsdump: publishing a piece failed")

    def _settle(self, piece: Piece, assembly: Assembly | None, futures: list[Future[None]]) -> None:
        try:
            wait(futures)
        finally:
            self._release(piece.block)
        if assembly is None:
            return
        if self._ledger.settle(piece.rid, assembly, _write_error(piece, futures)):
            with self._publishing_lock:
                future = self._pool.submit(self._publish, piece.rid, assembly)
                self._publishing.add(future)
            future.add_done_callback(self._published)

    def _published(self, future: Future[None]) -> None:
        with self._publishing_lock:
            self._publishing.discard(future)

    def _publish(self, rid: str, assembly: Assembly) -> None:
        try:
            self._publish_now(rid, assembly)
        except Exception:  # on the pool: nobody else would see it
            logger.exception("hsdump: publishing %s failed", rid)

    def _publish_now(self, rid: str, assembly: Assembly) -> None:
        fmt, t = self._fmt, assembly.writer.num_tokens
        meta = DumpMeta(
            rid=rid,
            input_ids=list(assembly.input_ids),
            num_tokens=t,
            layer_ids=list(fmt.layer_ids),
            final_norm=fmt.final_norm,
            hidden_size=fmt.hidden_size,
            dtype=fmt.dtype,  # type: ignore[arg-type]
            aux_shape=(t, len(fmt.layer_ids), fmt.hidden_size),
            final_shape=(t, fmt.hidden_size),
            producer=fmt.producer,
            model_path=fmt.model_path,
            rank=fmt.rank,
            extra={"pieces": assembly.pieces},
        )
        try:
            path = assembly.writer.publish(meta)
        except (OSError, ValueError) as exc:
            assembly.writer.abort()
            self._ledger.fail(rid, f"publishing its dump failed: {exc}")
            return
        self._ledger.published(path, t)


def _write_moments(piece: Piece, assembly: Assembly) -> None:
    """Write a piece's GPU moments once they are in pinned memory (the wait releases the GIL)."""
    assert piece.moments is not None
    if piece.moments_ready is not None:
        piece.moments_ready.synchronize()
    assembly.writer.write_moments(piece.start, piece.moments.numpy().view(np.float32))


def _write_error(piece: Piece, futures: list[Future[None]]) -> str | None:
    """The first failure of a piece's row writes, as a reason; a bug is logged with its trace."""
    errors = [exc for exc in (f.exception() for f in futures) if exc is not None]
    if not errors:
        return None
    for exc in errors:
        if not isinstance(exc, OSError | ValueError):
            logger.error("hsdump: a row write failed unexpectedly", exc_info=exc)
    first, end = errors[0], piece.start + piece.n
    return f"writing rows [{piece.start}, {end}) failed: {type(first).__name__}: {first}"


def _free_bytes(path: Path) -> int:
    try:
        st = os.statvfs(path)
    except OSError:
        return 1 << 62  # a missing root is created on the first write; nothing to bound yet
    return st.f_bavail * st.f_frsize
