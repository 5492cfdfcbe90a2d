"""The parent of a multi-process extraction posts its workers' requests: bounded, in order, and
every failure to reach the server is an answer the worker can raise."""

from __future__ import annotations

import select
import socket
import time
from pathlib import Path

import pytest
from _servers import count_requests

from hsdump import ServerUnavailable
from hsdump._client.sending import ServerAnswer
from hsdump._run.posting import Ask, ParentPosts
from hsdump.testing import FakeServer

pytestmark = pytest.mark.timeout(60)


def _body(rid: str) -> dict:
    return {"rid": rid, "input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 0}}


def _answers(posts: ParentPosts, n: int) -> list[tuple[Ask, ServerAnswer | Exception]]:
    got: list[tuple[Ask, ServerAnswer | Exception]] = []
    while len(got) < n:
        ready, _, _ = select.select([posts.wakeup], [], [], 30)
        assert ready, f"only {len(got)} of {n} answers came"
        got += posts.answers()
    return got


@pytest.fixture
def fake(tmp_path: Path):
    with FakeServer(tmp_path / "dumps", latency=0.05) as server:
        yield server


def test_posts_keep_at_most_slots_at_the_server_and_go_out_in_the_order_asked(fake) -> None:
    order, peak = count_requests(fake)
    posts = ParentPosts({0: fake.url}, slots=2, timeout=10)
    try:
        rids = [f"plain-{i}" for i in range(6)]  # not opted in: answered, nothing dumped
        for rid in rids:
            posts.ask(Ask("worker", 0, rid, None, _body(rid), 0.0))
        got = _answers(posts, 6)
    finally:
        posts.close()
    # with two slots, a request goes out only once all but one of those asked before it are answered
    assert sorted(order) == sorted(rids) and peak[0] == 2
    assert max(abs(order.index(rid) - i) for i, rid in enumerate(rids)) <= 1
    assert sorted(a.rid for a, _ in got) == sorted(rids)
    assert all(isinstance(o, ServerAnswer) and o.status_code == 200 for _, o in got)


def test_the_time_a_request_waited_for_its_slot_is_in_its_answer(fake) -> None:
    posts = ParentPosts({0: fake.url}, slots=1, timeout=10)
    try:
        asked = time.perf_counter()
        for rid in ("a", "b", "c"):
            posts.ask(Ask("worker", 0, rid, None, _body(rid), asked))
        waits = {a.rid: o.slot_wait_s for a, o in _answers(posts, 3)}
    finally:
        posts.close()
    # each waited for the latency of those before it
    assert waits["a"] < 0.04 and 0.04 < waits["b"] < waits["c"]


def test_what_a_gone_worker_asked_is_not_posted(fake) -> None:
    order, _ = count_requests(fake)
    posts = ParentPosts({0: fake.url}, slots=1, timeout=10)
    try:
        posts.ask(Ask("alive", 0, "first", None, _body("first"), 0.0))
        posts.ask(Ask("gone", 0, "dropped", None, _body("dropped"), 0.0))
        posts.ask(Ask("alive", 0, "second", None, _body("second"), 0.0))
        posts.forget("gone")
        got = _answers(posts, 2)
    finally:
        posts.close()
    assert order == ["first", "second"] and [a.rid for a, _ in got] == ["first", "second"]


def test_a_server_that_cannot_be_reached_is_answered_with_server_unavailable() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: nothing listens there
    posts = ParentPosts({0: f"http://127.0.0.1:{port}"}, slots=1, timeout=5)
    try:
        posts.ask(Ask("worker", 0, "r1", "s1", _body("r1"), 0.0))
        [(_ask, outcome)] = _answers(posts, 1)
    finally:
        posts.close()
    assert isinstance(outcome, ServerUnavailable)
    assert (outcome.sample_id, outcome.rid) == ("s1", "r1") and f":{port}" in outcome.message
