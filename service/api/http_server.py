"""The HTTP API (FastAPI): health, readiness, metrics, errors, body limits, and the routers."""

from __future__ import annotations

import json
import logging
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from service.api.context import ServiceContext
from service.api.deps import UPLOAD_PATH
from service.api.errors import HANDLED, retry_after, status_of
from service.api.http_admin import router as admin_router
from service.api.http_chat import router as chat_router
from service.api.http_collective import router as collective_router
from service.api.http_openai import router as openai_router
from service.api.http_sglang import router as sglang_router
from service.api.http_transfer import router as transfer_router
from service.api.http_vllm import router as vllm_router

logger = logging.getLogger(__name__)

Scope = MutableMapping[str, Any]
ASGIApp = Callable[[Scope, Callable[[], Awaitable[Any]], Callable[[Any], Awaitable[None]]], Awaitable[None]]


def header_deadline(timeout_s: float) -> type[HttpToolsProtocol]:
    """uvicorn's HTTP protocol with a deadline on each request's head: a connection that has not sent a whole
    request line and headers within `timeout_s` of opening (or of its last response) is closed. uvicorn's own
    keep-alive timer restarts on every byte, so a client trickling a header would hold its socket for ever.
    uvicorn's httptools protocol (llhttp, a C parser): bodies such as weight uploads stream faster than through
    its pure-Python h11 one."""

    class HeaderDeadline(HttpToolsProtocol):
        _head_seen = False  # a whole request head arrived since the deadline was armed

        def connection_made(self, transport: Any) -> None:
            super().connection_made(transport)
            self._arm_head_deadline()

        def on_headers_complete(self) -> None:  # the parser's callback
            self._head_seen = True
            super().on_headers_complete()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._arm_head_deadline()

        def connection_lost(self, exc: Exception | None) -> None:
            self._head_timer.cancel()
            super().connection_lost(exc)

        def _arm_head_deadline(self) -> None:
            timer = getattr(self, "_head_timer", None)
            if timer is not None:
                timer.cancel()
            self._head_seen = False
            self._head_timer = self.loop.call_later(timeout_s, self._head_deadline)

        def _head_deadline(self) -> None:
            idle = self.cycle is None or self.cycle.response_complete
            if idle and not self._head_seen and not self.pipeline and not self.transport.is_closing():
                self.transport.close()

    return HeaderDeadline


def error_body(status: int, message: str, kind: str) -> dict[str, Any]:
    return {"error": {"message": message, "type": kind, "code": status}}


def error_response(exc: BaseException) -> JSONResponse:
    status = status_of(exc)
    headers = {"WWW-Authenticate": "Bearer"} if status.http == 401 else None
    after = retry_after(exc)
    if after is not None:
        headers = {"Retry-After": str(after)}
    return JSONResponse(error_body(status.http, str(exc), status.kind), status_code=status.http, headers=headers)


class _TooLarge(HTTPException):
    def __init__(self, limit: int) -> None:
        super().__init__(413, f"request body exceeds the limit of {limit} bytes")


class BodyLimit:
    """Refuse bodies over the limit with 413, whether or not they announce their length."""

    def __init__(self, app: ASGIApp, limit: int, upload_limit: int) -> None:
        self.app, self.limit, self.upload_limit = app, limit, upload_limit

    async def __call__(self, scope: Scope, receive: Callable[[], Awaitable[Any]],
                       send: Callable[[Any], Awaitable[None]]) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit = self.upload_limit if scope["path"] == UPLOAD_PATH else self.limit
        headers = dict(scope.get("headers") or [])
        length = headers.get(b"content-length")
        if length is not None and length.isdigit() and int(length) > limit:
            await self._refuse(send, limit)
            return
        seen = 0
        started = False

        async def counted() -> Any:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > limit:
                    raise _TooLarge(limit)
            return message

        async def tracked_send(message: Any) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, counted, tracked_send)
        except _TooLarge:
            if not started:
                await self._refuse(send, limit)

    @staticmethod
    async def _refuse(send: Callable[[Any], Awaitable[None]], limit: int) -> None:
        body = json.dumps(error_body(413, f"request body exceeds the limit of {limit} bytes",
                                     "invalid_request_error")).encode()
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})


def _validation_message(exc: RequestValidationError) -> str:
    parts = []
    for err in exc.errors():
        loc = ".".join(str(x) for x in err.get("loc", ()) if x != "body")
        parts.append(f"{loc or 'body'}: {err.get('msg', 'invalid')}")
    return "invalid request: " + "; ".join(parts[:8])


def create_app(ctx: ServiceContext) -> FastAPI:
    app = FastAPI(title="specroll", version="1", description="Rollout server for RL post-training")
    app.state.ctx = ctx

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        return JSONResponse(error_body(400, _validation_message(exc), "invalid_request_error"), status_code=400)

    @app.exception_handler(HTTPException)
    async def _http(request: Request, exc: HTTPException) -> JSONResponse:
        kind = "invalid_request_error" if exc.status_code < 500 else "internal_error"
        return JSONResponse(error_body(exc.status_code, str(exc.detail), kind), status_code=exc.status_code,
                            headers=exc.headers)

    for cls in HANDLED:
        app.add_exception_handler(cls, lambda request, exc: error_response(exc))

    @app.get("/health", tags=["ops"])
    async def health() -> JSONResponse:
        """Liveness: the process serves HTTP and the engine thread is alive (or still loading)."""
        failed = not ctx.backend.alive
        return JSONResponse({"status": "error" if failed else "ok"}, status_code=500 if failed else 200)

    @app.get("/ready", tags=["ops"])
    async def ready() -> JSONResponse:
        """Readiness: the model is loaded and the engine loop runs (also while paused for a push). `degraded`
        names what fails while the server still serves (e.g. spool_disk_full: rollouts are being lost)."""
        ok = ctx.ready
        return JSONResponse({"ready": ok, "paused": bool(ok and ctx.backend.stats().paused),
                             "degraded": ctx.degraded()},
                            status_code=200 if ok else 503)

    @app.get("/metrics", tags=["ops"], response_class=PlainTextResponse,
             responses={200: {"content": {"text/plain": {"schema": {"type": "string"}}},
                              "description": "Prometheus text exposition format"}})
    async def metrics() -> Response:
        return Response(ctx.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    app.include_router(openai_router)
    app.include_router(chat_router)
    app.include_router(sglang_router)
    app.include_router(admin_router)
    app.include_router(collective_router)
    app.include_router(transfer_router)
    app.include_router(vllm_router)
    app.openapi = lambda: _openapi(app)  # type: ignore[method-assign]
    app.add_middleware(BodyLimit, limit=ctx.limits.max_request_bytes,  # type: ignore[arg-type]
                       upload_limit=ctx.limits.max_upload_bytes)
    return app


def _openapi(app: FastAPI) -> dict[str, Any]:
    """FastAPI's schema, saying what the server really sends: invalid input is 400 (not 422), with the error
    body every error has."""
    if app.openapi_schema is None:
        schema = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
        error = {"description": "Invalid request", "content": {"application/json": {"schema": {
            "type": "object", "properties": {"error": {"type": "object", "properties": {
                "message": {"type": "string"}, "type": {"type": "string"}, "code": {"type": "integer"}}}}}}}}
        for ops in schema.get("paths", {}).values():
            for op in ops.values():
                responses = op.get("responses", {})
                if responses.pop("422", None) is not None:
                    responses["400"] = error
        app.openapi_schema = schema
    return app.openapi_schema
