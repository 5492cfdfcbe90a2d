"""The documentation site covers the public API, and no page it or the code names is missing.

The site itself is built by `nox -s docs` (mkdocs --strict); these checks run without mkdocs.
"""

from __future__ import annotations

import re
from pathlib import Path

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
