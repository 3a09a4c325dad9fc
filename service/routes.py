"""The sidecar's routes, on one :data:`router` (no state: each route finds its service on the app).

``POST /v1/pack`` and ``POST /v1/whatif`` take one path (:func:`_plan_in_pool`): the
dependencies authorize, negotiate the formats and read the bounded body; the service's
method decodes, plans and encodes on a planner worker; the route answers the bytes.
Function names and docstrings are the OpenAPI operation ids, summaries and descriptions.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response

from treepack.proto import WIRE_VERSION
from treepack.proto import messages as m
from treepack.proto.codec import Format, content_type, encode_body
from treepack.proto.errors import AuthError
from treepack.service.dependencies import (
    Formats,
    accept_format,
    authorize,
    idempotency_key,
    negotiate,
    read_body,
    service,
)
from treepack.service.openapi import body_spec
from treepack.service.planning import Answer, PlanningService
from treepack.service.pool import Ticket

__all__ = ["router"]

router = APIRouter()

AUTH = [Depends(authorize)]
STATUSES = (400, 401, 408, 409, 413, 415, 422, 503, 504)


def _ready_spec() -> dict[str, Any]:
    spec = body_spec(None, m.ReadyResponse, (), both=False, description="ready")
    spec["responses"]["503"] = {
        "description": "not ready",
        "content": {"application/json": {"schema": {"$ref": "#/components/schemas/ReadyResponse"}}},
    }
    return spec


def _metrics_spec() -> dict[str, Any]:
    spec = body_spec(None, m.HealthResponse, (401,), both=False)
    spec["responses"]["200"] = {
        "description": "Prometheus text format",
        "content": {"text/plain": {"schema": {"type": "string"}}},
    }
    return spec


async def _watch_disconnect(request: Request, ticket: Ticket) -> None:
    """Cancel ``ticket`` when the client disconnects (the body is read: the next message is the end)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            ticket.cancel()
            return


async def _plan_in_pool(
    request: Request,
    svc: PlanningService,
    work: Callable[[bytearray, Format, Format, Ticket], Answer],
    formats: Formats,
    body: bytearray,
) -> Response:
    """Run ``work(body, request format, response format, ticket)`` on the planner pool; answer its bytes.

    The ticket stops the work at ``request_timeout_s`` (504) or when the client goes away.
    Only an answer that came back whole queues its history record (never a 4xx/5xx).
    """
    ticket = Ticket(svc.settings.request_timeout_s)
    watcher = asyncio.create_task(_watch_disconnect(request, ticket))
    try:
        answer = await svc.pool.run(work, body, formats.request, formats.response, ticket)
    finally:
        watcher.cancel()
    answer.answered()
    return Response(answer.body, media_type=content_type(formats.response))


@router.post(
    "/v1/pack",
    dependencies=AUTH,
    openapi_extra=body_spec(m.PackRequest, m.PackResponse, STATUSES, description="the plan"),
)
async def pack(
    request: Request,
    svc: PlanningService = Depends(service),
    formats: Formats = Depends(negotiate),
    body: bytearray = Depends(read_body),
) -> Response:
    """Pack a batch into rows: the plan with every array the trainer needs.

    An ``Idempotency-Key`` header (up to 128 printable ASCII characters) makes a retry
    safe: a second request with the same key and body gets the first answer again and is
    not recorded twice.
    """
    key = idempotency_key(request)
    if key is None:
        return await _plan_in_pool(request, svc, svc.pack, formats, body)
    return await svc.replay.run(
        key, request.state.body_digest, formats.response, lambda: _plan_in_pool(request, svc, svc.pack, formats, body)
    )


@router.post(
    "/v1/whatif",
    dependencies=AUTH,
    openapi_extra=body_spec(m.WhatIfRequest, m.WhatIfResponse, STATUSES, description="row distributions"),
)
async def whatif(
    request: Request,
    svc: PlanningService = Depends(service),
    formats: Formats = Depends(negotiate),
    body: bytearray = Depends(read_body),
) -> Response:
    """Rows needed by candidate batch compositions, sampled from recorded (or given) shapes."""
    return await _plan_in_pool(request, svc, svc.whatif, formats, body)


@router.get(
    "/v1/history",
    dependencies=AUTH,
    openapi_extra=body_spec(None, m.HistorySummary, (401, 415), description="the summary"),
)
async def history(svc: PlanningService = Depends(service), fmt: Format = Depends(accept_format)) -> Response:
    """What the shape history holds (counts, time span, tags, means)."""
    summary = await asyncio.to_thread(svc.history_summary)
    return Response(encode_body(summary, fmt), media_type=content_type(fmt))


@router.get("/healthz", openapi_extra=body_spec(None, m.HealthResponse, (), both=False, description="alive"))
async def healthz() -> JSONResponse:
    """Liveness: the process serves requests."""
    return JSONResponse({"version": WIRE_VERSION, "status": "ok"})


@router.get("/readyz", openapi_extra=_ready_spec())
async def readyz(request: Request, svc: PlanningService = Depends(service)) -> JSONResponse:
    """Readiness: the planner and the history database answer (a damaged history says why; packs are still served).

    The reasons are short and name no file; a request with the service's bearer token
    gets them in full.
    """
    detail = False
    if svc.settings.token is not None:
        try:
            await authorize(request)
            detail = True
        except AuthError:
            pass
    checks = await asyncio.to_thread(svc.ready_checks, detail=detail)
    ok = all(v == "ok" or v.startswith("ok; ") for v in checks.values())
    body: dict[str, Any] = {"version": WIRE_VERSION, "status": "ready" if ok else "not_ready", "checks": checks}
    return JSONResponse(body, status_code=200 if ok else 503)


@router.get("/metrics", dependencies=AUTH, openapi_extra=_metrics_spec())
async def metrics(svc: PlanningService = Depends(service)) -> Response:
    """Prometheus metrics (text exposition format)."""
    data, ctype = svc.metrics.render()
    return Response(data, media_type=ctype)
