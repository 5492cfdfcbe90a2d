"""The core count every thread pool is sized by."""

from __future__ import annotations

import os

import pytest

from hsdump._cores import ENV_CORES, cores


def test_the_setting_wins(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV_CORES, "3")
    assert cores() == 3


@pytest.mark.parametrize("value", ["", "0", "-2", "many"])
def test_an_unusable_setting_falls_back_to_the_affinity(
    monkeypatch: pytest.MonkeyPatch, value: str
) -> None:
    monkeypatch.setenv(ENV_CORES, value)
    assert cores() == len(os.sched_getaffinity(0))
