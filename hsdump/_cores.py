"""How this process uses its cores: how many its thread pools are sized by, and how often its
threads hand the interpreter lock to each other."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager

from hsdump._settings import settings

__all__ = ["ENV_CORES", "cores", "switch_interval"]

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


@contextmanager
def switch_interval() -> Iterator[None]:
    """Run the block with the interpreter's switch interval at ``HSDUMP_SWITCH_INTERVAL_US``,
    then put back the one before.

    Every numpy call of a codec or placement job gives the interpreter lock up, and taking it
    back waits while another thread runs Python, up to one switch interval. Beside a thread that
    runs Python (the event loop of a client, the store's writer), 16 placement threads placed
    1.0 GB/s at Python's 5 ms against 4.0 at 0.5 ms, and 8-10 GB/s with nothing beside them
    (tests/gpu/gil_probe.py; docs/performance.md).

    Raises:
        ConfigError: ``HSDUMP_SWITCH_INTERVAL_US`` is not a whole number above 0.
    """
    before = sys.getswitchinterval()
    sys.setswitchinterval(settings().switch_interval_us / 1e6)
    try:
        yield
    finally:
        sys.setswitchinterval(before)
