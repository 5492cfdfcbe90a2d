"""The dump root's names: directories, files, markers, request ids."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Literal

from hsdump._exceptions import (
    InvalidRequestId,
)

PROTOCOL_VERSION = 1
ENV_DUMP_DIR = "HSDUMP_DUMP_DIR"
DEFAULT_DUMP_DIR = "/dev/shm/hsdump"
DEFAULT_RID_PREFIX = "hsdump-"
REQ_PREFIX = "req_"
TMP_PREFIX = ".tmp-"
PRODUCERS_DIR = "_producers"
META_FILE = "meta.json"
AUX_FILE = "aux.bin"
FINAL_FILE = "final.bin"
DONE_MARKER = "done"
ERROR_MARKER = "error"

DType = Literal["bfloat16", "float16", "float32"]
_RID_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,199}")


def default_dump_dir() -> Path:
    """The dump root: ``$HSDUMP_DUMP_DIR`` if set, else ``/dev/shm/hsdump`` (read at call time)."""
    return Path(os.environ.get(ENV_DUMP_DIR) or DEFAULT_DUMP_DIR)


def validate_rid(rid: str) -> str:
    """Return ``rid`` if it is safe as a path component.

    A rid is 1-200 characters of ``[A-Za-z0-9._-]`` starting with a letter or digit, so it can never
    name a parent directory or escape the dump root.

    Raises:
        InvalidRequestId: ``rid`` is not such a name (a ``ValueError`` too).
    """
    if not isinstance(rid, str) or not _RID_RE.fullmatch(rid):
        shown = rid if not isinstance(rid, str) or len(rid) <= 60 else f"{rid[:60]}..."
        raise InvalidRequestId(
            f"request id {shown!r} is not a valid dump name: use 1-200 characters of "
            "[A-Za-z0-9._-] starting with a letter or digit (a producer dumps only such ids, "
            "so choose the rid prefix and ids within them)"
        )
    return rid


def is_opted_in(rid: object, prefix: str = DEFAULT_RID_PREFIX) -> bool:
    """Whether a producer should dump request ``rid``: it carries the opt-in prefix and is safe."""
    return isinstance(rid, str) and rid.startswith(prefix) and _RID_RE.fullmatch(rid) is not None


def request_dir(root: str | os.PathLike[str], rid: str) -> Path:
    """The published directory of request ``rid`` under ``root``."""
    return Path(root) / f"{REQ_PREFIX}{validate_rid(rid)}"
