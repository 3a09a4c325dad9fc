"""The FastAPI app: :func:`create_app` (nothing is built at import time).

Wiring only: the :class:`~.planning.PlanningService`, the metrics middleware, the OpenAPI
document, the exception handlers and the routes (:mod:`.routes`, whose dependencies live
in :mod:`.dependencies`). One exception handler maps the project's error hierarchy to
HTTP (:data:`treepack.proto.errors.HTTP_STATUS`); error bodies are always JSON
(:class:`~treepack.proto.messages.ErrorBody`), routing errors (404, 405) and bugs (500)
included.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from importlib.metadata import version

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from treepack.proto import WIRE_VERSION
from treepack.proto.codec import json_path
from treepack.proto.errors import (
    AuthError,
    DeadlineError,
    OverloadedError,
    RequestError,
    ServerError,
    TreepackError,
    http_status,
)
from treepack.service.metrics import MetricsMiddleware
from treepack.service.openapi import OFFLINE_DOCS, install_openapi
from treepack.service.planning import PlanningService
from treepack.service.routes import router
from treepack.service.settings import Settings

__all__ = ["create_app", "create_app_from_env"]

log = logging.getLogger("treepack.service")

DESCRIPTION = """Prefix-tree packing sidecar. Bodies are msgpack (default) or JSON, chosen by
Content-Type; answers follow Accept (default: the request's format). Error bodies are JSON
with the error kind, message, field path and rule."""


def _error_response(request: Request, exc: TreepackError) -> JSONResponse:
    headers = {}
    if isinstance(exc, OverloadedError):
        headers["Retry-After"] = str(max(1, math.ceil(exc.retry_after)))
    if isinstance(exc, AuthError):
        headers["WWW-Authenticate"] = 'Bearer realm="treepack"'
    if isinstance(exc, DeadlineError):
        request.app.state.service.metrics.work_stopped.labels(exc.rule).inc()
    request.app.state.service.metrics.errors.labels(exc.kind).inc()
    return JSONResponse(exc.to_payload(), status_code=http_status(exc), headers=headers)


async def on_treepack_error(request: Request, exc: TreepackError) -> JSONResponse:
    """The project's errors: the status of :func:`~treepack.proto.errors.http_status`, the error as the body."""
    return _error_response(request, exc)


async def on_validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
    """FastAPI's own validation (no route declares a validated parameter today): as a :class:`RequestError`."""
    first = exc.errors()[0] if exc.errors() else {"loc": (), "msg": "invalid request", "type": "invalid"}
    loc = tuple(p for p in first.get("loc", ()) if p not in ("body", "query", "path", "header"))
    return _error_response(
        request, RequestError(str(first.get("msg")), path=json_path(loc), rule=str(first.get("type")))
    )


async def on_http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    """Routing errors (404 unknown route, 405 wrong method) in the same body shape."""
    kind = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "http_error")
    payload = {
        "version": WIRE_VERSION,
        "error": kind,
        "message": f"{exc.detail}: {request.method} {request.url.path}",
        "path": "$",
        "rule": kind,
    }
    request.app.state.service.metrics.errors.labels(kind).inc()
    return JSONResponse(payload, status_code=exc.status_code, headers=getattr(exc, "headers", None))


async def on_bug(request: Request, exc: Exception) -> JSONResponse:
    """Anything else is a bug: logged with its traceback, answered as a 500 :class:`ServerError`."""
    log.exception("unhandled error", exc_info=exc)
    return _error_response(
        request, ServerError(f"internal error ({type(exc).__name__}); please report it", path="$", rule="bug")
    )


@asynccontextmanager
async def lifespan(app: FastAPI) -> AsyncIterator[None]:
    """On shutdown, finish pending history writes and checkpoint the WAL into the database file.

    (Not a full close: test clients run the lifespan around every use of one app; the
    connection stays usable, the file alone is complete.)
    """
    yield
    await asyncio.to_thread(app.state.service.flush)


async def _offline_docs() -> HTMLResponse:
    """``/docs`` without a network (settings ``docs="offline"``, the default)."""
    return HTMLResponse(OFFLINE_DOCS)


def create_app(settings: Settings | None = None) -> FastAPI:
    """Build the service.

    Args:
        settings: the configuration; default ``Settings()`` (read from ``TREEPACK_*``).

    Returns:
        The FastAPI app; ``app.state.service`` is its :class:`~.planning.PlanningService`.
        Lifespan shutdown flushes pending history writes; ``app.state.service.close()``
        also stops the worker threads and closes the database (for embedding the app in
        a longer-lived process, and for tests).
    """
    settings = settings or Settings()
    svc = PlanningService(settings)
    swagger = settings.docs == "swagger"
    app = FastAPI(
        title="treepack",
        version=version("treepack"),
        description=DESCRIPTION,
        lifespan=lifespan,
        docs_url="/docs" if swagger else None,
        redoc_url=None,
    )
    if settings.docs == "offline":
        app.add_api_route("/docs", _offline_docs, methods=["GET"], include_in_schema=False)
    app.state.service = svc
    app.add_middleware(MetricsMiddleware, metrics=svc.metrics)
    install_openapi(app, description=DESCRIPTION, bearer=settings.token is not None, settings=settings)
    # Starlette types every handler as taking Exception; each of these takes the class it is registered for.
    app.add_exception_handler(TreepackError, on_treepack_error)  # type: ignore[arg-type]
    app.add_exception_handler(RequestValidationError, on_validation_error)  # type: ignore[arg-type]
    app.add_exception_handler(StarletteHTTPException, on_http_error)  # type: ignore[arg-type]
    app.add_exception_handler(Exception, on_bug)
    app.include_router(router)
    return app


def create_app_from_env() -> FastAPI:
    """``create_app(Settings())``: the factory uvicorn workers call (``treepack serve``).

    Also sets this worker process's allocator to keep ``malloc_keep_mb`` of freed memory
    (:mod:`treepack.service.malloc`).
    """
    from treepack.service.malloc import keep_freed_memory

    settings = Settings()
    keep_freed_memory(settings.malloc_keep_mb << 20)
    return create_app(settings)
