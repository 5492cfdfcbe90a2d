"""HSDUMP_* settings: read at call time, empty means unset, malformed values named."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pydantic
import pytest

from hsdump import ConfigError
from hsdump._settings import Settings, settings

DOCS = Path(__file__).resolve().parent.parent / "docs" / "cli.md"


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in Settings.model_fields:
        monkeypatch.delenv(f"HSDUMP_{name.upper()}", raising=False)


def test_defaults_without_variables() -> None:
    s = settings()
    assert s.dump_dir == Path("/dev/shm/hsdump") and s.watcher is None
    assert (s.dump_budget_bytes, s.cores, s.shard_writers) == (None, None, None)
    assert (s.lease_ttl_s, s.commit_interval_s, s.switch_interval_us) == (60.0, 1.0, 500)


def test_each_call_reads_the_environment_as_it_is_now(monkeypatch: pytest.MonkeyPatch) -> None:
    values = {
        "HSDUMP_DUMP_DIR": "/tmp/roots",
        "HSDUMP_WATCHER": "poll",
        "HSDUMP_DUMP_BUDGET_BYTES": "2000000000",
        "HSDUMP_CORES": "3",
        "HSDUMP_LEASE_TTL_S": "7.5",
        "HSDUMP_COMMIT_INTERVAL_S": "0",
        "HSDUMP_SHARD_WRITERS": "1",
        "HSDUMP_SWITCH_INTERVAL_US": "200",
    }
    for name, value in values.items():
        monkeypatch.setenv(name, value)
    s = settings()
    assert (s.dump_dir, s.watcher, s.dump_budget_bytes) == (Path("/tmp/roots"), "poll", 2 * 10**9)
    assert (s.cores, s.lease_ttl_s, s.commit_interval_s, s.shard_writers) == (3, 7.5, 0.0, 1)
    assert s.switch_interval_us == 200
    monkeypatch.delenv("HSDUMP_CORES")
    assert settings().cores is None


def test_empty_values_count_as_unset(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in Settings.model_fields:
        monkeypatch.setenv(f"HSDUMP_{name.upper()}", "")
    assert settings() == Settings()


def test_the_plugins_variables_are_ignored(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HSDUMP_LAYER_IDS", "2,30,58")
    monkeypatch.setenv("HSDUMP_PINNED_MB", "not checked here")
    assert settings() == Settings()


@pytest.mark.parametrize(
    ("name", "value", "wants"),
    [
        ("HSDUMP_WATCHER", "fanotify", "one of inotify, poll, watchfiles"),
        ("HSDUMP_DUMP_BUDGET_BYTES", "2GB", "a whole number of bytes above 0"),
        ("HSDUMP_DUMP_BUDGET_BYTES", "0", "a whole number of bytes above 0"),
        ("HSDUMP_CORES", "-1", "a whole number of cores above 0"),
        ("HSDUMP_LEASE_TTL_S", "nan", "a number of seconds above 0"),
        ("HSDUMP_COMMIT_INTERVAL_S", "-1", "a number of seconds, 0 or more"),
        ("HSDUMP_SHARD_WRITERS", "eight", "a whole number above 0"),
        ("HSDUMP_SWITCH_INTERVAL_US", "0", "a whole number of microseconds above 0"),
    ],
)
def test_a_malformed_value_names_the_variable_its_value_and_what_it_takes(
    monkeypatch: pytest.MonkeyPatch, name: str, value: str, wants: str
) -> None:
    monkeypatch.setenv(name, value)
    with pytest.raises(ConfigError, match=re.escape(f"{name} is {value!r}, expected {wants}")):
        settings()


def test_settings_are_frozen() -> None:
    with pytest.raises(pydantic.ValidationError, match="frozen"):
        settings().cores = 4  # type: ignore[misc]


def test_importing_reads_no_variable() -> None:
    """A malformed variable is an error when a setting is asked for, not at import."""
    code = "import hsdump._settings, hsdump._cores, hsdump._store.part, hsdump._client.watcher"
    env = {"HSDUMP_CORES": "many", "HSDUMP_COMMIT_INTERVAL_S": "soon", "PATH": ""}
    subprocess.run([sys.executable, "-c", code], env=env, check=True)


def test_import_hsdump_does_not_load_pydantic_settings() -> None:
    code = "import sys, hsdump; print('pydantic_settings' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_docs_list_every_variable_in_one_table() -> None:
    rows = re.findall(r"^\| `(HSDUMP_[A-Z_]+)` \|", DOCS.read_text(encoding="utf-8"), re.M)
    assert sorted(rows) == sorted(f"HSDUMP_{name.upper()}" for name in Settings.model_fields)


def test_a_client_given_no_dump_root_takes_hsdump_dump_dir(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from hsdump import HiddenStateClient

    monkeypatch.setenv("HSDUMP_DUMP_DIR", str(tmp_path))
    assert HiddenStateClient("http://127.0.0.1:9").dump_dir == tmp_path
    monkeypatch.setenv("HSDUMP_DUMP_DIR", "")
    assert HiddenStateClient("http://127.0.0.1:9").dump_dir == Path("/dev/shm/hsdump")
