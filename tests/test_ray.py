"""Extraction on a Ray cluster: three nodes on this machine, each with its own server and dump root.

One cluster (``ray.cluster_utils.Cluster``, as Ray's own tests use) serves the module: a head and
two nodes, each with one CPU, a 100 MB object store and a ``hsdump-node:n<i>`` resource that the
servers list names. The servers are FakeServers on loopback, each dumping into its own root.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import pytest
import torch
from _stores import stored_bits
from typer.testing import CliRunner

from hsdump import (
    ConfigError,
    HiddenStateClient,
    RunOptions,
    Sample,
    WorkerError,
    open_store,
    run_extraction,
    run_ray_extraction,
    verify_store,
)
from hsdump.testing import FakeServer, Fault, cli_app

ray = pytest.importorskip("ray")
cluster_utils = pytest.importorskip("ray.cluster_utils")

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

NODE = {"num_cpus": 1, "object_store_memory": 100 * 2**20}
BATCH_TOKENS = 200  # about ten samples a batch: many batches for three actors


def _samples(n: int, seed: int = 0) -> list[Sample]:
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 40, (n,), generator=gen).tolist()
    return [
        Sample(f"s{i}", torch.randint(0, 500, (t,), generator=gen).tolist())
        for i, t in enumerate(lengths)
    ]


SAMPLES = _samples(300)


@pytest.fixture(scope="module")
def cluster() -> Iterator[Any]:
    head = {**NODE, "include_dashboard": False, "resources": {"hsdump-node:n0": 1}}
    nodes = cluster_utils.Cluster(initialize_head=True, head_node_args=head)
    for i in (1, 2):
        nodes.add_node(**NODE, resources={f"hsdump-node:n{i}": 1})
    try:
        ray.init(address=nodes.address)  # the runs find Ray initialised and use this cluster
        yield nodes
    finally:
        ray.shutdown()
        nodes.shutdown()


@pytest.fixture
def servers(tmp_path: Path) -> Iterator[list[FakeServer]]:
    with contextlib.ExitStack() as stack:
        yield [
            stack.enter_context(FakeServer(tmp_path / f"dumps{i}", hidden_size=16))
            for i in range(3)
        ]


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[bytes, bytes, list]]:
    """What one server stores for SAMPLES, in this process."""
    root = tmp_path_factory.mktemp("reference")
    with FakeServer(root / "dumps", hidden_size=16) as server:
        anyio.run(_seed, server, root / "one.zarr", SAMPLES)
    return stored_bits(root / "one.zarr")


def _listing(servers: list[FakeServer], nodes: list[str | None]) -> list[tuple]:
    return [(s.url, s.dump_dir, node) for s, node in zip(servers, nodes, strict=True)]


def _run(
    servers: list[FakeServer],
    store: Path,
    samples: list[Sample],
    *,
    nodes: list[str | None] | None = None,
    batch_tokens: int = BATCH_TOKENS,
    address: str | None = None,
    store_options: dict[str, Any] | None = None,
    **options: Any,
) -> Any:
    """``run_ray_extraction`` over ``servers`` on ``nodes``; ``options`` are `RunOptions`."""
    return run_ray_extraction(
        samples, servers=_listing(servers, nodes or ["n0", "n1", "n2"]), store=store,
        address=address, batch_tokens=batch_tokens, store_options=store_options,
        options=RunOptions(**{"concurrency": 2, **options}),
    )  # fmt: skip


async def _seed(server: FakeServer, store: Path, samples: list[Sample]) -> None:
    """Store ``samples`` in this process, as an earlier run would have."""
    async with HiddenStateClient(server.url, dump_dir=server.dump_dir) as client:
        with open_store(store, "a", writer_id="earlier") as opened:
            assert (await run_extraction(samples, client=client, store=opened)).ok


def _served(server: FakeServer) -> int:
    return sum(r.rid.startswith("hsdump-") for r in server.received)


def _node_ids(nodes: Any) -> dict[str, str]:
    """hsdump-node name -> Ray node id, for the cluster's live nodes."""
    return {
        resource.removeprefix("hsdump-node:"): n["NodeID"]
        for n in ray.nodes()
        if n["Alive"]
        for resource in n["Resources"]
        if resource.startswith("hsdump-node:")
    }


def test_three_nodes_store_what_one_server_stores(cluster, servers, reference, tmp_path, caplog):
    with caplog.at_level(logging.INFO, logger="hsdump"):
        summary = _run(servers, tmp_path / "s.zarr", SAMPLES)
    assert summary.ok and summary.samples_done == len(SAMPLES) and summary.workers == 3
    assert summary.tokens_done == sum(len(s.input_ids) for s in SAMPLES)
    assert stored_bits(tmp_path / "s.zarr") == reference
    assert all(_served(s) > 5 for s in servers)  # each server took a share of the batches
    placed = {r.args[0]: r.args[1] for r in caplog.records if "runs on node" in r.getMessage()}
    ids = _node_ids(cluster)
    assert placed == {s.url: ids[f"n{i}"] for i, s in enumerate(servers)}
    parts = sorted(p.name for p in (tmp_path / "s.zarr").glob("part-*"))
    assert parts == ["part-ray-s0-a0", "part-ray-s1-a0", "part-ray-s2-a0"]
    assert summary.cpu_s > 0 and summary.stages["ingest"] > 0
    served = [_served(s) for s in servers]
    rerun = _run(servers, tmp_path / "s.zarr", SAMPLES)
    assert rerun.ok and rerun.samples_done == 0 and rerun.skipped == len(SAMPLES)
    assert stored_bits(tmp_path / "s.zarr") == reference
    assert [_served(s) for s in servers] == served  # no actor was even started


def _after_requests(
    servers: list[FakeServer], count: int, action: Any
) -> list[tuple[int, threading.Thread]]:
    """Run ``action(i)`` in a thread once server ``i`` is the first to get ``count`` more samples.

    The request that reaches the count is in flight then: its actor has a batch out.
    """
    fired: list[tuple[int, threading.Thread]] = []
    for i, server in enumerate(servers):
        generate, seen = server.engine.generate, [0]

        async def counting(request: Any, i: int = i, generate: Any = generate, seen=seen) -> Any:
            seen[0] += request.rid.startswith("hsdump-")
            if seen[0] == count and not fired:
                fired.append((i, threading.Thread(target=action, args=(i,))))
                fired[0][1].start()
            return await generate(request)

        server.engine.generate = counting
    return fired


def test_a_resumed_run_with_a_killed_actor_commits_each_sample_once(
    cluster, servers, reference, tmp_path
) -> None:
    store = tmp_path / "s.zarr"
    anyio.run(_seed, servers[0], store, SAMPLES[:25])  # an earlier run's part

    def kill(i: int) -> None:
        (name,) = [n for n in ray.util.list_named_actors() if n.startswith(f"hsdump-ray-s{i}-0-")]
        ray.kill(ray.get_actor(name))

    for server in servers:
        server.engine.latency = 0.01
    killed = _after_requests(servers, 30, kill)
    # Big batches in small shards: the killed actor has committed part of the batch it dies in.
    summary = _run(servers, store, SAMPLES, batch_tokens=1500, store_options={"shard_tokens": 128})
    ((victim, thread),) = killed
    thread.join()
    assert summary.ok and (summary.samples_done, summary.skipped) == (len(SAMPLES) - 25, 25)
    assert stored_bits(store) == reference
    assert verify_store(store).clean
    with open_store(store, "r") as opened:
        parts = {opened.locate(sid)[0] for sid in opened}
    assert f"part-ray-s{victim}-a0" in parts  # it committed before it died
    # No run opens the dead actor's part again: this one tidied it (its state says "closed").
    state = json.loads((store / f"part-ray-s{victim}-a0" / "zarr.json").read_text())
    assert state["attributes"]["hsdump_part"]["recheck_from"] is None


def test_a_removed_node_loses_nothing(cluster, servers, reference, tmp_path) -> None:
    spare = cluster.add_node(**NODE, resources={"hsdump-node:spare": 1})
    cluster.wait_for_nodes()
    for server in servers:
        server.engine.latency = 0.01
    removed = _after_requests(servers[2:], 30, lambda _: cluster.remove_node(spare))
    summary = _run(servers, tmp_path / "s.zarr", SAMPLES, nodes=["n0", "n1", "spare"])
    removed[0][1].join()
    assert summary.ok and summary.samples_done == len(SAMPLES)
    assert stored_bits(tmp_path / "s.zarr") == reference
    assert verify_store(tmp_path / "s.zarr").clean


def test_a_node_absent_from_the_cluster_is_named(cluster, servers, tmp_path) -> None:
    with pytest.raises(ConfigError, match=r"server 3 .*node 'nowhere' is not a live node"):
        _run(servers, tmp_path / "s.zarr", SAMPLES[:5], nodes=["n0", "n1", "nowhere"])
    assert not (tmp_path / "s.zarr").exists()


def test_every_actor_dead_is_one_hsdump_error(cluster, tmp_path) -> None:
    listing = [("http://127.0.0.1:9", tmp_path / f"none{i}", f"n{i}") for i in range(3)]
    with pytest.raises(WorkerError, match="every extraction actor is dead") as caught:
        run_ray_extraction(SAMPLES[:5], servers=listing, store=tmp_path / "s.zarr")
    assert "ServerNotDumping" in str(caught.value) or "ServerUnavailable" in str(caught.value)
    assert not isinstance(caught.value, ray.exceptions.RayError)


def test_without_ray_the_error_says_what_to_install(monkeypatch, servers, tmp_path) -> None:
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` now fails as if not installed
    with pytest.raises(ConfigError, match=r"pip install 'hsdump\[ray\]'"):
        _run(servers, tmp_path / "s.zarr", SAMPLES[:5])


def test_extract_ray_runs_a_servers_file_with_nodes(cluster, servers, tmp_path) -> None:
    rows = [{"id": s.id, "input_ids": list(s.input_ids)} for s in SAMPLES[:30]]
    (tmp_path / "d.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    listing = [
        {"url": s.url, "dump_dir": str(s.dump_dir), "node": f"n{i}"} for i, s in enumerate(servers)
    ]
    (tmp_path / "servers.json").write_text(json.dumps(listing))
    args = ["extract", str(tmp_path / "d.jsonl"), "--out", str(tmp_path / "s.zarr"), "--servers"]
    args += [str(tmp_path / "servers.json"), "--ray", "--ray-address", cluster.address, "-v"]
    result = CliRunner().invoke(cli_app, args)
    assert result.exit_code == 0, result.output
    assert sorted(stored_bits(tmp_path / "s.zarr")) == sorted(r["id"] for r in rows)
    assert "3 worker process(es)" in result.output


def test_extract_ray_without_ray_installed_is_a_one_line_error(monkeypatch, tmp_path) -> None:
    monkeypatch.setitem(sys.modules, "ray", None)
    (tmp_path / "d.jsonl").write_text(json.dumps({"id": "a", "input_ids": [1]}) + "\n")
    listing = [{"url": "http://127.0.0.1:9", "dump_dir": "/x", "node": "n0"}]
    (tmp_path / "servers.json").write_text(json.dumps(listing))
    args = ["extract", str(tmp_path / "d.jsonl"), "--out", str(tmp_path / "s.zarr"), "--servers"]
    result = CliRunner().invoke(cli_app, [*args, str(tmp_path / "servers.json"), "--ray"])
    assert result.exit_code == 2 and "pip install 'hsdump[ray]'" in result.output
    assert "Traceback" not in result.output


def test_a_run_that_joins_the_cluster_keeps_the_callers_sigterm_handler_and_leaves(
    cluster, servers, tmp_path
) -> None:
    """A graceful stop stays in charge: ray.init's own SIGTERM handler would exit at once."""

    def handler(signum: int, frame: Any) -> None:
        raise AssertionError("no SIGTERM is sent here")

    seen: list[Any] = []
    ray.shutdown()  # so that the run joins the cluster at its address itself
    previous = signal.signal(signal.SIGTERM, handler)
    try:
        summary = _run(
            servers, tmp_path / "s.zarr", SAMPLES[:30], address=cluster.address,
            progress=lambda _: seen.append(signal.getsignal(signal.SIGTERM)),
        )  # fmt: skip
        assert summary.ok and summary.samples_done == 30 and not ray.is_initialized()
    finally:
        signal.signal(signal.SIGTERM, previous)
        ray.init(address=cluster.address)
    assert seen and all(h is handler for h in seen)


def test_an_interrupted_run_keeps_what_it_committed_and_leaves_no_actor(
    cluster, servers, tmp_path
) -> None:
    def interrupt(summary) -> None:
        if summary.samples_done >= 30:
            raise KeyboardInterrupt

    for server in servers:
        server.engine.latency = 0.01
    with pytest.raises(KeyboardInterrupt):
        _run(servers, tmp_path / "s.zarr", SAMPLES, progress=interrupt)
    stored = stored_bits(tmp_path / "s.zarr")
    assert 30 <= len(stored) < len(SAMPLES) and verify_store(tmp_path / "s.zarr").clean
    assert ray.util.list_named_actors() == []
    assert [_dumps_left(s) for s in servers] == [[], [], []]  # each actor closed its client


def _dumps_left(server: FakeServer) -> list[str]:
    return sorted(p.name for p in server.dump_dir.iterdir() if p.name.startswith(("req_", ".tmp")))


def test_an_actors_own_warnings_reach_the_driver_naming_its_part(
    cluster, servers, tmp_path, caplog
) -> None:
    """Ray does not forward the workers' output: hsdump's lines come back with the results."""
    servers[1].inject(Fault(), Fault("http_500"))  # the client's probe, then a sample
    with caplog.at_level(logging.WARNING, logger="hsdump"):
        summary = _run(servers, tmp_path / "s.zarr", SAMPLES[:30])
    assert summary.ok and summary.samples_done == 30
    relayed = [r.getMessage() for r in caplog.records if r.name == "hsdump._run.ray_driver"]
    assert any(m.startswith("ray-s1-a0: sample ") and "retrying" in m for m in relayed), relayed


def _extract_ray_at(
    address: str, tmp_path: Path, timeout: float = 60
) -> subprocess.CompletedProcess[str]:
    (tmp_path / "d.jsonl").write_text(json.dumps({"id": "a", "input_ids": [1]}) + "\n")
    listing = [{"url": "http://127.0.0.1:9", "dump_dir": "/x", "node": "n0"}]
    (tmp_path / "servers.json").write_text(json.dumps(listing))
    args = ["extract", str(tmp_path / "d.jsonl"), "--out", str(tmp_path / "s.zarr"), "--servers"]
    args += [str(tmp_path / "servers.json"), "--ray", "--ray-address", address]
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    return subprocess.run(
        [sys.executable, "-m", "hsdump", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def test_a_cluster_address_where_nothing_listens_fails_at_once_saying_what_to_check(
    tmp_path,
) -> None:
    started = time.monotonic()
    result = _extract_ray_at(f"127.0.0.1:{_free_port()}", tmp_path)
    assert time.monotonic() - started < 30  # ray.init alone retries for minutes
    assert result.returncode == 2, result.stderr
    out = " ".join((result.stdout + result.stderr).split())
    assert "cannot join the Ray cluster at 127.0.0.1:" in out and "nothing answers" in out
    assert "ray status" in out and "Traceback" not in out


def test_a_cluster_listening_on_loopback_only_is_named_so(tmp_path) -> None:
    """Ray joins 127.0.0.1:PORT through this host's interface address, where nothing listens."""
    here = ray.util.get_node_ip_address()
    if here.startswith("127."):
        pytest.skip("this host has no address but loopback")
    with socket.create_server(("127.0.0.1", 0)) as loopback:
        port = loopback.getsockname()[1]
        result = _extract_ray_at(f"127.0.0.1:{port}", tmp_path)
    out = " ".join((result.stdout + result.stderr).split())
    assert result.returncode == 2 and f"through its address {here}:{port}" in out, out
    assert "loopback only" in out


def test_an_actor_without_s3_credentials_says_they_come_from_ray_start(
    cluster, servers, tmp_path, monkeypatch, caplog
) -> None:
    """The AWS_* variables of the command's shell do not reach actors: its message says so."""
    moto_server = pytest.importorskip("moto.server")
    boto3 = pytest.importorskip("boto3")
    s3 = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    s3.start()
    try:
        host, port = s3.get_host_and_port()
        for name, value in {
            "AWS_ENDPOINT_URL": f"http://{host}:{port}", "AWS_ACCESS_KEY_ID": "AKIAHSDUMPRAY",
            "AWS_SECRET_ACCESS_KEY": "ray-test-secret", "AWS_DEFAULT_REGION": "us-east-1",
        }.items():  # fmt: skip
            monkeypatch.setenv(name, value)  # here only: the cluster started without them
        boto3.client("s3").create_bucket(Bucket="raybucket")
        with pytest.raises(WorkerError) as caught, caplog.at_level(logging.WARNING, "hsdump"):
            _run(servers[:1], "s3://raybucket/s.zarr", SAMPLES[:5], nodes=["n1"])
    finally:
        s3.stop()
    message = str(caught.value)
    assert "StoreIOError" in message and f"Ray node {_node_ids(cluster)['n1']}" in message
    assert "`ray start` had on that node, not from the shell" in message
    ended = [r.getMessage() for r in caplog.records if " ended: " in r.getMessage()]
    assert ended and all("(before it opened its part)" in m for m in ended)  # no "(part None)"


def test_an_address_that_answers_but_is_no_ray_head_fails_within_the_bound(tmp_path) -> None:
    """Such as the dashboard's port: the join is given up on after a minute, with what to check."""
    with socket.create_server(("0.0.0.0", 0)) as other:  # accepts, and never speaks Ray
        port = other.getsockname()[1]
        started = time.monotonic()
        result = _extract_ray_at(f"{ray.util.get_node_ip_address()}:{port}", tmp_path, timeout=120)
    assert time.monotonic() - started < 100  # ray.init alone retries for minutes
    out = " ".join((result.stdout + result.stderr).split())
    assert result.returncode == 2 and "it answers, but Ray did not join it within 60 s" in out, out
    assert "not the dashboard's 8265" in out and "Traceback" not in out
