"""The public surface of hsdump is deliberate, documented, and cheap to import."""

from __future__ import annotations

import pickle
import pickletools
import subprocess
import sys
from pathlib import Path

import hsdump

PUBLIC = [
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


def test_the_public_surface_is_exactly_these_names() -> None:
    """A name joins or leaves the public API here, on purpose."""
    assert hsdump.__all__ == PUBLIC
    assert dir(hsdump) == PUBLIC


def _subclasses(cls: type) -> set[type]:
    return {cls, *(sub for direct in cls.__subclasses__() for sub in _subclasses(direct))}


def test_every_error_class_is_exported() -> None:
    """Callers catch hsdump's errors by class: each one defined is one they can import."""
    for name in hsdump.__all__:
        getattr(hsdump, name)  # imports every module behind the public names
    errors = {e for e in _subclasses(hsdump.HsdumpError) if e.__module__.startswith("hsdump")}
    assert len(errors) > 30  # the tree in hsdump's error module; other tests may add their own
    hidden = {e.__qualname__ for e in errors if getattr(hsdump, e.__name__, None) is not e}
    assert not hidden, f"export these from hsdump: {sorted(hidden)}"


def test_all_is_sorted() -> None:
    assert hsdump.__all__ == sorted(hsdump.__all__)


def test_every_public_name_says_it_comes_from_hsdump() -> None:
    for name in hsdump.__all__:
        if name != "__version__":
            assert getattr(hsdump, name).__module__ == "hsdump", name


def test_all_names_resolve_and_have_docstrings() -> None:
    for name in hsdump.__all__:
        value = getattr(hsdump, name)
        if name != "__version__":
            assert value.__doc__, f"{name} has no docstring"


def test_the_types_users_receive_are_the_exported_ones(tmp_path: Path) -> None:
    from store_crash_writer import make_sample

    path = tmp_path / "s.zarr"
    with hsdump.open_store(path, "a") as store:
        store.write(make_sample(0))
    with hsdump.open_store(path, "r") as store:
        assert type(store.provenance) is hsdump.Provenance
        assert {type(layer) for layer in store.stats()} == {hsdump.LayerStats}
    report = hsdump.verify_store(path)
    assert type(report) is hsdump.VerifyReport and report.clean
    assert hsdump.VerifyReport.model_fields["corrupted"].annotation == list[hsdump.CorruptSample]
    assert type(hsdump.HiddenStateClient("http://127.0.0.1:9").stats) is hsdump.ClientStats
    assert hsdump.DumpMeta.model_fields["producer"].annotation is hsdump.ProducerInfo


def test_public_values_pickle_by_their_public_name() -> None:
    failure = hsdump.Failure("s0", 3, "DumpTimeout", "no dump", 4)
    data = pickle.dumps(failure)
    strings = [arg for op, arg, _ in pickletools.genops(data) if isinstance(arg, str)]
    assert strings[:2] == ["hsdump", "Failure"] and pickle.loads(data) == failure
    error = pickle.loads(pickle.dumps(hsdump.ConfigError("bad")))
    assert type(error) is hsdump.ConfigError and str(error) == "bad"


def test_import_pulls_in_neither_torch_nor_zarr_nor_httpx_nor_ray() -> None:
    heavy = "('torch', 'zarr', 'httpx', 'ray', 'pydantic_settings')"
    code = f"import sys, hsdump; print(sorted(m for m in {heavy} if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
