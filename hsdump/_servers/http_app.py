"""An HTTP front end that speaks the subset of SGLang's API hsdump uses, over a pluggable engine.

The reference server (a real transformers model) and the test fake (`hsdump.testing`) are both
an `Engine` behind `SGLangCompatibleServer`, so the client always talks real HTTP on
loopback to the same endpoints a real SGLang server offers: ``POST /generate``, ``GET /health``,
``/health_generate``, ``/ready``, ``/server_info`` (alias ``/get_server_info``) and ``/model_info``
(alias ``/get_model_info``).
"""

from __future__ import annotations

import contextlib
import logging
import socket
import threading
import time
from typing import Any, Protocol

from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.applications import Starlette
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from hsdump._exceptions import ServerStartError

__all__ = [
    "DropConnection",
    "Engine",
    "GenerateRequest",
    "RequestRejected",
    "SGLangCompatibleServer",
    "prefill_response",
]

logger = logging.getLogger(__name__)


class GenerateRequest(BaseModel):
    """The fields of SGLang's ``/generate`` body that hsdump sends (SGLang ignores others too)."""

    model_config = ConfigDict(extra="ignore")

    rid: str | None = None
    input_ids: list[int] | None = None
    text: str | None = None
    sampling_params: dict[str, Any] = Field(default_factory=dict)
    extra_key: str | None = None
    stream: bool = False


class RequestRejected(Exception):
    """Raised by an engine to answer with an HTTP error status."""

    def __init__(self, status_code: int, message: str):
        super().__init__(message)
        self.status_code = status_code


class DropConnection(Exception):
    """Raised by an engine to cut the connection after the headers (a reset mid-request)."""


class Engine(Protocol):
    """What runs behind the HTTP front end."""

    def server_info(self) -> dict[str, Any]:
        """Flat server settings, as SGLang's ``/server_info`` returns them."""
        ...

    def model_info(self) -> dict[str, Any]:
        """SGLang's ``/model_info`` body."""
        ...

    async def generate(self, request: GenerateRequest) -> dict[str, Any]:
        """Run the request's prefill (dumping it if opted in) and return the response body."""
        ...


def prefill_response(rid: str, num_prompt_tokens: int, started: float) -> dict[str, Any]:
    """The body SGLang returns for a prefill-only request (``max_new_tokens: 0``)."""
    return {
        "output_ids": [],
        "meta_info": {
            "id": rid,
            "prompt_tokens": num_prompt_tokens,
            "completion_tokens": 0,
            "cached_tokens": 0,
            "finish_reason": {"type": "length", "length": 0},
            "e2e_latency": time.perf_counter() - started,
        },
    }


class _BrokenResponse(Response):
    """Sends the headers of a long body, then fails, so the client sees the connection cut."""

    def __init__(self) -> None:
        super().__init__(status_code=200, headers={"content-length": "1000000"})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
        await send({"type": "http.response.body", "body": b"{", "more_body": True})
        raise DropConnection("connection cut on purpose")


def _error(status_code: int, message: str) -> JSONResponse:
    return JSONResponse({"error": {"message": message}}, status_code=status_code)


def build_app(engine: Engine) -> Starlette:
    """The ASGI application serving ``engine``."""

    async def generate(request: Request) -> Response:
        try:
            body = GenerateRequest.model_validate_json(await request.body())
        except ClientDisconnect:  # a cancelled client left mid-request: no one to answer
            return Response(status_code=499)
        except ValidationError as exc:
            return _error(400, f"invalid request: {exc}")
        try:
            return JSONResponse(await engine.generate(body))
        except RequestRejected as exc:
            return _error(exc.status_code, str(exc))
        except DropConnection:
            return _BrokenResponse()

    async def health(request: Request) -> Response:
        return Response(status_code=200)

    async def server_info(request: Request) -> Response:
        return JSONResponse(engine.server_info())

    async def model_info(request: Request) -> Response:
        return JSONResponse(engine.model_info())

    routes = [
        Route("/generate", generate, methods=["POST"]),
        *(Route(p, health) for p in ("/health", "/health_generate", "/ready")),
        *(Route(p, server_info) for p in ("/server_info", "/get_server_info")),
        *(Route(p, model_info) for p in ("/model_info", "/get_model_info")),
    ]
    return Starlette(routes=routes)


class SGLangCompatibleServer:
    """Serves an engine over HTTP from a background thread (its own event loop).

    Usable from sync code and from inside an event loop alike::

        with SGLangCompatibleServer(engine) as server:
            ...  # server.url

    Args:
        engine: What answers the requests.
        host: Interface to bind; loopback unless told otherwise.
        port: TCP port; 0 picks a free one.
    """

    def __init__(self, engine: Engine, *, host: str = "127.0.0.1", port: int = 0):
        self.engine = engine
        self.host = host
        self.port = port
        self._server: Any = None
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        """Base URL of the running server."""
        return f"http://{self.host}:{self.port}"

    def start(self, timeout: float = 30.0) -> None:
        """Start serving; returns once the socket accepts connections.

        Raises:
            ServerStartError: The server exited before serving (the port is taken, the host is not
                an address of this machine) or did not start within ``timeout`` seconds.
        """
        import uvicorn

        config = uvicorn.Config(
            build_app(self.engine),
            host=self.host,
            port=self.port,
            log_level="warning",
            access_log=False,
            lifespan="off",
        )
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._serve, name="hsdump-http", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self._server.started:
            if not self._thread.is_alive():
                raise ServerStartError(
                    f"the HTTP server could not listen on {self.host}:{self.port}"
                    f"{_bind_problem(self.host, self.port)}. Choose another port (0 picks a free "
                    "one) or a host that is an address of this machine"
                )
            if time.monotonic() > deadline:
                self.stop()
                raise ServerStartError(
                    f"the HTTP server on {self.host}:{self.port} did not start serving within "
                    f"{timeout:g} s: the machine may be overloaded; raise the start timeout"
                )
            time.sleep(0.01)
        self.port = self._server.servers[0].sockets[0].getsockname()[1]
        logger.info("serving on %s", self.url)

    def _serve(self) -> None:
        with contextlib.suppress(
            SystemExit
        ):  # uvicorn exits when it cannot listen: start() says why
            self._server.run()

    def stop(self, timeout: float = 10.0) -> None:
        """Stop serving and join the thread."""
        if self._server is not None:
            self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout)
        self._server = self._thread = None

    def __enter__(self) -> SGLangCompatibleServer:
        self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()


def _bind_problem(host: str, port: int) -> str:
    """Why ``host:port`` cannot be listened on, as ``": reason"`` (empty if it now can)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
            probe.bind((host, port))
    except OSError as exc:
        return f": {exc.strerror or exc}"
    return ""
