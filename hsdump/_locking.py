"""Whether another process holds an advisory lock: the store's part locks and the dump root's
client locks are both ``flock``s on files that outlive their holders."""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

__all__ = ["flock_held"]


def flock_held(path: Path) -> bool:
    """Whether a live process holds the ``flock`` on ``path`` (False when the file is missing).

    A free lock is taken for an instant to see that it is free, and let go at once.
    """
    try:
        fd = os.open(path, os.O_RDWR)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
    return False
