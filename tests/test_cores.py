"""The core count every thread pool is sized by."""

from __future__ import annotations

import os

import pytest

from hsdump import ConfigError
from hsdump._cores import ENV_CORES, cores


def test_the_setting_wins(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV_CORES, "3")
    assert cores() == 3


def test_an_empty_setting_falls_back_to_the_affinity(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV_CORES, "")
    assert cores() == len(os.sched_getaffinity(0))


@pytest.mark.parametrize("value", ["0", "-2", "many"])
def test_a_malformed_setting_is_refused_by_name(
    monkeypatch: pytest.MonkeyPatch, value: str
) -> None:
    monkeypatch.setenv(ENV_CORES, value)
    with pytest.raises(ConfigError, match=f"HSDUMP_CORES is '{value}', expected a whole number"):
        cores()
