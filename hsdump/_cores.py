"""How many cores this process's thread pools are sized by."""

from __future__ import annotations

import os

from hsdump._settings import setting

__all__ = ["EXTRACTION_SWITCH_INTERVAL_S", "cores"]

#: The interpreter's switch interval in hsdump's own extraction processes (the ``hsdump`` command
#: and its workers; Python's own is 5 ms). Every numpy call of a placement or codec job gives the
#: interpreter lock up, and taking it back waits while another thread runs Python, up to one
#: interval: beside the event loop, 16 placement threads placed 1.0 GB/s at 5 ms against 4.0 at
#: 0.5 ms on the GPU host. The library itself leaves the interval alone.
EXTRACTION_SWITCH_INTERVAL_S = 0.0005


def cores(configured: int | None = None) -> int:
    """``configured`` if given, else ``$HSDUMP_CORES`` if set, else this process's CPU affinity.

    Raises:
        ConfigError: ``HSDUMP_CORES`` is not a whole number above 0.
    """
    if configured is not None:
        return configured
    configured = setting("cores")
    if configured is not None:
        return configured
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1
