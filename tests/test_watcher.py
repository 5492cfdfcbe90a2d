"""Every DumpWatcher implementation passes the shared conformance suite."""

from __future__ import annotations

from pathlib import Path

import pytest

from hsdump import ConfigError, DumpWatcher, InotifyWatcher, PollingWatcher, WatchfilesWatcher
from hsdump._client.watcher import default_watcher
from hsdump.testing import DumpWatcherTests


class TestInotifyWatcher(DumpWatcherTests):
    def make_watcher(self, root: Path) -> DumpWatcher:
        return InotifyWatcher(root)


class TestPollingWatcher(DumpWatcherTests):
    def make_watcher(self, root: Path) -> DumpWatcher:
        return PollingWatcher(root)


class TestWatchfilesWatcher(DumpWatcherTests):
    def make_watcher(self, root: Path) -> DumpWatcher:
        return WatchfilesWatcher(root)


def test_watchers_satisfy_the_protocol(tmp_path: Path) -> None:
    assert isinstance(InotifyWatcher(tmp_path), DumpWatcher)
    assert isinstance(PollingWatcher(tmp_path), DumpWatcher)
    assert isinstance(WatchfilesWatcher(tmp_path), DumpWatcher)


def test_default_watcher_follows_the_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HSDUMP_WATCHER", "poll")
    assert isinstance(default_watcher(tmp_path), PollingWatcher)
    assert isinstance(default_watcher(tmp_path, "inotify"), InotifyWatcher)
    monkeypatch.setenv("HSDUMP_WATCHER", "watchfiles")
    assert isinstance(default_watcher(tmp_path), WatchfilesWatcher)


def test_unknown_watcher_kind_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="unknown watcher 'fanotify'"):
        default_watcher(tmp_path, "fanotify")
