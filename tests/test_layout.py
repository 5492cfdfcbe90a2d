"""The layout's rules that a reader of the tree relies on (docs/architecture.md)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("hsdump", "sglang_patch")


def _modules() -> dict[str, Path]:
    found = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            parts = path.relative_to(ROOT).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            found[name] = path
    return found


def _typing_only(tree: ast.Module) -> set[int]:
    """Nodes under ``if TYPE_CHECKING:``: imports for annotations, never run."""
    skipped = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skipped.update(id(sub) for stmt in node.body for sub in ast.walk(stmt))
    return skipped


def _known(name: str, modules: dict[str, Path]) -> str | None:
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The package's modules ``name`` imports at run time, at module level or in a function."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    skipped = _typing_only(tree)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str | None] = set()
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Import):
            found.update(_known(alias.name, modules) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            for alias in node.names:
                found.add(_known(f"{base}.{alias.name}", modules) or _known(base, modules))
    return {m for m in found if m is not None and m != name}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for target in graph[node]:
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while (top := stack.pop()) != node:
                component.append(top)
            if component:
                found.append(sorted([node, *component]))

    for node in graph:
        if node not in index:
            visit(node)
    return found


def test_no_module_imports_one_that_imports_it_back() -> None:
    modules = _modules()
    graph = {name: _imports(name, path, modules) for name, path in modules.items()}
    assert _cycles(graph) == []


def test_the_cycle_finder_finds_a_cycle() -> None:
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
