"""What an operator sets between clients and the engine: the API key, the queue bound, the drain.

`ServerConfig` holds the settings. `ApiKeyMiddleware` answers 401 to a request for a protected
path (every `/v1` route, `/tokenize`, `/detokenize`, `/tokenizer_info`) without `Authorization: Bearer <key>`;
`/health` and `/metrics` stay open, for load balancers and scrapers. It is plain ASGI, not
Starlette's BaseHTTPMiddleware, so a streamed response and the non-streaming route's wait for
`http.disconnect` pass through it untouched. `DrainingServer` is uvicorn's server with the drain
on its exit signal, and `run_until_drained` runs it so that a finished drain exits 0.
"""

from __future__ import annotations

import hmac
import signal
import threading
from collections.abc import Callable
from dataclasses import dataclass
from types import FrameType
from typing import TYPE_CHECKING

import uvicorn
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from nanoserve.serving.server.reasoning import PARSERS

if TYPE_CHECKING:
    from nanoserve.serving.async_engine import AsyncEngine

PROTECTED_PATHS = ("/tokenize", "/detokenize", "/tokenizer_info")  # beside everything under /v1


@dataclass(frozen=True)
class ServerConfig:
    """How the server guards the engine (the engine's own settings are EngineConfig's)."""

    api_key: str | None = None  # None: no key is asked for
    max_waiting_requests: int | None = 128  # a request finding this many waiting for a slot gets a 503
    retry_after_s: int = 1  # the Retry-After such a 503 carries
    drain_timeout_s: float = 30.0  # after SIGTERM, how long in-flight requests may take to finish
    # chat completions: a reasoning model's <think> block returned as reasoning_content (reasoning.PARSERS)
    reasoning_parser: str | None = None
    # tokens a think block may run before </think> is forced (llama.cpp's --reasoning-budget): -1 no limit
    reasoning_budget: int = -1

    def __post_init__(self) -> None:
        if self.api_key is not None and not self.api_key:
            raise ValueError("api_key='' would accept an empty bearer token: pass None for no key")
        if self.max_waiting_requests is not None and self.max_waiting_requests < 1:
            raise ValueError(f"max_waiting_requests={self.max_waiting_requests} must be >= 1 (or None: no bound)")
        if self.retry_after_s < 0:
            raise ValueError(f"retry_after_s={self.retry_after_s} must be >= 0")
        if not self.drain_timeout_s >= 0:
            raise ValueError(f"drain_timeout_s={self.drain_timeout_s} must be >= 0")
        if self.reasoning_parser is not None and self.reasoning_parser not in PARSERS:
            raise ValueError(f"reasoning_parser={self.reasoning_parser!r} is not one of {list(PARSERS)}")
        budget = self.reasoning_budget
        if not isinstance(budget, int) or isinstance(budget, bool) or budget < -1:
            raise ValueError(f"reasoning_budget={budget!r} must be -1 (no limit) or an integer >= 0")
        if budget != -1 and self.reasoning_parser is None:
            raise ValueError(f"reasoning_budget={budget} needs a reasoning parser (--reasoning-parser): it is what "
                             "finds the think block")


def is_protected(path: str) -> bool:
    return path == "/v1" or path.startswith("/v1/") or path in PROTECTED_PATHS


class ApiKeyMiddleware:
    """401 with an OpenAI-style error body for a protected path without the right bearer token.

    Keys are compared with `hmac.compare_digest`, in time independent of where they differ.
    `on_refused` is called for each request turned away (the server counts them).
    """

    def __init__(self, app: ASGIApp, api_key: str, on_refused: Callable[[], None] | None = None) -> None:
        self.app = app
        self.token = api_key.encode()
        self.on_refused = on_refused

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not is_protected(scope["path"]) or self._authorized(scope):
            await self.app(scope, receive, send)
            return
        if self.on_refused is not None:
            self.on_refused()
        error = {"message": "a valid API key is required: send it as `Authorization: Bearer <key>`",
                 "type": "invalid_request_error", "param": None, "code": "invalid_api_key"}
        response = JSONResponse({"error": error}, status_code=401, headers={"WWW-Authenticate": "Bearer"})
        await response(scope, receive, send)

    def _authorized(self, scope: Scope) -> bool:
        given = next((value for name, value in scope["headers"] if name == b"authorization"), b"")
        scheme, _, token = given.partition(b" ")
        return scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self.token)  # scheme: RFC 9110


class DrainingServer(uvicorn.Server):
    """uvicorn's server, draining on SIGTERM or SIGINT.

    From the signal on the AsyncEngine takes no new request (a 503, for one that still arrives on
    an open connection) and /health answers 503. uvicorn itself closes the listener, closes idle
    connections, lets the others finish their responses for up to `timeout_graceful_shutdown`
    seconds and then cancels them (which aborts their requests and frees their blocks); the app's
    lifespan shutdown then aborts anything left in the engine.
    """

    def __init__(self, config: uvicorn.Config, async_engine: AsyncEngine) -> None:
        super().__init__(config)
        self.async_engine = async_engine

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        self.async_engine.drain()
        super().handle_exit(sig, frame)


def run_until_drained(server: uvicorn.Server) -> None:
    """Runs `server` until a signal stops it. uvicorn re-raises the signal once its graceful
    shutdown is done, so that the process ends as the signal's default would (-15 for SIGTERM);
    a drain that ran its course is a clean stop, so here SIGTERM's re-raise is swallowed and the
    process goes on to exit 0."""
    if threading.current_thread() is not threading.main_thread():  # no signals off the main thread
        server.run()
        return
    previous = signal.signal(signal.SIGTERM, lambda sig, frame: None)
    try:
        server.run()
    finally:
        signal.signal(signal.SIGTERM, previous)
