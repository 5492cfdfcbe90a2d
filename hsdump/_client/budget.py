"""A byte budget for the dump root: never more requested-but-not-ingested bytes than allowed."""

from __future__ import annotations

import os
from pathlib import Path

import anyio

from hsdump._settings import setting

__all__ = ["ByteBudget", "default_budget_bytes"]

DEFAULT_FRACTION = 0.5


def default_budget_bytes(root: Path) -> int:
    """``$HSDUMP_DUMP_BUDGET_BYTES``, else half of the free space of ``root``'s filesystem."""
    configured: int | None = setting("dump_budget_bytes")
    if configured is not None:
        return configured
    stats = os.statvfs(root)
    return int(stats.f_bavail * stats.f_frsize * DEFAULT_FRACTION)


class ByteBudget:
    """Counts bytes promised to dumps in flight; `acquire` waits while the budget is spent.

    A single request larger than the whole budget is let through alone rather than waiting forever.

    Args:
        limit: The most bytes that may be in flight at once.
    """

    def __init__(self, limit: int):
        self.limit = limit
        self.in_use = 0
        self.peak = 0
        self._changed = anyio.Condition()

    async def acquire(self, nbytes: int) -> None:
        """Wait until ``nbytes`` fit (or nothing else is in flight), then take them."""
        async with self._changed:
            while self.in_use and self.in_use + nbytes > self.limit:
                await self._changed.wait()
            self.in_use += nbytes
            self.peak = max(self.peak, self.in_use)

    async def release(self, nbytes: int) -> None:
        """Give back ``nbytes`` taken by `acquire`."""
        async with self._changed:
            self.in_use -= nbytes
            self._changed.notify_all()
