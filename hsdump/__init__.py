"""hsdump: verified hidden states from an inference server into a compressed Zarr store.

Importing ``hsdump`` does no work: names are loaded from their modules on first use, so
``import hsdump`` pulls in neither torch, zarr nor httpx.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from hsdump._exceptions import (
    ConfigError,
    DegenerateValues,
    DtypeMismatch,
    DumpError,
    DumpFailed,
    DumpTimeout,
    DumpValidationError,
    ExportError,
    HsdumpError,
    InputError,
    LayerMismatch,
    NonFiniteValues,
    ProvenanceMismatch,
    RidMismatch,
    SampleExistsError,
    SampleNotFoundError,
    ServerConfigError,
    ServerError,
    ServerNotDumping,
    ServerResponseError,
    ServerTimeout,
    ServerUnavailable,
    ShapeMismatch,
    StoreCorruptedError,
    StoreError,
    TokenMismatch,
    WorkerError,
)
from hsdump._types import HiddenStates, Sample

if TYPE_CHECKING:
    from hsdump._client.client import HiddenStateClient
    from hsdump._client.watcher import (
        DumpWatcher,
        InotifyWatcher,
        PollingWatcher,
        WatchfilesWatcher,
    )
    from hsdump._run.dataset import HiddenStateDataset
    from hsdump._run.parallel import run_parallel_extraction
    from hsdump._run.pipeline import Backoff, ExtractionSummary, run_extraction
    from hsdump._run.ray_driver import run_ray_extraction
    from hsdump._servers.reference import ReferenceServer
    from hsdump._store.store import HiddenStateStore, open_store
    from hsdump._training.batching import LengthBucketSampler, pad_collate
    from hsdump._training.export import ExportSummary, export_store

__version__ = "0.1.0"

_LAZY = {
    "Backoff": "hsdump._run.pipeline",
    "ExportSummary": "hsdump._training.export",
    "ExtractionSummary": "hsdump._run.pipeline",
    "DumpWatcher": "hsdump._client.watcher",
    "HiddenStateClient": "hsdump._client.client",
    "HiddenStateDataset": "hsdump._run.dataset",
    "HiddenStateStore": "hsdump._store.store",
    "InotifyWatcher": "hsdump._client.watcher",
    "LengthBucketSampler": "hsdump._training.batching",
    "PollingWatcher": "hsdump._client.watcher",
    "ReferenceServer": "hsdump._servers.reference",
    "WatchfilesWatcher": "hsdump._client.watcher",
    "export_store": "hsdump._training.export",
    "open_store": "hsdump._store.store",
    "pad_collate": "hsdump._training.batching",
    "run_extraction": "hsdump._run.pipeline",
    "run_parallel_extraction": "hsdump._run.parallel",
    "run_ray_extraction": "hsdump._run.ray_driver",
}

__all__ = [
    "Backoff",
    "ConfigError",
    "DegenerateValues",
    "DtypeMismatch",
    "DumpError",
    "DumpFailed",
    "DumpTimeout",
    "DumpValidationError",
    "DumpWatcher",
    "ExportError",
    "ExportSummary",
    "ExtractionSummary",
    "HiddenStateClient",
    "HiddenStateDataset",
    "HiddenStateStore",
    "HiddenStates",
    "HsdumpError",
    "InotifyWatcher",
    "InputError",
    "LayerMismatch",
    "LengthBucketSampler",
    "NonFiniteValues",
    "PollingWatcher",
    "ProvenanceMismatch",
    "ReferenceServer",
    "RidMismatch",
    "Sample",
    "SampleExistsError",
    "SampleNotFoundError",
    "ServerConfigError",
    "ServerError",
    "ServerNotDumping",
    "ServerResponseError",
    "ServerTimeout",
    "ServerUnavailable",
    "ShapeMismatch",
    "StoreCorruptedError",
    "StoreError",
    "TokenMismatch",
    "WatchfilesWatcher",
    "WorkerError",
    "__version__",
    "export_store",
    "open_store",
    "pad_collate",
    "run_extraction",
    "run_parallel_extraction",
    "run_ray_extraction",
]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'hsdump' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
