"""`StoreOptions`: the store's settings, passed to `open_store`, with ``HSDUMP_*`` fallbacks."""

from __future__ import annotations

from dataclasses import dataclass

from hsdump._cores import cores
from hsdump._exceptions import ConfigError
from hsdump._settings import setting

__all__ = ["StoreOptions"]


@dataclass(frozen=True, kw_only=True)
class StoreOptions:
    """How a store writes; each field left None falls back to its ``HSDUMP_*`` variable, read
    when the store opens, then to its default.

    Attributes:
        commit_interval_s: Seconds between a writer's commits while it writes
            (``HSDUMP_COMMIT_INTERVAL_S``, 1); 0 commits each shard. A killed writer redoes at
            most that much.
        shard_writers: Full shards written at once, each holding a shard buffer in memory
            (``HSDUMP_SHARD_WRITERS``; one per two cores, 2 to 8).
        lease_ttl_s: Seconds a part's lease on object storage lives without renewal
            (``HSDUMP_LEASE_TTL_S``, 60).
        cores: Cores the codec pool and the shard writers are sized by (``HSDUMP_CORES``; the
            process's CPU affinity). The codec pool is one per process, sized when first used.

    Raises:
        ConfigError: A value out of range.
    """

    commit_interval_s: float | None = None
    shard_writers: int | None = None
    lease_ttl_s: float | None = None
    cores: int | None = None

    def __post_init__(self) -> None:
        for name in ("shard_writers", "lease_ttl_s", "cores"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ConfigError(f"StoreOptions.{name} must be above 0, got {value}")
        if self.commit_interval_s is not None and self.commit_interval_s < 0:
            raise ConfigError(
                f"StoreOptions.commit_interval_s must be 0 or more, got {self.commit_interval_s}"
            )

    def resolved(self) -> StoreOptions:
        """Every field set: the argument, else the environment now, else the default.

        Raises:
            ConfigError: An ``HSDUMP_*`` variable is malformed.
        """
        n = cores(self.cores)
        writers = self.shard_writers or setting("shard_writers") or max(2, min(8, n // 2))
        return StoreOptions(
            commit_interval_s=_given(self.commit_interval_s, "commit_interval_s"),
            shard_writers=writers,
            lease_ttl_s=_given(self.lease_ttl_s, "lease_ttl_s"),
            cores=n,
        )


def _given(value: float | None, name: str) -> float:
    """``value``, else the setting ``name``: its variable is read only when it is needed."""
    return value if value is not None else float(setting(name))
