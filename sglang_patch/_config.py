"""Plugin settings, read from ``HSDUMP_*`` environment variables at call time.

The server's scheduler processes inherit the launcher's environment, so one ``export`` before
``python -m sglang.launch_server`` configures every rank.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from hsdump._protocol import DEFAULT_RID_PREFIX, ENV_DUMP_DIR

__all__ = ["PluginConfig", "default_write_threads", "dump_enabled", "load_config"]

_MIB = 1 << 20


@dataclass(frozen=True)
class PluginConfig:
    """Everything the plugin reads from the environment.

    Attributes:
        dump_dir: The dump root (``HSDUMP_DUMP_DIR``).
        layer_ids: Aux layers to capture in the transformers convention (``HSDUMP_LAYER_IDS``,
            comma-separated; id ``i`` is the input of decoder layer ``i``), or None for the
            model's EAGLE-3 default.
        rid_prefix: Only requests whose rid starts with this are dumped (``HSDUMP_RID_PREFIX``).
        pinned_bytes: Size of the pinned host staging buffer (``HSDUMP_PINNED_MB``, default 4096:
            one prefill batch of 8 prompts of 2048 tokens at H=7168 stages 940 MB).
        max_pending_bytes: Bound on bytes published but not yet consumed plus bytes being written
            (``HSDUMP_MAX_PENDING_MB``); the writer waits above it.
        min_free_bytes: Free space the dump root's filesystem keeps (``HSDUMP_MIN_FREE_MB``).
        space_timeout_s: How long a dump waits for space before it is published as an error
            (``HSDUMP_SPACE_TIMEOUT_S``).
        partial_ttl_s: A partly assembled request not seen for this long is dropped, e.g. after an
            abort (``HSDUMP_PARTIAL_TTL_S``).
        write_threads: Threads that write one batch's rows into the dump files at once
            (``HSDUMP_WRITE_THREADS``; default: three quarters of the cores, 2 to 12). One thread
            writes tmpfs at ~2.5 GB/s, less than one H200 prefills at H=7168.
        profile_s: Log the time the plugin spends per stage every this many seconds
            (``HSDUMP_PROFILE_S``; unset: never).
        mapped_writes: Fill the dump files through memory maps (``HSDUMP_MAPPED_WRITES``, default
            1), so that several threads fill one file at once; 0: ``pwrite``, one thread per file
            at a time, and no page faults or unmaps in the scheduler process.
        gpu_staging_bytes: GPU memory for snapshots of rows whose copy to pinned memory runs on
            a stream of its own, beside the next forward (``HSDUMP_GPU_STAGING_MB``, default
            1024); 0 queues those copies on the forward's stream, which then waits for them.
        row_moments: Take each vector's sum and sum of squares on the GPU and write them beside
            the rows (``HSDUMP_ROW_MOMENTS``, default 1; the manifest announces them and the
            client's store uses them instead of computing its statistics); 0: none.
        switch_interval_s: The scheduler process's GIL switch interval
            (``HSDUMP_SWITCH_INTERVAL_US``, default 500; Python's own is 5000): how long a
            thread holds the GIL while another waits for it.
    """

    dump_dir: Path
    layer_ids: tuple[int, ...] | None = None
    rid_prefix: str = DEFAULT_RID_PREFIX
    pinned_bytes: int = 4096 * _MIB
    max_pending_bytes: int = 16384 * _MIB
    min_free_bytes: int = 1024 * _MIB
    space_timeout_s: float = 600.0
    partial_ttl_s: float = 600.0
    write_threads: int = 2
    profile_s: float = 0.0
    mapped_writes: bool = True
    gpu_staging_bytes: int = 1024 * _MIB
    row_moments: bool = True
    switch_interval_s: float = 0.0005


def dump_enabled() -> bool:
    """Whether ``HSDUMP_DUMP_DIR`` is set: the plugin does nothing otherwise."""
    return bool(os.environ.get(ENV_DUMP_DIR))


def load_config() -> PluginConfig:
    """Read the settings; raises ``ValueError`` naming the variable that is malformed."""
    root = os.environ.get(ENV_DUMP_DIR)
    if not root:
        raise ValueError(f"{ENV_DUMP_DIR} is not set: name the dump root, e.g. /dev/shm/hsdump")
    return PluginConfig(
        dump_dir=Path(root),
        layer_ids=_layer_ids(os.environ.get("HSDUMP_LAYER_IDS", "")),
        rid_prefix=os.environ.get("HSDUMP_RID_PREFIX") or DEFAULT_RID_PREFIX,
        pinned_bytes=_number("HSDUMP_PINNED_MB", 4096) * _MIB,
        max_pending_bytes=_number("HSDUMP_MAX_PENDING_MB", 16384) * _MIB,
        min_free_bytes=_number("HSDUMP_MIN_FREE_MB", 1024) * _MIB,
        space_timeout_s=float(_number("HSDUMP_SPACE_TIMEOUT_S", 600)),
        partial_ttl_s=float(_number("HSDUMP_PARTIAL_TTL_S", 600)),
        write_threads=_number("HSDUMP_WRITE_THREADS", default_write_threads()),
        profile_s=float(_number("HSDUMP_PROFILE_S", 0, allow_zero=True)),
        mapped_writes=_switch("HSDUMP_MAPPED_WRITES", True),
        gpu_staging_bytes=_number("HSDUMP_GPU_STAGING_MB", 1024, allow_zero=True) * _MIB,
        row_moments=_switch("HSDUMP_ROW_MOMENTS", True),
        switch_interval_s=_number("HSDUMP_SWITCH_INTERVAL_US", 500) / 1e6,
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


def _switch(name: str, default: bool) -> bool:
    text = os.environ.get(name)
    if not text:
        return default
    if text not in ("0", "1"):
        raise ValueError(f"{name}={text!r} must be 1 (on) or 0 (off)")
    return text == "1"


def _number(name: str, default: int, *, allow_zero: bool = False) -> int:
    text = os.environ.get(name)
    if not text:
        return default
    try:
        value = int(text)
    except ValueError:
        raise ValueError(f"{name}={text!r} is not an integer") from None
    if value < 0 or (value == 0 and not allow_zero):
        raise ValueError(f"{name}={text!r} must be positive")
    return value
