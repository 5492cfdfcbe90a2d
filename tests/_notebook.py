"""Runs code cells as a Jupyter kernel does, for the docs' notebook examples.

One namespace for all cells, all of them inside one running event loop (so ``asyncio.run`` fails
there as it does in Jupyter), top-level ``await`` compiled as IPython compiles it, and the value
of a cell's last expression shown as ``Out[N]: repr``. Run as a script: ``python _notebook.py
CELLS.json`` runs the JSON list of cells, in the working directory it is started in.
"""

from __future__ import annotations

import ast
import asyncio
import inspect
import json
import sys
from types import CodeType
from typing import Any

FLAGS = ast.PyCF_ALLOW_TOP_LEVEL_AWAIT


async def run_cells(cells: list[str]) -> None:
    namespace: dict[str, Any] = {"__name__": "__main__"}
    for number, cell in enumerate(cells, start=1):
        value = await _run_cell(cell, namespace, f"<cell {number}>")
        if value is not None:
            print(f"Out[{number}]: {value!r}", flush=True)


async def _run_cell(source: str, namespace: dict[str, Any], name: str) -> Any:
    tree = ast.parse(source)
    last = tree.body.pop() if tree.body and isinstance(tree.body[-1], ast.Expr) else None
    await _evaluate(compile(tree, name, "exec", flags=FLAGS), namespace)
    if last is None:
        return None
    return await _evaluate(
        compile(ast.Expression(last.value), name, "eval", flags=FLAGS), namespace
    )


async def _evaluate(code: CodeType, namespace: dict[str, Any]) -> Any:
    result = eval(code, namespace)
    if code.co_flags & inspect.CO_COROUTINE:  # the cell awaits: run it in this loop
        result = await result
    return result


if __name__ == "__main__":
    with open(sys.argv[1]) as f:
        asyncio.run(run_cells(json.load(f)))
