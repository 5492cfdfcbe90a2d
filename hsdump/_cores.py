"""How many cores this process may use: the one number every thread pool is sized by."""

from __future__ import annotations

import os

from hsdump._settings import settings

__all__ = ["ENV_CORES", "cores"]

# Set by the parent of a multi-process extraction for each worker, so that N workers on one host
# share its cores instead of each sizing its pools by all of them.
ENV_CORES = "HSDUMP_CORES"


def cores() -> int:
    """``$HSDUMP_CORES`` if set, else the cores this process may run on (its CPU affinity).

    Raises:
        ConfigError: ``HSDUMP_CORES`` is not a whole number above 0.
    """
    configured = settings().cores
    if configured is not None:
        return configured
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1
