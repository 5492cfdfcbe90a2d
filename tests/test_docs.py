"""The documentation site covers the public API, and no page it or the code names is missing.

The site itself is built by `nox -s docs` (mkdocs --strict); these checks run without mkdocs.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

import hsdump

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"


def documented_names() -> set[str]:
    text = (DOCS / "api.md").read_text()
    return set(re.findall(r"^::: hsdump\.(\w+)\s*$", text, flags=re.M))


def test_api_reference_documents_every_public_name() -> None:
    public = set(hsdump.__all__) - {"__version__"}
    missing = public - documented_names()
    assert not missing, f"add these to docs/api.md: {sorted(missing)}"


def test_api_reference_documents_the_testing_module() -> None:
    assert "testing" in documented_names()


def test_every_page_in_the_nav_exists() -> None:
    config = (ROOT / "mkdocs.yml").read_text()
    nav = config[config.index("\nnav:") : config.index("\ntheme:")]
    pages = re.findall(r":\s+(\S+\.md)\s*$", nav, flags=re.M)
    assert "index.md" in pages
    assert [page for page in pages if not (DOCS / page).is_file()] == []


def test_docs_pages_named_in_the_readme_and_the_code_exist() -> None:
    sources = [ROOT / "README.md", *ROOT.glob("hsdump/**/*.py"), *ROOT.glob("sglang_patch/*.py")]
    named = {
        (str(source.relative_to(ROOT)), page)
        for source in sources
        for page in re.findall(r"docs/[\w./-]+\.md", source.read_text())
    }
    assert named, "the README names docs pages"
    missing = [f"{source}: {page}" for source, page in sorted(named) if not (ROOT / page).is_file()]
    assert not missing, f"these name docs pages that do not exist: {missing}"


GETTING_STARTED = DOCS / "getting-started.md"
NOTEBOOK = Path(__file__).resolve().parent / "_notebook.py"


def blocks(page: Path, lang: str, section: str | None = None) -> list[str]:
    """The ``lang`` code blocks of a page, or of one of its ``## `` sections."""
    text = page.read_text()
    if section is not None:
        start = text.index(f"\n## {section}\n")
        end = text.find("\n## ", start + 1)
        text = text[start : end if end > 0 else None]
    return re.findall(rf"```{lang}\n(.*?)```", text, flags=re.S)


def test_the_home_pages_commands_are_the_readmes_first_command() -> None:
    (home,) = blocks(DOCS / "index.md", "bash")
    first = blocks(ROOT / "README.md", "bash")[0]
    assert " && ".join(home.splitlines()) == first.strip()


def test_getting_started_extracts_from_python_with_the_readmes_example() -> None:
    (readme,) = blocks(ROOT / "README.md", "python")
    assert blocks(GETTING_STARTED, "python", "Extract from Python") == [readme]


def _run(args: list[str], cwd: Path, env: dict[str, str]) -> str:
    out = subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, f"{args}:\n{out.stdout[-2000:]}\n{out.stderr[-2000:]}"
    return out.stdout + out.stderr


@pytest.fixture
def clean_dirs(tmp_path: Path) -> tuple[Path, dict[str, str]]:
    """An empty working directory, and an environment whose temporary files go to ``tmp``."""
    (tmp_path / "work").mkdir()
    (tmp_path / "tmp").mkdir()
    return tmp_path / "work", {**os.environ, "TMPDIR": str(tmp_path / "tmp")}


def leftovers(tmp: Path) -> list[str]:
    """What is left in a temporary directory, less torch's compile cache (torchinductor_USER)."""
    return sorted(p.name for p in tmp.iterdir() if not p.name.startswith("torchinductor_"))


@pytest.mark.slow
def test_the_notebook_cells_run_in_a_running_event_loop_and_clean_up(tmp_path, clean_dirs) -> None:
    work, env = clean_dirs
    cells = blocks(GETTING_STARTED, "python", "In a notebook")
    (tmp_path / "cells.json").write_text(json.dumps(cells))
    out = _run([sys.executable, str(NOTEBOOK), str(tmp_path / "cells.json")], work, env)
    shown = cells[2].rstrip().splitlines()[-1].removeprefix("# ")
    assert f"Out[3]: {shown}\n" in out
    made = sorted(p.name for p in work.iterdir())
    assert made == ["notebook.zarr", "notebook.zarr.hsdump-locks"]  # the store and its locks
    assert leftovers(tmp_path / "tmp") == []


def _pattern(documented: str) -> str:
    """A documented output line as a regex: other numbers, ``...`` anything, a temporary name."""
    parts = re.split(r"(\.\.\.|hsdump-\w{8}\b|\d[\d,.]*\d|\d)", documented)
    return "".join(_wildcard(p) if i % 2 else re.escape(p) for i, p in enumerate(parts))


def _wildcard(part: str) -> str:
    if part == "...":
        return ".*"
    return r"hsdump-\w+" if part.startswith("hsdump-") else r"[\d,.]+"


def _commands(block: str) -> list[list[str]]:
    lines = [shlex.split(line, comments=True) for line in block.splitlines()]
    assert all(line[0] == ".venv/bin/hsdump" for line in lines), block
    return [[sys.executable, "-m", "hsdump", *line[1:]] for line in lines]


@pytest.mark.slow
def test_getting_started_runs_as_written(clean_dirs) -> None:
    """Its commands and Python blocks run in order, and print what the page says they print."""
    work, env = clean_dirs
    extract, checks = blocks(GETTING_STARTED, "bash", "Extract the bundled sample")
    (first_run, rerun) = blocks(GETTING_STARTED, "text", "Extract the bundled sample")
    (command,) = _commands(extract)
    for documented in (first_run, rerun):
        out = _run(command, work, env)
        for line in documented.splitlines():
            assert re.search(_pattern(line), out), f"documented {line!r}, printed:\n{out}"
    outs = [_run(check, work, env) for check in _commands(checks)]
    assert "checked 32 samples: 32 intact, 0 corrupted, 0 duplicated" in outs[0]
    assert "pass: every layer matches the model (4 samples on" in outs[-1]
    read = "\n".join(blocks(GETTING_STARTED, "python", "Read the store from Python"))
    out = _run([sys.executable, "-c", read], work, env)
    text = GETTING_STARTED.read_text()
    printed = re.search(r"For the bundled store this prints `(.*?)` and\s+`(.*?)`", text)
    assert printed is not None and f"{printed[1]}\n{printed[2]}\n" in out
