"""The per-rank dumper: plans a prefill batch, stages its rows, feeds the writer thread."""

from __future__ import annotations

import logging
import time
from typing import Any

import torch

from hsdump._protocol import dtype_of_torch, dtype_spec
from sglang_patch._config import PluginConfig
from sglang_patch._plan import BatchPlan, ChunkPlanner
from sglang_patch._staging import PinnedRing, Stager
from sglang_patch._writer import DumpFormat, WriterThread

__all__ = ["Dumper", "torch_dtype_name"]

logger = logging.getLogger(__name__)


def torch_dtype_name(dtype: torch.dtype) -> str:
    """The protocol name of a torch dtype; raises ``InputError`` (a ``ValueError``) for one the
    protocol lacks."""
    return dtype_of_torch(dtype).name


class Dumper:
    """Dumps the opted-in requests of every prefill batch one rank runs.

    Args:
        config: The plugin settings.
        fmt: The dump format (layers, hidden size, dtype, producer).
        pin: Pin the staging buffer (True on CUDA).
    """

    def __init__(self, config: PluginConfig, fmt: DumpFormat, *, pin: bool):
        if config.pinned_bytes < 4 * fmt.row_bytes:
            raise ValueError(
                f"HSDUMP_PINNED_MB={config.pinned_bytes >> 20} is too small for one token of "
                f"{fmt.row_bytes} bytes: raise it"
            )
        self.config, self.fmt = config, fmt
        self.writer = WriterThread(config, fmt, release=self._release)
        self.ring = PinnedRing(config.pinned_bytes, pin=pin, alive=self.writer.alive)
        self.planner = ChunkPlanner()
        self.stager = Stager(
            self.ring,
            num_layers=len(fmt.layer_ids),
            hidden_size=fmt.hidden_size,
            submit=self.writer.submit_rows,
        )
        self._next_expiry = time.monotonic() + config.partial_ttl_s
        self.writer.start()

    def on_forward(self, batch: Any, logits_output: Any) -> None:
        """Handle one EXTEND/MIXED batch right after its forward was queued."""
        self._expire()
        plan = self.planner.plan(batch)
        for rid, reason in plan.errors:
            self.writer.submit_error(rid, reason)
        if not plan.slices:
            return
        hidden: Any = getattr(logits_output, "hidden_states", None)
        problem = self._check(hidden, plan)
        if problem is not None:
            for piece in plan.slices:
                self.planner.forget(piece.rid)
                self.writer.submit_error(piece.rid, problem)
            return
        try:
            for s in plan.slices:
                self.stager.stage(
                    hidden, s.rid, s.row, s.n, s.start, total=s.total, input_ids=s.input_ids
                )
        finally:
            self.stager.flush()

    def describe(self) -> str:
        """How this rank stages, for the start-up log line."""
        return (
            f"this rank writes, {self.ring.capacity >> 20} MB pinned, "
            f"{self.config.write_threads} write threads"
        )

    def close(self) -> None:
        """Write what is queued and stop the writer thread."""
        self.writer.stop()

    def _release(self, block: Any) -> None:
        self.ring.free(block)

    def _check(self, hidden: Any, plan: BatchPlan) -> str | None:
        k, h = len(self.fmt.layer_ids), self.fmt.hidden_size
        if not isinstance(hidden, torch.Tensor):
            return (
                "the forward returned no hidden states: start the server with "
                "--enable-return-hidden-states (full capture mode)"
            )
        if hidden.dim() != 2 or hidden.shape[0] < plan.rows or hidden.shape[1] != (k + 1) * h:
            return (
                f"the forward's hidden states have shape {list(hidden.shape)}, expected at least "
                f"[{plan.rows}, {(k + 1) * h}] ({k} aux layers plus the final state, H={h}); "
                "another plugin or server option may have changed the capture"
            )
        if hidden.dtype != dtype_spec(self.fmt.dtype).torch_dtype():
            return f"hidden states are {hidden.dtype}, the producer manifest says {self.fmt.dtype}"
        return None

    def _expire(self) -> None:
        now = time.monotonic()
        if now < self._next_expiry:
            return
        self._next_expiry = now + min(self.config.partial_ttl_s, 60.0)
        for rid in self.planner.expire(self.config.partial_ttl_s):
            logger.warning("hsdump: request %s stopped mid-prefill (aborted?); dropping it", rid)
            self.writer.submit_abort(rid)
