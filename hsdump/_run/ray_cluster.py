"""The Ray cluster side of `hsdump._run.ray_driver`: joining it, finding the servers'
nodes, fences.

Ray is imported here only when a run asks for it (`require_ray`), so ``import hsdump``
never imports it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from hsdump._exceptions import ConfigError

__all__ = [
    "NODE_RESOURCE",
    "ServerEntry",
    "connected",
    "require_ray",
    "resolve_nodes",
]

logger = logging.getLogger(__name__)

NODE_RESOURCE = "hsdump-node:"
JOIN_TIMEOUT_S = 10.0  # to reach the cluster's address; ray.init itself waits far longer
INIT_TIMEOUT_S = 60.0  # for ray.init once the address answers: seconds on a healthy cluster
_LOOPBACK = ("localhost", "127.0.0.1", "::1")  # the hosts Ray replaces by this host's address

ServerEntry = tuple[str, "str | os.PathLike[str] | None", "str | None"]


# -- Ray and its nodes ----------------------------------------------------------------------------


def require_ray() -> Any:
    """The ``ray`` module, or a `ConfigError` saying how to install it."""
    try:
        import ray
    except ImportError as exc:
        raise ConfigError(
            f"extraction on a Ray cluster needs Ray, which is not installed ({exc}): "
            "pip install 'hsdump[ray]'"
        ) from exc
    return ray


@contextlib.contextmanager
def connected(ray: Any, address: str | None) -> Iterator[None]:
    """Joins the cluster at ``address`` (unless already joined), and leaves it at the end."""
    if ray.is_initialized():
        yield
        return
    _probe(ray, address)
    try:
        _init(ray, address)
    except ConfigError:
        raise
    except (ConnectionError, RuntimeError, ValueError) as exc:
        raise ConfigError(
            f"cannot join the Ray cluster at {address or 'RAY_ADDRESS or this node'}: {exc}. "
            "Start it with `ray start --head` (then `ray start --address HEAD:6379` on the other "
            "nodes) and pass its address"
        ) from exc
    try:
        yield
    finally:
        ray.shutdown()


def _init(ray: Any, address: str | None) -> None:
    """``ray.init``, bounded by `INIT_TIMEOUT_S`: at an address that answers but is no Ray head
    (the dashboard's port, another service) it would retry for minutes.

    It runs in a thread of its own, which also keeps the caller's SIGTERM handler (Ray sets one
    that exits at once only from the main thread). A join given up on leaves that thread behind.
    """
    outcome: list[BaseException | None] = []
    done = threading.Event()

    def join() -> None:
        try:
            # The actors' hsdump lines come back with their results (`ExtractionActor`):
            # forwarding the workers' output would also bring Ray's raylet logs, a flood when a
            # node goes.
            ray.init(address=address, logging_level=logging.WARNING, log_to_driver=False)
            outcome.append(None)
        except BaseException as exc:
            outcome.append(exc)
        finally:
            done.set()

    quiet = _Unless("not the main thread")  # Ray's note that it set no SIGTERM handler
    logging.getLogger("ray._private.worker").addFilter(quiet)
    try:
        threading.Thread(target=join, name="hsdump-ray-init", daemon=True).start()
        joined = done.wait(INIT_TIMEOUT_S)
    finally:
        logging.getLogger("ray._private.worker").removeFilter(quiet)
    if not joined:
        where = address or os.environ.get("RAY_ADDRESS") or "this node"
        raise ConfigError(
            f"cannot join the Ray cluster at {where}: it answers, but Ray did not join it within "
            f"{INIT_TIMEOUT_S:.0f} s. Check that the port is the GCS port `ray start --head` "
            "printed (6379 by default; not the dashboard's 8265) and that the cluster runs Ray "
            f"{ray.__version__}, as this machine does"
        )
    if outcome[0] is not None:
        raise outcome[0]


class _Unless(logging.Filter):
    def __init__(self, text: str) -> None:
        super().__init__()
        self.text = text

    def filter(self, record: logging.LogRecord) -> bool:
        return self.text not in record.getMessage()


def _probe(ray: Any, address: str | None) -> None:
    """Refuse, within `JOIN_TIMEOUT_S`, a cluster address where nothing answers.

    ``ray.init`` retries such an address for minutes, printing only its own warnings. It also
    joins ``127.0.0.1:PORT`` through this host's interface address, so both are tried.
    """
    target = os.environ.get("RAY_ADDRESS", "") if address in (None, "auto") else address
    host, sep, port = target.rpartition(":")
    if not sep or not port.isdigit() or "://" in target:
        return  # none named ("auto", this node's cluster, ray://): ray.init finds it or says why
    host = host.strip("[]")
    hosts = [host]
    if host in _LOOPBACK:
        with contextlib.suppress(Exception):  # no address but loopback: Ray keeps loopback too
            hosts.append(ray.util.get_node_ip_address())
    for tried in hosts:
        try:
            socket.create_connection((tried, int(port)), timeout=JOIN_TIMEOUT_S).close()
        except OSError as exc:
            raise ConfigError(_unreachable(target, tried, port, exc)) from exc


def _unreachable(target: str, tried: str, port: str, exc: OSError) -> str:
    why = exc.strerror or type(exc).__name__
    if target.rpartition(":")[0].strip("[]") != tried:
        return (
            f"cannot join the Ray cluster at {target}: Ray joins a cluster on this host through "
            f"its address {tried}:{port}, where nothing answers ({why}): the head listens on "
            f"loopback only. Start it with `ray start --head --node-ip-address {tried}` and pass "
            f"--ray-address {tried}:{port}"
        )
    return (
        f"cannot join the Ray cluster at {target}: nothing answers there within "
        f"{JOIN_TIMEOUT_S:.0f} s ({why}). Check that its head runs (`ray status` there), that "
        f"{port} is the GCS port `ray start --head` printed (6379 by default), and that no "
        "firewall stands between this machine and it"
    )


def resolve_nodes(ray: Any, servers: Sequence[ServerEntry]) -> list[str]:
    """The Ray node id of each server's ``node``; this process's node where none is named."""
    alive = [n for n in ray.nodes() if n["Alive"]]
    here = ray.get_runtime_context().get_node_id()
    return [
        here if node is None else _find_node(node, f"server {i} ({url})", alive)
        for i, (url, _, node) in enumerate(servers, 1)
    ]


def _find_node(name: str, server: str, alive: list[dict[str, Any]]) -> str:
    rules = (
        ("node id", lambda n: n["NodeID"] == name),
        ("resource", lambda n: f"{NODE_RESOURCE}{name}" in n["Resources"]),
        ("host", lambda n: name in (n["NodeManagerAddress"], n["NodeManagerHostname"])),
    )
    for what, rule in rules:
        found = [str(n["NodeID"]) for n in alive if rule(n)]
        if len(found) == 1:
            return found[0]
        if found:
            raise ConfigError(
                f"{server}: node {name!r} matches {len(found)} live Ray nodes by {what} "
                f"({', '.join(found)}): name one by its node id, or give each node its own "
                f"resource at `ray start --resources '{{\"{NODE_RESOURCE}NAME\": 1}}'`"
            )
    listed = ", ".join(_describe(n) for n in alive) or "none"
    raise ConfigError(
        f"{server}: node {name!r} is not a live node of the Ray cluster (live nodes: {listed}). "
        "Start Ray on it (`ray start --address HEAD:6379`) or correct the servers file's node"
    )


def _describe(node: Mapping[str, Any]) -> str:
    names = [
        r.removeprefix(NODE_RESOURCE) for r in node["Resources"] if r.startswith(NODE_RESOURCE)
    ]
    return f"{node['NodeManagerAddress']} {node['NodeID'][:12]}" + "".join(f" {r}" for r in names)
