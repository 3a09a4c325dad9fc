"""What every route needs before it runs: the service, bearer auth, formats, the body.

FastAPI dependencies (all ``async``: none of them blocks, so none takes a trip through
the thread pool), evaluated in the order a route declares them: a route's
``dependencies=[Depends(authorize)]`` first, then its parameters. The pack and what-if
routes declare ``negotiate`` before ``read_body``, so a request is refused for its token
(401), then for its formats (415), then for its encoding (415), its size (413) and the
intake budget (503, charged as the bytes arrive), before any byte is decoded. Every
refusal is raised as the project's exception; the app's one exception handler turns it
into the JSON error body.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import time
from collections.abc import AsyncIterator
from typing import NamedTuple

from fastapi import Request

from treepack.proto.codec import Format, request_format, response_format
from treepack.proto.errors import (
    AuthError,
    BodyTimeoutError,
    DecodeError,
    PayloadTooLargeError,
    RequestError,
    UnsupportedMediaTypeError,
)
from treepack.service.planning import PlanningService

__all__ = ["Formats", "service", "authorize", "negotiate", "accept_format", "read_body", "idempotency_key"]


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


def idempotency_key(request: Request) -> str | None:
    """The ``Idempotency-Key`` header (1..128 printable ASCII characters), or None.

    Raises:
        RequestError: a key that is empty, longer or not printable ASCII.
    """
    key = request.headers.get("idempotency-key")
    if key is None:
        return None
    key = key.strip()
    if not 1 <= len(key) <= 128 or not key.isascii() or not key.isprintable():
        raise RequestError(
            "Idempotency-Key must be 1 to 128 printable ASCII characters", path="Idempotency-Key", rule="header"
        )
    return key


def _announced(request: Request, limit: int) -> int | None:
    """The body's Content-Length (None: chunked), refused over ``limit`` or when it has an encoding."""
    encoding = request.headers.get("content-encoding", "identity").strip().lower()
    if encoding not in ("", "identity"):
        raise UnsupportedMediaTypeError(
            f"Content-Encoding {encoding[:64]!r} is not supported; send the body uncompressed",
            path="Content-Encoding",
            rule="content_encoding",
        )
    declared = request.headers.get("content-length")
    if declared is None:
        return None
    if not declared.isascii() or not declared.isdigit():
        raise DecodeError(f"Content-Length {declared[:64]!r} is not an integer", path="Content-Length", rule="header")
    n = int(declared)
    if n > limit:
        raise PayloadTooLargeError(f"body of {n} bytes, over the limit of {limit}", path="$", rule="max_body_bytes")
    return n


async def _next_chunk(
    chunks: AsyncIterator[bytes], deadline: float, timeout_s: float, *, first: bool = False
) -> bytes | None:
    """The next non-empty chunk, None at the end; :class:`BodyTimeoutError` past ``deadline``."""
    while True:
        try:
            chunk = await asyncio.wait_for(anext(chunks), max(deadline - time.monotonic(), 0.0))
        except StopAsyncIteration:
            return None
        except (asyncio.TimeoutError, TimeoutError):
            if first:
                raise BodyTimeoutError(
                    f"no byte of the body arrived within {timeout_s:g} s (body_first_byte_s)",
                    path="$",
                    rule="body_first_byte",
                ) from None
            raise BodyTimeoutError(
                f"the body did not arrive within {timeout_s:g} s", path="$", rule="body_timeout"
            ) from None
        if chunk:
            return chunk


async def read_body(request: Request) -> AsyncIterator[bytes | bytearray]:
    """The request body, admitted and bounded as it is read (a dependency with cleanup).

    Order: the encoding (415 unless identity), the announced size (413 over
    ``max_body_bytes``), then the bytes: the first within ``body_first_byte_s``, all
    within ``body_timeout_s`` (408), each chunk charged to the intake budget as it
    arrives (503 + Retry-After when it would pass ``intake_budget_bytes``; small bodies
    also have ``intake_reserve_bytes``). Announced bytes that never arrive cost nothing.
    The charge is held until the answer is sent, so bodies waiting for a planner count
    too. With an ``Idempotency-Key``, a SHA-256 of every byte is taken as the chunks
    arrive (``request.state.body_digest``): a replay is only ever of the same bytes.

    Yields:
        The body: one buffer (the single chunk it came in, or a ``bytearray`` the chunks
        were appended to).

    Raises:
        UnsupportedMediaTypeError, DecodeError, PayloadTooLargeError, OverloadedError,
        BodyTimeoutError: as above.
    """
    svc = _service(request)
    settings, intake = svc.settings, svc.intake
    limit, timeout_s = settings.max_body_bytes, settings.body_timeout_s
    n = _announced(request, limit)
    small = n is not None and n <= settings.small_body_bytes
    digest = hashlib.sha256() if "idempotency-key" in request.headers else None
    start = time.monotonic()
    deadline = start + timeout_s
    first_by = min(deadline, start + settings.body_first_byte_s)
    reserved = 0
    try:
        chunks = aiter(request.stream())
        body: bytes | bytearray = b""
        got = 0
        while True:
            if got == 0:
                chunk = await _next_chunk(chunks, first_by, settings.body_first_byte_s, first=True)
            else:
                chunk = await _next_chunk(chunks, deadline, timeout_s)
            if chunk is None:
                break
            if got + len(chunk) > (limit if n is None else n):
                if n is None:
                    raise PayloadTooLargeError(f"body over the limit of {limit} bytes", path="$", rule="max_body_bytes")
                raise DecodeError(
                    f"the body is longer than its Content-Length of {n}", path="Content-Length", rule="header"
                )
            intake.acquire(len(chunk), held=reserved, small=small)
            reserved += len(chunk)
            if digest is not None:
                digest.update(chunk)
            if got == 0:
                body = chunk  # the whole body, when it came in one chunk: no copy
            else:
                if not isinstance(body, bytearray):
                    body = bytearray(body)
                body += chunk
            got += len(chunk)
        if n is not None and got != n:
            raise DecodeError(f"the body ended after {got} of its {n} bytes", path="Content-Length", rule="header")
        if digest is not None:
            request.state.body_digest = digest.digest()
        yield body
    finally:
        intake.release(reserved)
