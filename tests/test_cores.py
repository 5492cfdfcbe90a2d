"""The core count a store's and a client's thread pools are sized by: the argument, else
``HSDUMP_CORES``, else this process's CPU affinity."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from hsdump import ConfigError, HiddenStateClient, StoreOptions, open_store

URL = "http://127.0.0.1:9"  # a client is only made here, never opened


def test_the_setting_wins_over_the_affinity(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HSDUMP_CORES", "3")
    assert StoreOptions().resolved().cores == 3


def test_the_argument_wins_over_the_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HSDUMP_CORES", "3")
    assert StoreOptions(cores=5).resolved().cores == 5


def test_an_empty_setting_falls_back_to_the_affinity(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HSDUMP_CORES", "")
    assert StoreOptions().resolved().cores == len(os.sched_getaffinity(0))


@pytest.mark.parametrize(("cores", "writers"), [(1, 2), (2, 2), (10, 5), (16, 8), (64, 8)])
def test_shard_writers_are_one_per_two_cores_from_2_to_8(cores: int, writers: int) -> None:
    assert StoreOptions(cores=cores).resolved().shard_writers == writers


@pytest.mark.parametrize("value", ["0", "-2", "many"])
def test_a_malformed_setting_is_refused_by_name(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, value: str
) -> None:
    monkeypatch.setenv("HSDUMP_CORES", value)
    said = f"HSDUMP_CORES is '{value}', expected a whole number"
    with pytest.raises(ConfigError, match=said):
        open_store(tmp_path / "s.zarr", "a")
    with pytest.raises(ConfigError, match=said):
        HiddenStateClient(URL, dump_dir=tmp_path)


def test_a_client_given_its_cores_and_dump_root_does_not_read_the_setting(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("HSDUMP_CORES", "many")
    assert HiddenStateClient(URL, dump_dir=tmp_path, cores=2).dump_dir == tmp_path


@pytest.mark.parametrize("cores", [0, -1])
def test_cores_below_one_are_refused(cores: int) -> None:
    with pytest.raises(ConfigError, match=f"StoreOptions.cores must be above 0, got {cores}"):
        StoreOptions(cores=cores)
