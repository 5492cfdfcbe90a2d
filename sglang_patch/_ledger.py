"""What the plugin's writer knows about each request: being assembled, failed, or published.

Two threads share it. The coordinating thread opens requests and queues their rows on the write
pool; the publishing thread settles each piece once its rows are written, and publishes a request
whose rows cover it. A request may be dropped (an error, an abort) while rows of it are still being
written, so its files are closed only once no write into them is in flight.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from dataclasses import dataclass
from pathlib import Path

from hsdump._protocol import DumpWriter, ProducerInfo, write_error

__all__ = ["Assembly", "Ledger"]

logger = logging.getLogger(__name__)


@dataclass
class Assembly:
    """One request's dump being written: its files, and pieces queued or settled."""

    writer: DumpWriter
    input_ids: tuple[int, ...]
    pieces: int = 0
    inflight: int = 0
    retired: bool = False


class Ledger:
    """The requests being assembled, failed and published, behind one lock.

    Args:
        dump_dir: The dump root (error markers go there).
        producer: Written into error markers.
        row_bytes: Bytes of one token, for the bytes-pending bound.
    """

    def __init__(self, dump_dir: Path, producer: ProducerInfo, row_bytes: int):
        self.dump_dir, self.producer, self.row_bytes = dump_dir, producer, row_bytes
        self.lock = threading.RLock()
        self.open: dict[str, Assembly] = {}
        self._failed: deque[str] = deque(maxlen=4096)
        self._published: deque[tuple[Path, int]] = deque()
        self._published_bytes = 0

    def start(self, rid: str, assembly: Assembly) -> None:
        """Track a newly opened request (any earlier attempt was retired first)."""
        with self.lock:
            if rid in self._failed:
                self._failed.remove(rid)
            self.open[rid] = assembly

    def take(self, rid: str) -> Assembly | None:
        """The open assembly of ``rid`` with one more piece in flight; None if it failed."""
        with self.lock:
            assembly = self.open.get(rid)
            if assembly is not None:
                assembly.inflight += 1
            return assembly

    def retire(self, rid: str) -> None:
        """Drop ``rid``'s partial dump; its files go once no write into them is in flight."""
        with self.lock:
            assembly = self.open.pop(rid, None)
            if assembly is not None:
                assembly.retired = True
                self._abort_if_idle(assembly)

    def fail(self, rid: str, reason: str) -> None:
        """Drop ``rid``'s rows and publish one error marker for it."""
        with self.lock:
            self.retire(rid)
            if rid in self._failed:
                return  # one error marker per request
            self._failed.append(rid)
        logger.warning("hsdump: %s", reason)
        try:
            write_error(self.dump_dir, rid, reason, self.producer)
        except OSError:
            logger.exception("hsdump: could not publish the error marker of %s", rid)

    def settle(self, rid: str, assembly: Assembly, error: str | None) -> bool:
        """Account for one written piece; True when the request is complete and now unlisted."""
        with self.lock:
            assembly.inflight -= 1
            if assembly.retired:
                self._abort_if_idle(assembly)
                return False
            if error is not None:
                self.fail(rid, error)
                return False
            assembly.pieces += 1
            if assembly.inflight or not assembly.writer.coverage_complete():
                return False
            del self.open[rid]
            return True

    def published(self, path: Path, tokens: int) -> None:
        """Count a published dump against the pending bound until the client removes it."""
        with self.lock:
            self._published.append((path, tokens * self.row_bytes))
            self._published_bytes += tokens * self.row_bytes

    def pending_bytes(self, need: int, bound: int) -> int:
        """Bytes being written plus published and not yet consumed."""
        with self.lock:
            writing = sum(a.writer.num_tokens for a in self.open.values()) * self.row_bytes
            if writing + self._published_bytes + need > bound:
                # Published dumps count until the client removes them: forget those consumed.
                kept = deque((p, size) for p, size in self._published if p.exists())
                self._published, self._published_bytes = kept, sum(size for _, size in kept)
            return writing + self._published_bytes

    @staticmethod
    def _abort_if_idle(assembly: Assembly) -> None:
        if assembly.inflight == 0:
            assembly.writer.abort()
