"""The public surface of hsdump is deliberate, documented, and cheap to import."""

from __future__ import annotations

import subprocess
import sys

import hsdump


def test_all_names_resolve_and_have_docstrings() -> None:
    for name in hsdump.__all__:
        value = getattr(hsdump, name)
        if name != "__version__":
            assert value.__doc__, f"{name} has no docstring"


def test_all_is_sorted() -> None:
    assert hsdump.__all__ == sorted(hsdump.__all__)


def test_core_names_are_exported() -> None:
    for name in ("HiddenStateClient", "DumpWatcher", "Sample", "HiddenStates", "HsdumpError"):
        assert name in hsdump.__all__


def test_import_pulls_in_neither_torch_nor_zarr_nor_httpx_nor_ray() -> None:
    heavy = "('torch', 'zarr', 'httpx', 'ray')"
    code = f"import sys, hsdump; print(sorted(m for m in {heavy} if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
