"""HSDUMP_* settings: read when a client or a store asks, empty means unset, malformed values named.

Arguments first: `StoreOptions` and `HiddenStateClient`'s arguments win over the variables, which
are read when a store opens (`StoreOptions.resolved`) or a client is made.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from hsdump import ConfigError, HiddenStateClient, StoreOptions, open_store

DOCS = Path(__file__).resolve().parent.parent / "docs" / "cli.md"
URL = "http://127.0.0.1:9"  # a client is only made here, never opened

# (variable, malformed value, what the message says it takes): read when a store opens
STORE_MALFORMED = [
    ("HSDUMP_CORES", "-1", "a whole number of cores above 0"),
    ("HSDUMP_LEASE_TTL_S", "nan", "a number of seconds above 0"),
    ("HSDUMP_COMMIT_INTERVAL_S", "-1", "a number of seconds, 0 or more"),
    ("HSDUMP_SHARD_WRITERS", "eight", "a whole number above 0"),
]
# read when a client opens
CLIENT_MALFORMED = [
    ("HSDUMP_WATCHER", "fanotify", "one of inotify, poll, watchfiles"),
    ("HSDUMP_DUMP_BUDGET_BYTES", "2GB", "a whole number of bytes above 0"),
    ("HSDUMP_DUMP_BUDGET_BYTES", "0", "a whole number of bytes above 0"),
]
MALFORMED = STORE_MALFORMED + CLIENT_MALFORMED
VARIABLES = {"HSDUMP_DUMP_DIR"} | {name for name, _, _ in MALFORMED}


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in VARIABLES:
        monkeypatch.delenv(name, raising=False)


def _defaults() -> StoreOptions:
    n = len(os.sched_getaffinity(0))
    return StoreOptions(
        commit_interval_s=1.0, shard_writers=max(2, min(8, n // 2)), lease_ttl_s=60.0, cores=n
    )


def test_store_options_without_variables_take_the_defaults() -> None:
    assert StoreOptions().resolved() == _defaults()


def test_each_store_opening_reads_the_environment_as_it_is_now(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    values = {
        "HSDUMP_CORES": "3",
        "HSDUMP_LEASE_TTL_S": "7.5",
        "HSDUMP_COMMIT_INTERVAL_S": "0",
        "HSDUMP_SHARD_WRITERS": "1",
    }
    for name, value in values.items():
        monkeypatch.setenv(name, value)
    want = StoreOptions(commit_interval_s=0.0, shard_writers=1, lease_ttl_s=7.5, cores=3)
    assert StoreOptions().resolved() == want
    monkeypatch.delenv("HSDUMP_CORES")
    assert StoreOptions().resolved().cores == len(os.sched_getaffinity(0))


def test_arguments_win_over_the_variables(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    for name in ("HSDUMP_CORES", "HSDUMP_LEASE_TTL_S", "HSDUMP_COMMIT_INTERVAL_S"):
        monkeypatch.setenv(name, "3")
    monkeypatch.setenv("HSDUMP_SHARD_WRITERS", "3")
    given = StoreOptions(commit_interval_s=0.5, shard_writers=4, lease_ttl_s=9.0, cores=5)
    assert given.resolved() == given
    monkeypatch.setenv("HSDUMP_DUMP_DIR", str(tmp_path / "env"))
    assert HiddenStateClient(URL, dump_dir=tmp_path / "arg").dump_dir == tmp_path / "arg"


def test_empty_values_count_as_unset(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in VARIABLES:
        monkeypatch.setenv(name, "")
    assert StoreOptions().resolved() == _defaults()
    assert HiddenStateClient(URL).dump_dir == Path("/dev/shm/hsdump")


def test_the_plugins_variables_are_ignored(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HSDUMP_LAYER_IDS", "2,30,58")
    monkeypatch.setenv("HSDUMP_PINNED_MB", "not checked here")
    assert StoreOptions().resolved() == _defaults()
    assert HiddenStateClient(URL).dump_dir == Path("/dev/shm/hsdump")


@pytest.mark.parametrize(("name", "value", "wants"), STORE_MALFORMED)
def test_a_malformed_store_variable_stops_open_store_naming_it_its_value_and_what_it_takes(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, name: str, value: str, wants: str
) -> None:
    monkeypatch.setenv(name, value)
    said = re.escape(f"{name} is {value!r}, expected {wants}")
    with pytest.raises(ConfigError, match=said):
        open_store(tmp_path / "s.zarr", "a")
    assert not (tmp_path / "s.zarr").exists()


@pytest.mark.anyio
@pytest.mark.parametrize(("name", "value", "wants"), CLIENT_MALFORMED)
async def test_a_malformed_client_variable_stops_the_client_at_open_and_no_store(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, name: str, value: str, wants: str
) -> None:
    from hsdump.testing import FakeServer

    monkeypatch.setenv(name, value)
    said = re.escape(f"{name} is {value!r}, expected {wants}")
    with FakeServer(tmp_path / "dumps", hidden_size=8) as server:
        with pytest.raises(ConfigError, match=said):
            async with HiddenStateClient(server.url, dump_dir=server.dump_dir):
                pass
    with open_store(tmp_path / "s.zarr", "a") as store:  # a client's variable is not the store's
        assert len(store) == 0


def test_an_argument_makes_its_malformed_variable_irrelevant(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("HSDUMP_SHARD_WRITERS", "many")
    monkeypatch.setenv("HSDUMP_COMMIT_INTERVAL_S", "soon")
    options = StoreOptions(shard_writers=2, commit_interval_s=0)
    with open_store(tmp_path / "s.zarr", "a", options=options) as store:
        assert len(store) == 0


def test_importing_reads_no_variable() -> None:
    """A malformed variable is an error when a setting is asked for, not at import."""
    code = (
        "from hsdump import HiddenStateClient, HiddenStateStore, InotifyWatcher, StoreOptions, "
        "open_store, run_extraction, run_parallel_extraction; "
        "from hsdump.testing import FakeServer, MemorySink"
    )
    env = {"HSDUMP_CORES": "many", "HSDUMP_COMMIT_INTERVAL_S": "soon", "PATH": ""}
    subprocess.run([sys.executable, "-c", code], env=env, check=True)


def test_import_hsdump_does_not_load_pydantic_settings() -> None:
    code = "import sys, hsdump; print('pydantic_settings' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_docs_list_every_variable_in_one_table() -> None:
    rows = re.findall(r"^\| `(HSDUMP_[A-Z_]+)` \|", DOCS.read_text(encoding="utf-8"), re.M)
    assert sorted(rows) == sorted(VARIABLES)


def test_a_client_given_no_dump_root_takes_hsdump_dump_dir(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("HSDUMP_DUMP_DIR", str(tmp_path))
    assert HiddenStateClient(URL).dump_dir == tmp_path
    monkeypatch.setenv("HSDUMP_DUMP_DIR", "")
    assert HiddenStateClient(URL).dump_dir == Path("/dev/shm/hsdump")
