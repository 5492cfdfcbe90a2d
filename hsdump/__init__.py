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
    from hsdump._batching import LengthBucketSampler, pad_collate
    from hsdump._client import HiddenStateClient
    from hsdump._dataset import HiddenStateDataset
    from hsdump._export import ExportSummary, export_store
    from hsdump._parallel import run_parallel_extraction
    from hsdump._pipeline import Backoff, ExtractionSummary, run_extraction
    from hsdump._ray import run_ray_extraction
    from hsdump._reference import ReferenceServer
    from hsdump._store import HiddenStateStore, open_store
    from hsdump._watcher import DumpWatcher, InotifyWatcher, PollingWatcher, WatchfilesWatcher

__version__ = "0.1.0"

_LAZY = {
    "Backoff": "hsdump._pipeline",
    "ExportSummary": "hsdump._export",
    "ExtractionSummary": "hsdump._pipeline",
    "DumpWatcher": "hsdump._watcher",
    "HiddenStateClient": "hsdump._client",
    "HiddenStateDataset": "hsdump._dataset",
    "HiddenStateStore": "hsdump._store",
    "InotifyWatcher": "hsdump._watcher",
    "LengthBucketSampler": "hsdump._batching",
    "PollingWatcher": "hsdump._watcher",
    "ReferenceServer": "hsdump._reference",
    "WatchfilesWatcher": "hsdump._watcher",
    "export_store": "hsdump._export",
    "open_store": "hsdump._store",
    "pad_collate": "hsdump._batching",
    "run_extraction": "hsdump._pipeline",
    "run_parallel_extraction": "hsdump._parallel",
    "run_ray_extraction": "hsdump._ray",
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
