"""hsdump's settings: the ``HSDUMP_*`` fallbacks of the client's and the store's arguments.

`setting` reads one variable each time it runs, and only that one: a malformed variable stops
only what falls back to it, never a call whose argument gives the value. Nothing is read at
import, so a test changes a variable and the next call sees it. An empty value counts as unset.
The server plugin's variables (``HSDUMP_LAYER_IDS``, ``HSDUMP_PINNED_MB``...) share the prefix and
are not read here. ``hsdump._protocol.default_dump_dir`` keeps its own read of
``HSDUMP_DUMP_DIR``: the plugin imports that module in the server's environment, which has none
of the client's dependencies.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    NonNegativeFloat,
    PositiveFloat,
    PositiveInt,
    TypeAdapter,
    ValidationError,
)

from hsdump._exceptions import ConfigError
from hsdump._protocol import DEFAULT_DUMP_DIR

__all__ = ["ENV_PREFIX", "Settings", "setting"]

ENV_PREFIX = "HSDUMP_"


class Settings(BaseModel):
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

    model_config = ConfigDict(frozen=True)

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


def setting(name: str) -> Any:
    """The setting ``name`` (a field of `Settings`) as its variable holds it now, else its default.

    Raises:
        ConfigError: The variable is malformed; the message names it, its value and what it takes.
    """
    field = Settings.model_fields[name]
    variable = ENV_PREFIX + name.upper()
    text = next((v for k, v in os.environ.items() if k.upper() == variable and v), None)
    if text is None:
        return field.default
    try:
        return _adapter(name).validate_python(text)
    except ValidationError as exc:
        raise ConfigError(
            f"{variable} is {text!r}, expected {field.description}: set a valid value, or unset "
            "it for the default"
        ) from exc


@functools.cache
def _adapter(name: str) -> TypeAdapter[Any]:
    field = Settings.model_fields[name]
    annotated: Any = field.annotation
    if field.metadata:
        annotated = Annotated[(annotated, *field.metadata)]  # the field's constraints
    return TypeAdapter(annotated)
