"""``hsdump.testing`` imports where pytest is not installed; only its pytest suite needs pytest."""

from __future__ import annotations

import subprocess
import sys

# Runs in a fresh interpreter in which pytest cannot be imported, as where it is not installed.
WITHOUT_PYTEST = """
import sys

class NoPytest:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("pytest", "_pytest"):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None

sys.meta_path.insert(0, NoPytest())
for name in [m for m in sys.modules if m.split(".")[0] in ("pytest", "_pytest")]:
    del sys.modules[name]
"""


def run_without_pytest(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", WITHOUT_PYTEST + code], capture_output=True, text=True, timeout=120
    )


def test_hsdump_testing_imports_without_pytest() -> None:
    out = run_without_pytest(
        "import hsdump.testing as t\n"
        "assert t.FakeServer and t.MemorySink and t.build_default_model\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('pytest', '_pytest')))"
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]"


def test_its_pytest_suite_says_it_needs_pytest() -> None:
    out = run_without_pytest("import hsdump.testing as t\nt.DumpWatcherTests")
    assert out.returncode != 0
    assert "No module named 'pytest'" in out.stderr
