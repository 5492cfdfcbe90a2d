"""hsdump's settings: ``HSDUMP_*`` environment variables, read each time `settings` runs.

Nothing is read at import, so a test (or a parent process sizing its workers) changes a variable
and the next call sees it. An empty value counts as unset. The server plugin's variables
(``HSDUMP_LAYER_IDS``, ``HSDUMP_PINNED_MB``...) share the prefix and are ignored here.
``hsdump._protocol.default_dump_dir`` keeps its own read of ``HSDUMP_DUMP_DIR``: the plugin imports
that module in the server's environment, which has no pydantic-settings.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path
from typing import Literal

from pydantic import Field, NonNegativeFloat, PositiveFloat, PositiveInt, ValidationError
from pydantic_settings import BaseSettings, SettingsConfigDict

from hsdump._exceptions import ConfigError
from hsdump._protocol import DEFAULT_DUMP_DIR

__all__ = ["ENV_PREFIX", "Settings", "settings"]

ENV_PREFIX = "HSDUMP_"


class Settings(BaseSettings):
    """The client's and the store's settings; each field is ``HSDUMP_<FIELD>`` in upper case.

    Attributes:
        dump_dir: The dump root a client reads when given none.
        watcher: How a client waits for dumps (``inotify``, ``poll`` or ``watchfiles``); None:
            inotify where the platform has it, else polling.
        dump_budget_bytes: Bytes of requested but not yet read dumps; None: half of the dump
            root's free space.
        cores: Cores the thread pools are sized by; None: this process's CPU affinity.
        lease_ttl_s: Seconds a store part's lease on object storage lives without renewal.
        commit_interval_s: Seconds between a store writer's commits while it writes.
        shard_writers: Store shards written at once; None: one per two cores, 2 to 8.
    """

    model_config = SettingsConfigDict(
        env_prefix=ENV_PREFIX, frozen=True, extra="ignore", env_ignore_empty=True
    )

    dump_dir: Path = Field(default=Path(DEFAULT_DUMP_DIR), description="a directory path")
    watcher: Literal["inotify", "poll", "watchfiles"] | None = Field(
        default=None, description="one of inotify, poll, watchfiles"
    )
    dump_budget_bytes: PositiveInt | None = Field(
        default=None, description="a whole number of bytes above 0, for example 2000000000 for 2 GB"
    )
    cores: PositiveInt | None = Field(default=None, description="a whole number of cores above 0")
    lease_ttl_s: PositiveFloat = Field(default=60.0, description="a number of seconds above 0")
    commit_interval_s: NonNegativeFloat = Field(
        default=1.0, description="a number of seconds, 0 or more"
    )
    shard_writers: PositiveInt | None = Field(default=None, description="a whole number above 0")


def settings() -> Settings:
    """The settings as the environment holds them now.

    Raises:
        ConfigError: A variable is malformed; the message names it, its value and what it takes.
    """
    return _settings_for(_variables())


def _variables() -> tuple[tuple[str, str], ...]:
    """This process's ``HSDUMP_*`` variables now: the cache key of the settings they make."""
    return tuple(
        sorted(i for i in os.environ.items() if i[0][: len(ENV_PREFIX)].upper() == ENV_PREFIX)
    )


# Building the model costs ~0.5 ms (pydantic-settings parses the whole environment); reading the
# variables ~20 us. Pools, writers and clients ask for settings often.
@functools.lru_cache(maxsize=16)
def _settings_for(variables: tuple[tuple[str, str], ...]) -> Settings:
    try:
        return Settings()
    except ValidationError as exc:
        raise _config_error(exc) from exc


def _config_error(exc: ValidationError) -> ConfigError:
    problems = []
    for error in exc.errors():
        name = str(error["loc"][0])
        wants = Settings.model_fields[name].description
        problems.append(f"{ENV_PREFIX}{name.upper()} is {error['input']!r}, expected {wants}")
    return ConfigError(f"{'; '.join(problems)}: set a valid value, or unset it for the default")
