"""The FastAPI app: :func:`create_app` (nothing is built at import time).

Routes are a few lines each: authorize, negotiate formats, read the body (bounded),
hand it to :class:`~.handlers.Service` on the planner pool, answer. One exception handler
maps the project's error hierarchy to HTTP (:data:`treepack.proto.errors.HTTP_STATUS`);
error bodies are always JSON (:class:`~treepack.proto.messages.ErrorBody`).
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import math
from contextlib import asynccontextmanager
from typing import Any, AsyncIterator

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from treepack.proto import WIRE_VERSION
from treepack.proto import messages as m
from treepack.proto.codec import content_type, encode_body, json_path, request_format, response_format
from treepack.proto.errors import (
    AuthError,
    DecodeError,
    OverloadedError,
    PayloadTooLargeError,
    RequestError,
    ServerError,
    TreepackError,
    http_status,
)
from treepack.service.handlers import Service
from treepack.service.metrics import MetricsMiddleware
from treepack.service.openapi import body_spec, install_openapi
from treepack.service.settings import Settings
from treepack.service.version import __version__

__all__ = ["create_app", "create_app_from_env"]

log = logging.getLogger("treepack.service")

DESCRIPTION = """Prefix-tree packing sidecar. Bodies are msgpack (default) or JSON, chosen by
Content-Type; answers follow Accept (default: the request's format). Error bodies are JSON
with the error kind, message, field path and rule."""


async def _read_body(request: Request, limit: int) -> bytes:
    """The request body, refusing more than ``limit`` bytes (413) before reading it all."""
    declared = request.headers.get("content-length")
    if declared is not None:
        try:
            n = int(declared)
        except ValueError:
            raise DecodeError(f"Content-Length {declared!r} is not an integer", path="Content-Length", rule="header") from None
        if n > limit:
            raise PayloadTooLargeError(f"body of {n} bytes, over the limit of {limit}", path="$", rule="max_body_bytes")
    chunks, total = [], 0
    async for chunk in request.stream():
        total += len(chunk)
        if total > limit:
            raise PayloadTooLargeError(f"body over the limit of {limit} bytes", path="$", rule="max_body_bytes")
        chunks.append(chunk)
    return b"".join(chunks)


def _error_response(exc: TreepackError, svc: Service) -> JSONResponse:
    headers = {}
    if isinstance(exc, OverloadedError):
        headers["Retry-After"] = str(max(1, math.ceil(exc.retry_after)))
    if isinstance(exc, AuthError):
        headers["WWW-Authenticate"] = 'Bearer realm="treepack"'
    svc.metrics.errors.labels(exc.kind).inc()
    return JSONResponse(exc.to_payload(), status_code=http_status(exc), headers=headers)


def create_app(settings: Settings | None = None) -> FastAPI:
    """Build the service.

    Args:
        settings: the configuration; default ``Settings()`` (read from ``TREEPACK_*``).

    Returns:
        The FastAPI app; ``app.state.service`` is its :class:`~.handlers.Service`.
        Lifespan shutdown flushes pending history writes; ``app.state.service.close()``
        also stops the worker threads and closes the database (for embedding the app in
        a longer-lived process, and for tests).
    """
    settings = settings or Settings()
    svc = Service(settings)
    token = None if settings.token is None else settings.token.get_secret_value().encode()

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        yield
        # Finish pending history writes; threads and the database go with the process.
        # (Not a full close: test clients run lifespan around every use of one app.)
        await asyncio.to_thread(svc.flush)

    app = FastAPI(title="treepack", version=__version__, description=DESCRIPTION, lifespan=lifespan)
    app.state.service = svc
    app.add_middleware(MetricsMiddleware, metrics=svc.metrics)
    install_openapi(app, description=DESCRIPTION, bearer=token is not None)

    async def authorize(request: Request) -> None:
        if token is None:
            return
        scheme, _, value = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not value.strip():
            raise AuthError("this service needs `Authorization: Bearer <token>`", path="Authorization", rule="bearer")
        if not hmac.compare_digest(value.strip().encode(), token):
            raise AuthError("wrong bearer token", path="Authorization", rule="token")

    @app.exception_handler(TreepackError)
    async def on_treepack_error(_: Request, exc: TreepackError) -> JSONResponse:
        return _error_response(exc, svc)

    @app.exception_handler(RequestValidationError)
    async def on_validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {"loc": (), "msg": "invalid request", "type": "invalid"}
        loc = tuple(p for p in first.get("loc", ()) if p not in ("body", "query", "path", "header"))
        return _error_response(RequestError(str(first.get("msg")), path=json_path(loc), rule=str(first.get("type"))), svc)

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "http_error")
        payload = {"version": WIRE_VERSION, "error": kind, "message": f"{exc.detail}: {request.method} {request.url.path}", "path": "$", "rule": kind}
        svc.metrics.errors.labels(kind).inc()
        return JSONResponse(payload, status_code=exc.status_code, headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def on_bug(_: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error", exc_info=exc)
        return _error_response(ServerError(f"internal error ({type(exc).__name__}); please report it", path="$", rule="bug"), svc)

    auth = [Depends(authorize)]
    statuses = (400, 401, 413, 415, 422, 503)

    @app.post("/v1/pack", dependencies=auth, openapi_extra=body_spec(m.PackRequest, m.PackResponse, statuses, description="the plan"))
    async def pack(request: Request) -> Response:
        """Pack a batch into rows: the plan with every array the trainer needs."""
        fmt_in = request_format(request.headers.get("content-type"))
        fmt_out = response_format(request.headers.get("accept"), default=fmt_in)
        body = await _read_body(request, settings.max_body_bytes)
        return Response(await svc.pool.run(svc.pack, body, fmt_in, fmt_out), media_type=content_type(fmt_out))

    @app.post("/v1/whatif", dependencies=auth, openapi_extra=body_spec(m.WhatIfRequest, m.WhatIfResponse, statuses, description="row distributions"))
    async def whatif(request: Request) -> Response:
        """Rows needed by candidate batch compositions, sampled from recorded (or given) shapes."""
        fmt_in = request_format(request.headers.get("content-type"))
        fmt_out = response_format(request.headers.get("accept"), default=fmt_in)
        body = await _read_body(request, settings.max_body_bytes)
        return Response(await svc.pool.run(svc.whatif, body, fmt_in, fmt_out), media_type=content_type(fmt_out))

    @app.get("/v1/history", dependencies=auth, openapi_extra=body_spec(None, m.HistorySummary, (401, 415), description="the summary"))
    async def history(request: Request) -> Response:
        """What the shape history holds (counts, time span, tags, means)."""
        fmt_out = response_format(request.headers.get("accept"), default="json")
        summary = await asyncio.to_thread(svc.history_summary)
        return Response(encode_body(summary, fmt_out), media_type=content_type(fmt_out))

    @app.get("/healthz", openapi_extra=body_spec(None, m.HealthResponse, (), both=False, description="alive"))
    async def healthz() -> JSONResponse:
        """Liveness: the process serves requests."""
        return JSONResponse({"version": WIRE_VERSION, "status": "ok"})

    @app.get("/readyz", openapi_extra=_ready_spec())
    async def readyz() -> JSONResponse:
        """Readiness: the planner and the history database answer."""
        checks = await asyncio.to_thread(svc.ready_checks)
        ok = all(v == "ok" for v in checks.values())
        body: dict[str, Any] = {"version": WIRE_VERSION, "status": "ready" if ok else "not_ready", "checks": checks}
        return JSONResponse(body, status_code=200 if ok else 503)

    @app.get("/metrics", dependencies=auth, openapi_extra=_metrics_spec())
    async def metrics() -> Response:
        """Prometheus metrics (text exposition format)."""
        data, ctype = svc.metrics.render()
        return Response(data, media_type=ctype)

    return app


def _ready_spec() -> dict[str, Any]:
    spec = body_spec(None, m.ReadyResponse, (), both=False, description="ready")
    spec["responses"]["503"] = {"description": "not ready", "content": {"application/json": {"schema": {"$ref": "#/components/schemas/ReadyResponse"}}}}
    return spec


def _metrics_spec() -> dict[str, Any]:
    spec = body_spec(None, m.HealthResponse, (401,), both=False)
    spec["responses"]["200"] = {"description": "Prometheus text format", "content": {"text/plain": {"schema": {"type": "string"}}}}
    return spec


def create_app_from_env() -> FastAPI:
    """``create_app(Settings())``: the factory uvicorn workers call (``treepack serve``).

    Also sets this worker process's allocator to keep ``malloc_keep_mb`` of freed memory
    (:mod:`treepack.service.malloc`).
    """
    from treepack.service.malloc import keep_freed_memory

    settings = Settings()
    keep_freed_memory(settings.malloc_keep_mb << 20)
    return create_app(settings)
