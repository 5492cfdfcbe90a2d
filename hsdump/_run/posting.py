"""The requests of a multi-process extraction, posted by its parent process.

A worker's interpreter is busy checking and compressing dumps: its threads take turns on one lock,
and a request sent from there, or its answer, waits for that lock (37 ms a request in total at
one request in flight on a 16-core host, against 29 ms of prefill). So each worker hands its
requests to the parent (`hsdump._run.worker`), and `ParentPosts` posts them from threads of this
otherwise idle process, at most ``slots`` at each server, granted in the order asked. The worker
keeps everything else: it chose the request id, it watches for the dump, and it checks the answer
(`HiddenStateClient`), so identity is still matched where the dump is read.

The threads only post; every message to a worker is sent by the parent's loop, which `wakeup`
wakes when an answer is in (`answers`).
"""

from __future__ import annotations

import contextlib
import queue
import socket
import threading
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import httpx

from hsdump._client.sending import ServerAnswer, post_sync
from hsdump._exceptions import HsdumpError, ServerUnavailable

__all__ = ["Ask", "ParentPosts"]


@dataclass(frozen=True)
class Ask:
    """One worker's request, waiting for a slot at its server or at the server."""

    owner: Any  # the worker that asked (answers go back to it)
    server: int
    rid: str
    sample_id: str | None
    body: dict[str, Any]
    asked: float  # time.perf_counter() when it came in


class ParentPosts:
    """Posts the workers' requests, at most ``slots`` at a time at each server."""

    def __init__(self, urls: dict[int, str], *, slots: int, timeout: float):
        self._urls, self._slots, self._timeout = urls, slots, timeout
        self._waiting: dict[int, deque[Ask]] = {server: deque() for server in urls}
        self._busy = dict.fromkeys(urls, 0)
        self._pool = ThreadPoolExecutor(slots * len(urls), thread_name_prefix="hsdump-post")
        self._local = threading.local()
        self._clients: list[httpx.Client] = []
        self._clients_lock = threading.Lock()
        self._done: queue.SimpleQueue[tuple[Ask, ServerAnswer | HsdumpError]] = queue.SimpleQueue()
        self.wakeup, self._wake = socket.socketpair()
        self._wake.setblocking(False)  # a full buffer already holds a wake-up

    def ask(self, ask: Ask) -> None:
        """Queue ``ask``; it is posted as soon as its server has a free slot."""
        self._waiting[ask.server].append(ask)
        self._start(ask.server)

    @property
    def posted(self) -> int:
        """Requests at the servers now (posted, not answered yet)."""
        return sum(self._busy.values())

    def forget(self, owner: Any) -> None:
        """Drop what ``owner`` asked that is not posted yet (it died or ended)."""
        for server, waiting in self._waiting.items():
            self._waiting[server] = deque(a for a in waiting if a.owner is not owner)

    def answers(self) -> list[tuple[Ask, ServerAnswer | HsdumpError]]:
        """The answers in since the last call; their slots go to the next requests first."""
        with contextlib.suppress(BlockingIOError):
            self.wakeup.recv(4096, socket.MSG_DONTWAIT)
        done = []
        while True:
            try:
                done.append(self._done.get_nowait())
            except queue.Empty:
                break
        for ask, _ in done:
            self._busy[ask.server] -= 1
        for server in {ask.server for ask, _ in done}:
            self._start(server)
        return done

    def close(self) -> None:
        """Drop what is waiting and close: a post still under way ends with its connection."""
        for waiting in self._waiting.values():
            waiting.clear()
        self._pool.shutdown(wait=False, cancel_futures=True)
        with self._clients_lock:
            for client in self._clients:
                client.close()
        self.wakeup.close()
        self._wake.close()

    def _start(self, server: int) -> None:
        waiting = self._waiting[server]
        while waiting and self._busy[server] < self._slots:
            self._busy[server] += 1
            self._pool.submit(self._post, waiting.popleft(), time.perf_counter())

    def _post(self, ask: Ask, sent: float) -> None:
        outcome: ServerAnswer | HsdumpError
        try:
            answer = post_sync(
                self._client(ask.server), ask.body, timeout=self._timeout,
                sample_id=ask.sample_id, rid=ask.rid,
            )  # fmt: skip
            outcome = ServerAnswer(
                answer.status_code, answer.text, sent - ask.asked, answer.server_s
            )
        except HsdumpError as exc:
            outcome = exc
        except Exception as exc:  # any failure must free its slot and reach the worker
            outcome = ServerUnavailable(
                f"posting to {self._urls[ask.server]} failed: {exc!r}",
                sample_id=ask.sample_id, rid=ask.rid,
            )  # fmt: skip
        self._done.put((ask, outcome))
        with contextlib.suppress(OSError):
            self._wake.send(b".")

    def _client(self, server: int) -> httpx.Client:
        clients: dict[int, httpx.Client] = self._local.__dict__.setdefault("clients", {})
        if server not in clients:
            clients[server] = httpx.Client(base_url=self._urls[server], timeout=self._timeout)
            with self._clients_lock:
                self._clients.append(clients[server])
        return clients[server]
