"""The README's Python example runs as written."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"


def python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)


def test_readme_starts_with_exactly_two_commands() -> None:
    text = README.read_text()
    first_blocks = re.findall(r"```(\w*)\n(.*?)```", text, flags=re.S)[:2]
    assert [lang for lang, _ in first_blocks] == ["bash", "bash"]
    assert all(body.count("\n") == 1 for _, body in first_blocks)
    assert "nox -s tests" in first_blocks[1][1]


NOTEBOOK = Path(__file__).resolve().parent / "_notebook.py"
#: The example's last line: what a script runs, and what a notebook cell runs instead.
SCRIPT_LINE = re.compile(r"(asyncio\.run\(main\(\)\))  # in a notebook cell instead: (.*)")


def notebook_cells() -> tuple[list[str], list[str]]:
    """The example as notebook cells: its script form, then the form its last line names."""
    (block,) = python_blocks()
    body, last = block.rstrip("\n").rsplit("\n", 1)
    line = SCRIPT_LINE.fullmatch(last)
    assert line is not None, f"the example ends {last!r}"
    return [body, line[1]], [body, line[2]]


def run_clean(args: list[str], tmp_path: Path) -> subprocess.CompletedProcess[str]:
    """Runs ``args`` in an empty directory ``work`` with its temporary files under ``tmp``."""
    for name in ("work", "tmp"):
        (tmp_path / name).mkdir()
    env = {**os.environ, "TMPDIR": str(tmp_path / "tmp")}
    return subprocess.run(
        args, cwd=tmp_path / "work", env=env, capture_output=True, text=True, timeout=300
    )


def run_cells(cells: list[str], tmp_path: Path) -> subprocess.CompletedProcess[str]:
    (tmp_path / "cells.json").write_text(json.dumps(cells))
    return run_clean([sys.executable, str(NOTEBOOK), str(tmp_path / "cells.json")], tmp_path)


def assert_ran_and_cleaned_up(out: subprocess.CompletedProcess[str], tmp_path: Path) -> None:
    assert out.returncode == 0, out.stderr[-2000:]
    assert "torch.Size([4, 3," in out.stdout
    made = sorted(p.name for p in (tmp_path / "work").iterdir())
    assert made == ["demo.zarr", "demo.zarr.hsdump-locks"]  # the store and its writer locks
    assert leftovers(tmp_path / "tmp") == [], "the dump root is left behind"


def leftovers(tmp: Path) -> list[str]:
    """What is left in a temporary directory, less torch's compile cache (torchinductor_USER)."""
    return sorted(p.name for p in tmp.iterdir() if not p.name.startswith("torchinductor_"))


@pytest.mark.slow
def test_readme_library_example_runs_as_a_script_and_cleans_up(tmp_path: Path) -> None:
    (block,) = python_blocks()
    assert_ran_and_cleaned_up(run_clean([sys.executable, "-c", block], tmp_path), tmp_path)


@pytest.mark.slow
def test_readme_library_example_runs_in_a_notebook_cell_and_cleans_up(tmp_path: Path) -> None:
    _, cells = notebook_cells()
    assert_ran_and_cleaned_up(run_cells(cells, tmp_path), tmp_path)


def test_the_script_form_fails_in_a_notebook_cell(tmp_path: Path) -> None:
    """Why the example says what a notebook cell runs instead: Jupyter's loop is running."""
    script, _ = notebook_cells()
    out = run_cells(script, tmp_path)
    assert out.returncode != 0
    assert "cannot be called from a running event loop" in out.stderr


def test_ci_runs_the_readmes_test_command() -> None:
    blocks = re.findall(r"```bash\n(.*?)```", README.read_text(), flags=re.S)
    ci = (README.parent / ".ci" / "run").read_text()
    assert blocks[1].strip() in ci
