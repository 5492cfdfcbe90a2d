"""The examples run as users would run them, and do what they say."""

from __future__ import annotations

import subprocess
import sys
from importlib import resources
from pathlib import Path

import pytest

from hsdump import open_store

BUNDLED = resources.files("hsdump") / "data" / "sample.jsonl"
EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


@pytest.mark.slow
def test_extract_dataset_example_stores_the_bundled_dataset(tmp_path):
    script = EXAMPLES / "extract_dataset.py"
    result = subprocess.run(
        [sys.executable, str(script), str(tmp_path / "out.zarr")],
        cwd=tmp_path, capture_output=True, text=True, timeout=110,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    with open_store(tmp_path / "out.zarr", "r") as store:
        expected = len(BUNDLED.read_text().splitlines())
        assert len(store) == expected and f"{expected} samples, {store.num_tokens}" in result.stdout


def test_extract_dataset_example_has_real_options_and_its_own_default_store(tmp_path):
    script = EXAMPLES / "extract_dataset.py"
    result = subprocess.run(
        [sys.executable, str(script), "--help"], cwd=tmp_path, capture_output=True, text=True,
        timeout=60,
    )  # fmt: skip
    assert result.returncode == 0 and "--concurrency" in result.stdout
    assert "example.zarr" in result.stdout and "sample.zarr" not in result.stdout
    assert list(tmp_path.iterdir()) == []  # no store named --help, nor any other
