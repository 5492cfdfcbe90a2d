"""``python -m sglang_patch.launch_server <sglang args>``: SGLang's HTTP server with the dump.

For environments where the ``sglang.srt.plugins`` entry point cannot be installed (e.g. the
checkout is only on ``PYTHONPATH``). It installs the hooks in this process and hands SGLang a
scheduler entry function that installs them in each spawned scheduler process before it runs.
Covers the default HTTP server only (not gRPC, Ray or encoder-only modes).
"""

from __future__ import annotations

import os
import sys
from typing import Any

__all__ = ["main", "run_scheduler_process"]


def run_scheduler_process(*args: Any, **kwargs: Any) -> Any:
    """SGLang's ``run_scheduler_process``, with the dump hooks installed first (spawned child)."""
    from sglang.srt.managers.scheduler import run_scheduler_process as original

    from sglang_patch.plugin import install

    install()
    return original(*args, **kwargs)


def main(argv: list[str] | None = None) -> None:
    """Parse SGLang's server arguments and run its HTTP server with the dump hooks."""
    from sglang.srt.entrypoints.http_server import launch_server
    from sglang.srt.plugins import load_plugins
    from sglang.srt.server_args import prepare_server_args
    from sglang.srt.utils import kill_process_tree

    from sglang_patch.plugin import install

    load_plugins()
    install()
    server_args = prepare_server_args(sys.argv[1:] if argv is None else argv)
    if hasattr(server_args, "resolve_once"):  # 0.5.23 resolves derived settings once, up front
        server_args.resolve_once()
    try:
        launch_server(server_args, run_scheduler_process_func=run_scheduler_process)
    finally:
        kill_process_tree(os.getpid(), include_parent=False)


if __name__ == "__main__":
    main()
