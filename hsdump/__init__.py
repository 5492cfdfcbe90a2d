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
    InvalidRequestId,
    LayerMismatch,
    MomentsMismatch,
    NonFiniteValues,
    NotAStoreError,
    PartLockedError,
    PartLockLostError,
    ProvenanceMismatch,
    RidMismatch,
    SampleExistsError,
    SampleNotFoundError,
    ServerConfigError,
    ServerError,
    ServerNotDumping,
    ServerResponseError,
    ServerStartError,
    ServerTimeout,
    ServerUnavailable,
    ShapeMismatch,
    StoreClosedError,
    StoreCorruptedError,
    StoreError,
    StoreExistsError,
    StoreIOError,
    StoreNotFoundError,
    StoreReadOnlyError,
    StoreWriteFailedError,
    TokenMismatch,
    WorkerError,
)
from hsdump._types import HiddenStates, Sample

if TYPE_CHECKING:
    from hsdump._client.client import ClientStats, HiddenStateClient
    from hsdump._client.sending import RequestSender, ServerAnswer
    from hsdump._client.watcher import (
        DumpWatcher,
        InotifyWatcher,
        PollingWatcher,
        WatchfilesWatcher,
    )
    from hsdump._protocol import DumpMeta, ProducerInfo
    from hsdump._run.common import Backoff, ExtractionSummary, Failure, RunOptions
    from hsdump._run.parallel import run_parallel_extraction
    from hsdump._run.pipeline import run_extraction
    from hsdump._run.ray_driver import run_ray_extraction
    from hsdump._servers.reference import ReferenceServer
    from hsdump._store.options import StoreOptions
    from hsdump._store.provenance import Provenance
    from hsdump._store.reader import CorruptSample, VerifyReport
    from hsdump._store.stats import LayerStats
    from hsdump._store.store import HiddenStateStore, open_store, verify_store
    from hsdump._training.batching import LengthBucketSampler, pad_collate
    from hsdump._training.collate import SpecForgeCollate, SpeculatorsCollate
    from hsdump._training.dataset import HiddenStateDataset
    from hsdump._training.export import ExportSummary, export_store

__version__ = "0.1.0"

# Names loaded from their modules on first use (see __getattr__).
_LAZY = {
    "Backoff": "hsdump._run.common",
    "ClientStats": "hsdump._client.client",
    "CorruptSample": "hsdump._store.reader",
    "DumpMeta": "hsdump._protocol",
    "DumpWatcher": "hsdump._client.watcher",
    "ExportSummary": "hsdump._training.export",
    "ExtractionSummary": "hsdump._run.common",
    "Failure": "hsdump._run.common",
    "HiddenStateClient": "hsdump._client.client",
    "HiddenStateDataset": "hsdump._training.dataset",
    "HiddenStateStore": "hsdump._store.store",
    "InotifyWatcher": "hsdump._client.watcher",
    "LayerStats": "hsdump._store.stats",
    "LengthBucketSampler": "hsdump._training.batching",
    "PollingWatcher": "hsdump._client.watcher",
    "ProducerInfo": "hsdump._protocol",
    "Provenance": "hsdump._store.provenance",
    "ReferenceServer": "hsdump._servers.reference",
    "RunOptions": "hsdump._run.common",
    "RequestSender": "hsdump._client.sending",
    "ServerAnswer": "hsdump._client.sending",
    "SpecForgeCollate": "hsdump._training.collate",
    "SpeculatorsCollate": "hsdump._training.collate",
    "StoreOptions": "hsdump._store.options",
    "VerifyReport": "hsdump._store.reader",
    "WatchfilesWatcher": "hsdump._client.watcher",
    "export_store": "hsdump._training.export",
    "open_store": "hsdump._store.store",
    "pad_collate": "hsdump._training.batching",
    "run_extraction": "hsdump._run.pipeline",
    "run_parallel_extraction": "hsdump._run.parallel",
    "run_ray_extraction": "hsdump._run.ray_driver",
    "verify_store": "hsdump._store.store",
}

__all__ = [
    "Backoff",
    "ClientStats",
    "ConfigError",
    "CorruptSample",
    "DegenerateValues",
    "DtypeMismatch",
    "DumpError",
    "DumpFailed",
    "DumpMeta",
    "DumpTimeout",
    "DumpValidationError",
    "DumpWatcher",
    "ExportError",
    "ExportSummary",
    "ExtractionSummary",
    "Failure",
    "HiddenStateClient",
    "HiddenStateDataset",
    "HiddenStateStore",
    "HiddenStates",
    "HsdumpError",
    "InotifyWatcher",
    "InputError",
    "InvalidRequestId",
    "LayerMismatch",
    "LayerStats",
    "LengthBucketSampler",
    "MomentsMismatch",
    "NonFiniteValues",
    "NotAStoreError",
    "PartLockLostError",
    "PartLockedError",
    "PollingWatcher",
    "ProducerInfo",
    "Provenance",
    "ProvenanceMismatch",
    "ReferenceServer",
    "RequestSender",
    "RidMismatch",
    "RunOptions",
    "Sample",
    "SampleExistsError",
    "SampleNotFoundError",
    "ServerAnswer",
    "ServerConfigError",
    "ServerError",
    "ServerNotDumping",
    "ServerResponseError",
    "ServerStartError",
    "ServerTimeout",
    "ServerUnavailable",
    "ShapeMismatch",
    "SpecForgeCollate",
    "SpeculatorsCollate",
    "StoreClosedError",
    "StoreCorruptedError",
    "StoreError",
    "StoreExistsError",
    "StoreIOError",
    "StoreNotFoundError",
    "StoreOptions",
    "StoreReadOnlyError",
    "StoreWriteFailedError",
    "TokenMismatch",
    "VerifyReport",
    "WatchfilesWatcher",
    "WorkerError",
    "__version__",
    "export_store",
    "open_store",
    "pad_collate",
    "run_extraction",
    "run_parallel_extraction",
    "run_ray_extraction",
    "verify_store",
]


# Public names say they come from ``hsdump``, not from the private module that defines them (as
# httpx does): reprs, tracebacks and pickles name the import path users are meant to use.
for _name in __all__:
    if _name not in _LAZY and not _name.startswith("__"):
        globals()[_name].__module__ = "hsdump"
del _name


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'hsdump' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    value.__module__ = "hsdump"
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
