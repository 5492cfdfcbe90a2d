"""Static sharding by sample id: N independent runs into one store give what one run gives."""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from _stores import stored_bits
from typer.testing import CliRunner

from hsdump.testing import FakeServer, cli_app

CLI = [sys.executable, "-m", "hsdump", "extract"]


def _dataset(path: Path, n: int) -> Path:
    gen = torch.Generator().manual_seed(3)
    rows = [
        {"id": f"s{i}", "input_ids": torch.randint(0, 500, (int(t),), generator=gen).tolist()}
        for i, t in enumerate(torch.randint(1, 60, (n,), generator=gen))
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _reported(server: FakeServer, data: Path, shard: str, out: Path) -> list[str | None]:
    """The ids of the bad lines that ``hsdump extract --shard`` reports (None: a line without
    one): each shard reports the bad lines of its own samples."""
    args = ["extract", str(data), "--out", str(out), "--shard", shard, "--workers", "1"]
    result = CliRunner().invoke(
        cli_app, [*args, "--server-url", server.url, "--dump-dir", str(server.dump_dir)]
    )
    assert result.exit_code == 1, result.output
    failures = out.with_name(f"{out.name}.failures.jsonl").read_text().splitlines()
    return [json.loads(line)["id"] for line in failures]


def test_every_id_falls_in_exactly_one_shard_whatever_the_count(tmp_path: Path) -> None:
    ids = [f"conv-{i}" for i in range(500)]
    bad = [{"id": i, "input_ids": [1], "loss_mask": [1, 1]} for i in ids]  # each a bad line
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in bad) + "{no id\n")
    with FakeServer(tmp_path / "dumps", hidden_size=8) as server:
        for count in (1, 2, 3, 7):
            shards = [
                _reported(server, data, f"{s}/{count}", tmp_path / f"{s}of{count}.zarr")
                for s in range(count)
            ]
            assert sorted(i for shard in shards for i in shard if i) == sorted(ids)
            assert min(len(shard) for shard in shards) > 0
            assert [None in shard for shard in shards] == [s == 0 for s in range(count)]


@pytest.mark.slow
def test_three_shards_on_three_servers_store_what_one_run_stores(tmp_path: Path) -> None:
    data = _dataset(tmp_path / "d.jsonl", 30)
    with contextlib.ExitStack() as stack:
        servers = [
            stack.enter_context(FakeServer(tmp_path / f"dumps{i}", hidden_size=16))
            for i in range(3)
        ]
        runs = [
            subprocess.Popen(
                [
                    *CLI,
                    str(data),
                    "--out",
                    str(tmp_path / "sharded.zarr"),
                    "--server-url",
                    s.url,
                    "--dump-dir",
                    str(s.dump_dir),
                    "--shard",
                    f"{i}/3",
                    "--workers",
                    "1",
                ],
                stderr=subprocess.PIPE,
                text=True,
            )
            for i, s in enumerate(servers)
        ]
        errors = [run.communicate(timeout=120)[1] for run in runs]
        assert [run.returncode for run in runs] == [0, 0, 0], errors
        one = servers[0]
        result = CliRunner().invoke(
            cli_app,
            ["extract", str(data), "--out", str(tmp_path / "one.zarr"), "--server-url", one.url,
             "--dump-dir", str(one.dump_dir), "--workers", "1"],
        )  # fmt: skip
        assert result.exit_code == 0, result.output
        requests = [len(s.received) for s in servers]
    sharded, single = stored_bits(tmp_path / "sharded.zarr"), stored_bits(tmp_path / "one.zarr")
    assert sorted(sharded) == sorted(single) == sorted(f"s{i}" for i in range(30))
    assert sharded == single
    assert all(count > 1 for count in requests)  # each server took part (its probe and samples)
    parts = sorted(p.name for p in (tmp_path / "sharded.zarr").glob("part-*"))
    assert parts == ["part-shard0of3", "part-shard1of3", "part-shard2of3"]


def test_a_malformed_shard_is_a_one_line_error(tmp_path: Path) -> None:
    data = _dataset(tmp_path / "d.jsonl", 2)
    result = CliRunner().invoke(
        cli_app, ["extract", str(data), "--out", "x.zarr", "--shard", "3/3"]
    )
    assert result.exit_code == 2 and "0 <= I < N" in result.output
