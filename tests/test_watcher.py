"""Every DumpWatcher implementation passes the shared conformance suite."""

from __future__ import annotations

from pathlib import Path

import pytest

from hsdump import (
    ConfigError,
    DumpWatcher,
    HiddenStateClient,
    InotifyWatcher,
    PollingWatcher,
    Sample,
    WatchfilesWatcher,
)
from hsdump.testing import DumpWatcherTests, FakeServer

WATCHERS = (InotifyWatcher, PollingWatcher, WatchfilesWatcher)


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


def _made_watchers(monkeypatch: pytest.MonkeyPatch) -> list[type]:
    """The watcher classes constructed from now on, in order."""
    made: list[type] = []
    for cls in WATCHERS:

        def init(self: DumpWatcher, *args: object, _init=cls.__init__, **kwargs: object) -> None:  # type: ignore[no-untyped-def]
            made.append(type(self))
            _init(self, *args, **kwargs)

        monkeypatch.setattr(cls, "__init__", init)
    return made


async def _open_and_extract(server: FakeServer, root: Path, watcher: str | None = None) -> None:
    async with HiddenStateClient(server.url, dump_dir=root, watcher=watcher) as client:
        assert (await client.extract(Sample("s1", [1, 2, 3]))).num_tokens == 3


@pytest.mark.anyio
@pytest.mark.parametrize(
    ("env", "arg", "want"),
    [
        ("poll", None, PollingWatcher),
        ("watchfiles", None, WatchfilesWatcher),
        ("poll", "inotify", InotifyWatcher),
        ("inotify", "poll", PollingWatcher),
    ],
)
async def test_a_client_watches_with_its_argument_else_the_environments_watcher(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, env: str, arg: str | None, want: type
) -> None:
    monkeypatch.setenv("HSDUMP_WATCHER", env)
    with FakeServer(tmp_path) as server:
        made = _made_watchers(monkeypatch)
        await _open_and_extract(server, tmp_path, arg)
    assert made == [want]


@pytest.mark.anyio
async def test_a_client_given_a_watcher_uses_it_and_leaves_the_environment_alone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HSDUMP_WATCHER", "watchfiles")
    with FakeServer(tmp_path) as server:
        watcher = PollingWatcher(tmp_path)
        made = _made_watchers(monkeypatch)
        async with HiddenStateClient(server.url, dump_dir=tmp_path, watcher=watcher) as client:
            assert (await client.extract(Sample("s1", [1, 2]))).num_tokens == 2
    assert made == []


@pytest.mark.anyio
async def test_an_unknown_watcher_kind_is_a_config_error_at_open(tmp_path: Path) -> None:
    with FakeServer(tmp_path) as server:
        client = HiddenStateClient(server.url, dump_dir=tmp_path, watcher="fanotify")
        with pytest.raises(ConfigError, match=r"unknown watcher 'fanotify'.*'inotify', 'poll'"):
            await client.open()
        assert server.received == []  # refused before any request


@pytest.mark.anyio
async def test_an_unknown_watcher_in_the_environment_is_a_config_error_naming_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HSDUMP_WATCHER", "fanotify")
    with FakeServer(tmp_path) as server:
        with pytest.raises(ConfigError, match=r"HSDUMP_WATCHER.*fanotify"):
            await _open_and_extract(server, tmp_path)
