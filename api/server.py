"""The API process: app factory and entry point.

Rank 0 starts it by file path, `python -P <tapserve>/api/server.py *ApiConfig(...).to_argv()`
(see api/config.py for the options). It loads no torch and no
model code: tokenizer via `tokenizers`, chat templates via jinja2, custom outputs via numpy.
Everything lives in the app built by `create_app` (no module-level state).

Gate (pure ASGI, before routing): Bearer API key on every path but /health (constant-time
compare), request body size limit (413), and request metrics (status, latency).
"""

from __future__ import annotations

import asyncio
import dataclasses
import hmac
import logging
import os
import socket
import sys
import time
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

if not __package__:  # run by file path: bind `tapserve` to this checkout or installed copy
    import runpy

    runpy.run_path(str(Path(__file__).resolve().parents[1] / "_checkout.py"))

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from tapserve.api import native, openai
from tapserve.api.config import ApiConfig
from tapserve.api.engine_client import EngineClient
from tapserve.api.errors import STREAM_ERROR_STATUS, ApiError, error_body, install_handlers
from tapserve.api.gc_policy import settle_after_startup
from tapserve.api.lifecycle import Lifecycle, Server, watchdog
from tapserve.api.metrics import CONTENT_TYPE, ApiMetrics
from tapserve.api.state import AppState, ClientGone
from tapserve.api.token_list import DETOKENIZE_MAX_BODY_BYTES
from tapserve.api.tokenizer import TextTokenizer

__all__ = ["ApiConfig", "create_app", "main"]
log = logging.getLogger("tapserve.api")
_GENERATION_PATHS = ("/v1/completions", "/v1/chat/completions", "/generate", "/custom_output")
CLIENT_GONE = 499  # nginx's "client closed request": how a request that lost its client counts


class Gate:
    """ASGI middleware: auth, body limit, request metrics."""

    def __init__(self, app: Any, config: ApiConfig, metrics: ApiMetrics):
        self.app, self.config, self.metrics = app, config, metrics
        self._key = config.api_key.encode() if config.api_key else None

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path, start = scope["path"], time.monotonic()
        measured = path in _GENERATION_PATHS
        if self._key is not None and path != "/health" and not self._authorized(scope):
            return await self._refuse(
                send, ApiError(401, "invalid or missing API key"), path, start
            )
        limit = self._body_limit(path)
        declared = _header(scope, b"content-length")
        if declared and declared.isdigit() and int(declared) > limit:
            return await self._refuse(send, self._too_large(path), path, start)
        body, ended = await _read_body(receive, limit)
        if ended == "too large":
            return await self._refuse(send, self._too_large(path), path, start)
        if ended == "client gone":  # the upload was cut off: nothing to parse or answer
            if measured:
                self._count(path, start, CLIENT_GONE)
            return
        if not measured:
            return await self.app(scope, _replay(body, receive), send)
        response, client = _ResponseRecord(send), _ClientRecord(receive)
        failed, state = False, scope.setdefault("state", {})
        try:
            await self.app(scope, _replay(body, client.receive), response.send)
        except BaseException:
            failed = True
            raise
        finally:  # a response cut short counts as the client's leaving (499) or a failure;
            # a stream that ended in an error event counts as that error's status
            self._count(
                path,
                start,
                state.get(STREAM_ERROR_STATUS, response.status)
                if response.complete
                else CLIENT_GONE
                if client.gone and not failed
                else 500,
            )

    async def _refuse(self, send: Any, error: ApiError, path: str, start: float) -> None:
        """Answer an error before the app runs (401, 413); a generation path counts it."""
        await _send_error(send, error, path)
        if path in _GENERATION_PATHS:
            self._count(path, start, error.status)

    def _count(self, path: str, start: float, status: int) -> None:
        if status < 400:  # served: a refusal's few ms would pull the latencies down (vLLM
            self.metrics.e2e.observe(time.monotonic() - start)  # times finished requests)
        self.metrics.requests.labels(endpoint=path, status=str(status)).inc()

    def _authorized(self, scope: dict) -> bool:
        # the header's own bytes (latin-1 gives them back): a key beyond ASCII arrives as
        # the client's UTF-8
        auth = (_header(scope, b"authorization") or "").encode("latin-1")
        scheme, _, token = auth.partition(b" ")
        return scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self._key)

    def _body_limit(self, path: str) -> int:
        """max_body_bytes; /detokenize's own, lower cap where that is lower (its JSON list
        of ids is parsed on the event loop where it cannot be parsed off it)."""
        if path == "/detokenize":
            return min(self.config.max_body_bytes, DETOKENIZE_MAX_BODY_BYTES)
        return self.config.max_body_bytes

    def _too_large(self, path: str) -> ApiError:
        where = " for /detokenize" if path == "/detokenize" else ""
        return ApiError(413, f"request body larger than {self._body_limit(path)} bytes{where}")


class _ResponseRecord:
    """Passes a response's messages on and notes its status and whether it completed."""

    def __init__(self, send: Any):
        self._send, self.status, self.complete = send, 500, False

    async def send(self, message: dict) -> None:
        if message["type"] == "http.response.start":
            self.status = message["status"]
        await self._send(message)
        if message["type"] == "http.response.body" and not message.get("more_body"):
            self.complete = True


class _ClientRecord:
    """Passes the client's messages on and notes a disconnect."""

    def __init__(self, receive: Any):
        self._receive, self.gone = receive, False

    async def receive(self) -> dict:
        message = await self._receive()
        self.gone = self.gone or message["type"] == "http.disconnect"
        return message


def _header(scope: dict, name: bytes) -> str | None:
    for key, value in scope.get("headers", []):
        if key.lower() == name:
            return value.decode("latin-1")
    return None


async def _read_body(receive: Any, limit: int) -> tuple[bytes, str]:
    """The whole request body, and how it ended: "complete", "too large" (over `limit`
    bytes) or "client gone" (a disconnect before its end)."""
    chunks, size = [], 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return b"", "client gone"
        if message["type"] != "http.request":
            return b"".join(chunks), "complete"
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            return b"", "too large"
        chunks.append(chunk)
        if not message.get("more_body"):
            return b"".join(chunks), "complete"


def _replay(body: bytes, receive: Any) -> Any:
    sent = [False]

    async def replayed() -> dict:
        if not sent[0]:
            sent[0] = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replayed


async def _send_error(send: Any, error: ApiError, path: str) -> None:
    response = JSONResponse(
        error_body(error, path),
        status_code=error.status,
        headers={"WWW-Authenticate": "Bearer"} if error.code == 401 else None,
    )
    await response({"type": "http"}, _never, send)


async def _never() -> dict:
    return {"type": "http.disconnect"}


def create_app(
    config: ApiConfig, tokenizer: TextTokenizer | None = None, lifecycle: Lifecycle | None = None
) -> Any:
    """Build the ASGI app (FastAPI wrapped in the Gate) for one API process. lifecycle: how
    the process ends (api/lifecycle.py; main's server stops when it says so)."""
    tokenizer = tokenizer or TextTokenizer.from_dir(
        config.tokenizer, config.chat_template, config.split_special_tokens_in_messages
    )
    lifecycle = lifecycle or Lifecycle(config.parent_pid or os.getppid())
    holder: dict[str, EngineClient] = {}
    metrics = ApiMetrics(lambda: holder["client"].stats)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        client = EngineClient(config.ipc_dir)
        holder["client"] = client
        await client.start()
        app.state.tapserve = AppState(config, tokenizer, client, metrics)
        lifecycle.attach(client)
        guard = asyncio.create_task(watchdog(config, client, lifecycle))
        log.info("tapserve API listening on %s (model %s)", config.url, config.served_model_name)
        try:
            yield
        finally:
            lifecycle.detach()
            guard.cancel()
            await client.close()

    app = FastAPI(
        title="tapserve", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None
    )
    install_handlers(app)

    @app.exception_handler(ClientGone)
    async def client_gone(request: Request, exc: ClientGone) -> Response:
        # the client left before its answer (its requests are aborted): nothing to send, and
        # nginx's 499 "client closed request" in the request metrics rather than a 500
        return Response(status_code=499)

    app.include_router(openai.build_router())
    app.include_router(native.build_router())

    @app.get("/health")
    async def health(request: Request) -> Response:
        client: EngineClient = request.app.state.tapserve.client
        if client.healthy(config.health_timeout_s):
            return JSONResponse({"status": "ok"})
        reason = "shutting down" if client.shutting_down else "engine not responding"
        return JSONResponse({"status": reason}, status_code=503)

    @app.get("/metrics")
    async def prometheus(request: Request) -> Response:
        metrics.in_flight.set(request.app.state.tapserve.client.num_in_flight)
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    return Gate(app, config, metrics)


def main(argv: list[str] | None = None) -> None:
    config = ApiConfig.from_argv(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(
        level=config.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    sockets = None
    if config.port == 0:  # bound here, so that the log names the port the kernel picked
        sockets = [_listening_socket(config.host)]
        config = dataclasses.replace(config, port=sockets[0].getsockname()[1])
    lifecycle = Lifecycle(config.parent_pid or os.getppid())
    app = create_app(config, lifecycle=lifecycle)
    server = Server(
        uvicorn.Config(
            app,
            host=config.host,
            port=config.port,
            log_level=config.log_level,
            access_log=config.log_requests,
            timeout_graceful_shutdown=config.graceful_timeout_s,
        ),
        lifecycle,
    )
    settle_after_startup()
    server.run(sockets=sockets)


def _listening_socket(host: str) -> socket.socket:
    """A TCP socket bound to host on a port of the kernel's choice (as uvicorn binds one)."""
    family, kind, proto, _, address = socket.getaddrinfo(
        host, 0, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
    )[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(address)
    return sock


if __name__ == "__main__":
    main()
