"""Plugin settings, read from ``HSDUMP_*`` environment variables at call time.

The server's scheduler processes inherit the launcher's environment, so one ``export`` before
``python -m sglang.launch_server`` configures every rank.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from hsdump._protocol import ENV_DUMP_DIR, FinalNorm

__all__ = [
    "MIN_FREE_BYTES",
    "PARTIAL_TTL_S",
    "SPACE_TIMEOUT_S",
    "PluginConfig",
    "allow_untested_sglang",
    "default_write_threads",
    "dump_enabled",
    "load_config",
]

_MIB = 1 << 20
_ALLOW_UNTESTED = "HSDUMP_ALLOW_UNTESTED_SGLANG"

#: Free space the dump root's filesystem keeps.
MIN_FREE_BYTES = 1024 * _MIB
#: How long a dump waits for room in the dump root before it is published as an error.
SPACE_TIMEOUT_S = 600.0
#: A partly assembled request not seen for this long is dropped (e.g. after an abort).
PARTIAL_TTL_S = 600.0


@dataclass(frozen=True)
class PluginConfig:
    """Everything the plugin reads from the environment.

    Attributes:
        dump_dir: The dump root (``HSDUMP_DUMP_DIR``).
        layer_ids: Aux layers to capture in the transformers convention (``HSDUMP_LAYER_IDS``,
            comma-separated; id ``i`` is the input of decoder layer ``i``), or None for the
            model's EAGLE-3 default.
        final_norm: The final state to dump (``HSDUMP_FINAL_NORM``): ``post_norm`` (default),
            the lm_head input that SpecForge trains on, or ``pre_norm``, the residual stream
            after the last decoder layer, which speculators normalises itself.
        pinned_bytes: Size of the pinned host staging buffer (``HSDUMP_PINNED_MB``, default 4096:
            one prefill batch of 8 prompts of 2048 tokens at H=7168 stages 940 MB).
        max_pending_bytes: Bound on bytes published but not yet consumed plus bytes being written
            (``HSDUMP_MAX_PENDING_MB``); the writer waits above it.
        write_threads: Threads that write one batch's rows into the dump files at once
            (``HSDUMP_WRITE_THREADS``; default: three quarters of the cores, 2 to 12). One thread
            writes tmpfs at ~2.5 GB/s, less than one H200 prefills at H=7168.
        min_free_bytes: Free space the dump root's filesystem keeps (`MIN_FREE_BYTES`).
        space_timeout_s: How long a dump waits for room (`SPACE_TIMEOUT_S`).
        partial_ttl_s: When a partly assembled request is dropped (`PARTIAL_TTL_S`).
    """

    dump_dir: Path
    layer_ids: tuple[int, ...] | None = None
    final_norm: FinalNorm = "post_norm"
    pinned_bytes: int = 4096 * _MIB
    max_pending_bytes: int = 16384 * _MIB
    write_threads: int = 2
    min_free_bytes: int = MIN_FREE_BYTES
    space_timeout_s: float = SPACE_TIMEOUT_S
    partial_ttl_s: float = PARTIAL_TTL_S


def dump_enabled() -> bool:
    """Whether ``HSDUMP_DUMP_DIR`` is set: the plugin does nothing otherwise."""
    return bool(os.environ.get(ENV_DUMP_DIR))


def allow_untested_sglang() -> bool:
    """Whether ``HSDUMP_ALLOW_UNTESTED_SGLANG`` asks to run on an SGLang release not checked."""
    return os.environ.get(_ALLOW_UNTESTED, "") not in ("", "0")


def load_config() -> PluginConfig:
    """Read the settings; raises ``ValueError`` naming the variable that is malformed."""
    root = os.environ.get(ENV_DUMP_DIR)
    if not root:
        raise ValueError(f"{ENV_DUMP_DIR} is not set: name the dump root, e.g. /dev/shm/hsdump")
    return PluginConfig(
        dump_dir=Path(root),
        layer_ids=_layer_ids(os.environ.get("HSDUMP_LAYER_IDS", "")),
        final_norm=_final_norm(os.environ.get("HSDUMP_FINAL_NORM", "")),
        pinned_bytes=_number("HSDUMP_PINNED_MB", 4096) * _MIB,
        max_pending_bytes=_number("HSDUMP_MAX_PENDING_MB", 16384) * _MIB,
        write_threads=_number("HSDUMP_WRITE_THREADS", default_write_threads()),
    )


def default_write_threads() -> int:
    """Three quarters of the cores, 2 to 12. tmpfs writes scale to ~8 threads (18.7 GB/s on an
    H200 host), but at 8 requests in flight a dump's latency sets the pace: on that host's 16
    cores, dump-only reached 0.83 / 0.91 / 0.89 of the server alone with 8 / 12 / 16 threads."""
    return max(2, min(12, (os.cpu_count() or 2) * 3 // 4))


def _layer_ids(text: str) -> tuple[int, ...] | None:
    if not text.strip():
        return None
    try:
        ids = tuple(int(part) for part in text.replace(" ", "").split(","))
    except ValueError:
        raise ValueError(
            f"HSDUMP_LAYER_IDS={text!r} is not a comma-separated list of integers, e.g. 2,30,58"
        ) from None
    if list(ids) != sorted(set(ids)) or ids[0] < 1:
        raise ValueError(
            f"HSDUMP_LAYER_IDS={text!r} must be increasing, distinct and >= 1 "
            "(id i is the input of decoder layer i; 0, the embeddings, cannot be captured)"
        )
    return ids


def _final_norm(text: str) -> FinalNorm:
    value = text.strip() or "post_norm"
    if value == "pre_norm":
        return "pre_norm"
    if value != "post_norm":
        raise ValueError(
            f"HSDUMP_FINAL_NORM={text!r} is neither post_norm (the lm_head input, for SpecForge) "
            "nor pre_norm (the last decoder layer's output before the final norm, for speculators)"
        )
    return "post_norm"


def _number(name: str, default: int) -> int:
    text = os.environ.get(name)
    if not text:
        return default
    try:
        value = int(text)
    except ValueError:
        raise ValueError(f"{name}={text!r} is not an integer") from None
    if value <= 0:
        raise ValueError(f"{name}={text!r} must be positive")
    return value
