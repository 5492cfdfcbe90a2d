"""The README's Python example runs as written."""

from __future__ import annotations

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


@pytest.mark.slow
def test_readme_library_example_runs(tmp_path: Path) -> None:
    (block,) = python_blocks()
    code = block.replace("/dev/shm/hsdump-demo", str(tmp_path / "dumps"))
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert "torch.Size([4, 3," in out.stdout
    assert (tmp_path / "demo.zarr").is_dir()


def test_ci_runs_the_readmes_test_command() -> None:
    blocks = re.findall(r"```bash\n(.*?)```", README.read_text(), flags=re.S)
    ci = (README.parent / ".ci" / "run").read_text()
    assert blocks[1].strip() in ci
