"""How a /generate request reaches the server: `RequestSender`, and its two implementations.

`HiddenStateClient` sends each request through a sender. By default that is `HttpSender`, its own
``httpx.AsyncClient``. A multi-process extraction gives each worker a sender that hands the
request to the parent process instead (`hsdump._run.worker`), which posts it with `post_sync`
from an idle interpreter: the request goes out, and its answer comes in, without waiting for the
worker's threads that check and compress the dumps before it.

Either way the answer is a `ServerAnswer`, and a failure to reach the server is a `ServerTimeout`
or `ServerUnavailable` made by `transport_error`, so the client checks every answer in one place.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import httpx

from hsdump._exceptions import HsdumpError, ServerTimeout, ServerUnavailable

__all__ = ["HttpSender", "RequestSender", "ServerAnswer", "post_sync", "transport_error"]

GENERATE = "/generate"


@dataclass(frozen=True)
class ServerAnswer:
    """The server's HTTP answer to one request, unparsed.

    Attributes:
        status_code: The HTTP status.
        text: The body.
        slot_wait_s: Seconds the request waited for a slot before it was sent (a sender that
            bounds requests in flight itself, as the parent of a multi-process run does).
        server_s: Seconds from sending the request to its answer.
    """

    status_code: int
    text: str
    slot_wait_s: float = 0.0
    server_s: float = 0.0


@runtime_checkable
class RequestSender(Protocol):
    """Sends one /generate request and returns the server's answer.

    Raises `ServerTimeout` or `ServerUnavailable` (see `transport_error`) when the server gives
    no answer; any HTTP status is an answer, which the client checks.
    """

    async def post(self, body: dict[str, Any], *, sample_id: str | None, rid: str) -> ServerAnswer:
        """Send ``body`` to /generate."""
        ...


def transport_error(
    exc: httpx.HTTPError, *, base_url: str, timeout: float, sample_id: str | None, rid: str
) -> HsdumpError:
    """The `HsdumpError` for a request that got no answer (``raise ... from exc``)."""
    if isinstance(exc, httpx.TimeoutException):
        return ServerTimeout(f"no response within {timeout:g} s", sample_id=sample_id, rid=rid)
    return ServerUnavailable(
        f"the connection to {base_url} failed: {exc!r}", sample_id=sample_id, rid=rid
    )


class HttpSender:
    """Posts through an ``httpx.AsyncClient`` whose base URL is the server's."""

    def __init__(self, http: httpx.AsyncClient, *, timeout: float):
        self._http = http
        self._timeout = timeout

    async def post(self, body: dict[str, Any], *, sample_id: str | None, rid: str) -> ServerAnswer:
        """Send ``body`` to /generate."""
        started = time.perf_counter()
        try:
            response = await self._http.post(GENERATE, json=body)
        except (httpx.TimeoutException, httpx.TransportError) as exc:
            where = str(self._http.base_url).rstrip("/")
            raise transport_error(
                exc, base_url=where, timeout=self._timeout, sample_id=sample_id, rid=rid
            ) from exc
        return ServerAnswer(response.status_code, response.text, 0.0, time.perf_counter() - started)


def post_sync(
    http: httpx.Client, body: dict[str, Any], *, timeout: float, sample_id: str | None, rid: str
) -> ServerAnswer:
    """`HttpSender.post` from a thread, through a blocking ``httpx.Client``."""
    started = time.perf_counter()
    try:
        response = http.post(GENERATE, json=body)
    except (httpx.TimeoutException, httpx.TransportError) as exc:
        where = str(http.base_url).rstrip("/")
        raise transport_error(
            exc, base_url=where, timeout=timeout, sample_id=sample_id, rid=rid
        ) from exc
    return ServerAnswer(response.status_code, response.text, 0.0, time.perf_counter() - started)
