"""What every route needs before it runs: the service, bearer auth, formats, the body.

FastAPI dependencies (all ``async``: none of them blocks, so none takes a trip through
the thread pool), evaluated in the order a route declares them: a route's
``dependencies=[Depends(authorize)]`` first, then its parameters. The pack and what-if
routes declare ``negotiate`` before ``read_body``, so a request is refused for its token
(401), then for its formats (415), then for its size (413), before any byte of a large
body is read or decoded. Every refusal is raised as the project's exception; the app's
one exception handler turns it into the JSON error body.
"""

from __future__ import annotations

import hmac
from typing import NamedTuple

from fastapi import Request

from treepack.proto.codec import Format, request_format, response_format
from treepack.proto.errors import AuthError, DecodeError, PayloadTooLargeError
from treepack.service.planning import PlanningService

__all__ = ["Formats", "service", "authorize", "negotiate", "accept_format", "read_body"]


class Formats(NamedTuple):
    """The formats of one exchange: ``request`` (Content-Type) and ``response`` (Accept)."""

    request: Format
    response: Format


def _service(request: Request) -> PlanningService:
    return request.app.state.service


async def service(request: Request) -> PlanningService:
    """The :class:`~.planning.PlanningService` of the app serving ``request``."""
    return _service(request)


async def authorize(request: Request) -> None:
    """Check ``Authorization: Bearer <token>`` when the service has a token.

    Raises:
        AuthError: no bearer credentials (rule ``bearer``) or the wrong token (rule
            ``token``); the token is compared in constant time.
    """
    secret = _service(request).settings.token
    if secret is None:
        return
    scheme, _, value = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not value.strip():
        raise AuthError("this service needs `Authorization: Bearer <token>`", path="Authorization", rule="bearer")
    if not hmac.compare_digest(value.strip().encode(), secret.get_secret_value().encode()):
        raise AuthError("wrong bearer token", path="Authorization", rule="token")


async def negotiate(request: Request) -> Formats:
    """The body's format (Content-Type, default msgpack) and the answer's (Accept, default the body's).

    Raises:
        UnsupportedMediaTypeError: a header names a format other than msgpack/JSON.
    """
    fmt_in = request_format(request.headers.get("content-type"))
    return Formats(fmt_in, response_format(request.headers.get("accept"), default=fmt_in))


async def accept_format(request: Request) -> Format:
    """The answer's format for a body-less request (Accept, default JSON)."""
    return response_format(request.headers.get("accept"), default="json")


async def read_body(request: Request) -> bytes:
    """The request body, refusing more than ``max_body_bytes`` (413) before reading it all.

    A declared Content-Length over the limit is refused before the first chunk; a body
    without one (chunked) is refused as soon as the chunks read so far pass the limit.

    Raises:
        DecodeError: Content-Length is not an integer.
        PayloadTooLargeError: the body is over the limit.
    """
    limit = _service(request).settings.max_body_bytes
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
