"""The HTTP backends (sync and async) of the client: msgpack over httpx, retries, error mapping.

Both backends share everything but the I/O loop: request bodies are built and answers
decoded by the functions below, and :func:`raise_for_response` is the one place where
an HTTP answer becomes the project's exception (the server's kind, message, path and
rule), while :func:`transport_error` does the same for httpx's transport failures.

Retries, up to ``retries`` times:

- a connection that cannot be made (the request surely did not reach the server);
- a connection dropped before the whole answer arrived, only when repeating the request
  is safe: a GET, a what-if (it records nothing), or a pack that carries an
  ``Idempotency-Key`` (the default: the server answers a repeated key from its cache, so
  the batch is planned and recorded once);
- a 503 of an overloaded server (not one that says the history is damaged).

A 503's ``Retry-After`` (seconds or an HTTP date) is honoured when it is a finite,
non-negative number; otherwise (``nan``, ``-1``, garbage) the wait is ``backoff *
2**attempt`` with +-25% jitter; every wait is capped at ``max_backoff``. Timeouts are not
retried (the server may still be planning).

Deadlines: ``timeout`` bounds each attempt as a whole (connect, send, wait, receive: a
server trickling its answer cannot stretch it; the async backend cuts at exactly
``timeout``, the sync one checks between received chunks, so at most twice it), and
``total_timeout`` bounds the call, attempts and waits together.
"""

from __future__ import annotations

import asyncio
import email.utils
import json
import math
import random
import time
import uuid
from dataclasses import dataclass
from datetime import timezone
from typing import Any

import httpx
import msgpack

from treepack.proto.batch import PackInput
from treepack.proto.batch_columns import BodyChunks
from treepack.proto.batch_wire import encode_pack_body, encode_pack_chunks
from treepack.proto.codec import Format, content_type, decode_body, encode_body, parse_message
from treepack.proto.errors import (
    OverloadedError,
    RequestError,
    ServerError,
    TransportError,
    TreepackError,
    error_from_payload,
)
from treepack.proto.pack_messages import PackResponse
from treepack.proto.plan import Plan
from treepack.proto.plan_wire import plan_from_wire
from treepack.proto.service_messages import HistorySummary
from treepack.proto.whatif import WhatIfQuery, WhatIfResult
from treepack.proto.whatif_messages import WhatIfResponse
from treepack.proto.whatif_wire import whatif_request, whatif_result_from_wire

__all__ = [
    "RetryPolicy",
    "HttpBackend",
    "AsyncHttpBackend",
    "raise_for_response",
    "transport_error",
    "parse_retry_after",
]

# Failures before the request left: always safe to retry.
_NOT_SENT = (httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout)
# The connection broke after the request may have arrived: retried only when safe.
_CUT_OFF = (httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError)


@dataclass(frozen=True, slots=True, kw_only=True)
class RetryPolicy:
    """How often and how long to wait (module docstring).

    Attributes:
        retries: retries after the first attempt.
        backoff: first wait in seconds without a usable Retry-After (doubles each retry).
        max_backoff: cap on any single wait, Retry-After included.
        total_timeout: seconds for the whole call, attempts and waits (None: no bound).
    """

    retries: int = 4
    backoff: float = 0.2
    max_backoff: float = 30.0
    total_timeout: float | None = None

    def delay(self, attempt: int, retry_after: float | None) -> float:
        """Seconds to wait before retry ``attempt`` (0-based)."""
        if retry_after is not None and math.isfinite(retry_after) and retry_after >= 0:
            return min(retry_after, self.max_backoff)
        return min(self.backoff * 2**attempt * random.uniform(0.75, 1.25), self.max_backoff)


def parse_retry_after(value: str | None) -> float | None:
    """``Retry-After`` as seconds from now: delta-seconds or an HTTP date; None when unusable.

    Non-finite, negative or unparsable values give None (the caller falls back to its
    backoff); huge ones are returned as they are (the policy caps every wait).
    """
    if value is None:
        return None
    text = value.strip()
    try:
        secs = float(text)
    except ValueError:
        try:
            when = email.utils.parsedate_to_datetime(text)
        except (TypeError, ValueError, IndexError):
            return None
        if when.tzinfo is None:
            when = when.replace(tzinfo=timezone.utc)
        secs = when.timestamp() - time.time()
    return secs if math.isfinite(secs) and secs >= 0 else None


def _retry_after(resp: httpx.Response) -> float | None:
    return parse_retry_after(resp.headers.get("retry-after"))


def _retryable_503(resp: httpx.Response) -> bool:
    """A 503 worth retrying: overload (or uvicorn's connection limit), not a damaged history."""
    if resp.status_code != 503:
        return False
    try:
        return json.loads(resp.content).get("error") != "unavailable"
    except (ValueError, AttributeError):
        return True


class _Call:
    """The deadlines and retry decisions of one client call (module docstring)."""

    def __init__(self, policy: RetryPolicy, timeout: float, url: str, safe: bool) -> None:
        self.policy, self.timeout, self.url, self.safe = policy, timeout, url, safe
        self.start = time.monotonic()
        self.attempt = 0

    def attempt_timeout(self) -> float:
        """Seconds the next attempt may take (the per-attempt bound, within the total)."""
        if self.policy.total_timeout is None:
            return self.timeout
        left = self.start + self.policy.total_timeout - time.monotonic()
        if left <= 0:
            raise TransportError(
                f"request to {self.url} timed out: the total deadline of {self.policy.total_timeout:g} s passed",
                path="$",
                rule="total_timeout",
            )
        return min(self.timeout, left)

    def wait_for_retry(self, exc: BaseException | None, resp: httpx.Response | None) -> float | None:
        """Seconds to wait before retrying, or None to give up (then the caller raises)."""
        if self.attempt >= self.policy.retries:
            return None
        if exc is not None and not (isinstance(exc, _NOT_SENT) or (isinstance(exc, _CUT_OFF) and self.safe)):
            return None
        wait = self.policy.delay(self.attempt, None if resp is None else _retry_after(resp))
        if self.policy.total_timeout is not None and time.monotonic() + wait >= self.start + self.policy.total_timeout:
            return None
        self.attempt += 1
        return wait

    def retry_after_failure(self, exc: httpx.HTTPError) -> float:
        """Seconds to wait before retrying an attempt that failed with ``exc``.

        Raises:
            TransportError: the failure is not retried (module docstring).
        """
        wait = self.wait_for_retry(exc, None)
        if wait is None:
            raise transport_error(exc, self.url) from None
        return wait

    def retry_after_answer(self, resp: httpx.Response) -> float | None:
        """Seconds to wait before retrying a retryable 503, or None when ``resp`` is the answer.

        Raises:
            TreepackError: (a subclass) for a 4xx/5xx answer that is not retried.
        """
        wait = self.wait_for_retry(None, resp) if _retryable_503(resp) else None
        if wait is None:
            raise_for_response(resp)
        return wait


def raise_for_response(resp: httpx.Response) -> None:
    """Raise the project's exception for a 4xx/5xx answer (no-op otherwise)."""
    status = resp.status_code
    if status < 400:
        return
    payload: Any = None
    try:
        if "msgpack" in resp.headers.get("content-type", ""):
            payload = msgpack.unpackb(resp.content, raw=False)
        else:
            payload = json.loads(resp.content)
    except (ValueError, msgpack.UnpackException):
        payload = None
    if not isinstance(payload, dict) or "error" not in payload:
        text = resp.content[:200].decode("utf-8", "replace")
        payload = {"message": f"HTTP {status} from {resp.request.url}: {text}", "path": "$"}
    err = error_from_payload(payload, status)
    if isinstance(err, OverloadedError):
        ra = _retry_after(resp)
        if ra is not None:
            err.retry_after = ra
    raise err


def transport_error(exc: httpx.HTTPError, url: str) -> TransportError:
    """A :class:`TransportError` for an httpx failure, naming the URL and the cause."""
    kind = "timed out" if isinstance(exc, httpx.TimeoutException) else "failed"
    return TransportError(f"request to {url} {kind}: {type(exc).__name__}: {exc}", path="$", rule=type(exc).__name__)


def _decode(resp: httpx.Response, model: type) -> Any:
    fmt: Format = "msgpack" if "msgpack" in resp.headers.get("content-type", "") else "json"
    try:
        return parse_message(model, decode_body(resp.content, fmt, unique_keys=False))
    except TreepackError as exc:
        raise ServerError(
            f"the server sent an invalid {model.__name__}: {exc}", path=exc.path, rule="bad_response"
        ) from None


# Bodies larger than this go out as BodyChunks: below it, one join into a fresh buffer
# costs less than httpx's per-chunk path (measured: 1.7 MB bodies 0.2-1 ms slower
# chunked; 18 MB bodies 3-15% faster chunked, the page faults of one 18 MB buffer saved).
CHUNKED_MIN_BYTES = 8 << 20


def pack_body(request: PackInput, fmt: Format, *, chunked: bool = False, dedup: bool = True) -> bytes | BodyChunks:
    """The ``/v1/pack`` body; with ``chunked``, a msgpack body over
    :data:`CHUNKED_MIN_BYTES` comes as :class:`BodyChunks`, written while it is sent (the
    sync client's way; httpx's async client takes bytes or an async stream)."""
    if chunked and fmt == "msgpack":
        body = encode_pack_chunks(request, dedup=dedup)
        return body if body.nbytes > CHUNKED_MIN_BYTES else b"".join(body.parts)
    return encode_pack_body(request, fmt=fmt, dedup=dedup)


def decode_pack(resp: httpx.Response) -> Plan:
    msg = _decode(resp, PackResponse)
    try:
        return plan_from_wire(msg.plan)
    except TreepackError as exc:
        raise ServerError(f"the server sent an invalid plan: {exc}", path=exc.path, rule="bad_response") from None


def whatif_body(query: WhatIfQuery, fmt: Format) -> bytes:
    return encode_body(whatif_request(query, fmt), fmt)


def decode_whatif(resp: httpx.Response) -> list[WhatIfResult]:
    return [whatif_result_from_wire(r) for r in _decode(resp, WhatIfResponse).results]


def _headers(token: str | None, fmt: Format) -> dict[str, str]:
    """Default headers; the token stripped and checked (HTTP headers carry printable ASCII only).

    Raises:
        RequestError: an empty or non-ASCII token (rule ``token``).
    """
    h = {"accept": content_type(fmt), "user-agent": "treepack-client/1"}
    if token is not None:
        token = token.strip()
        if not token or not token.isascii() or not token.isprintable():
            raise RequestError("the bearer token must be non-empty printable ASCII", path="token", rule="token")
        h["authorization"] = f"Bearer {token}"
    return h


def _request_headers(fmt: Format, body: Any, accept: str | None, key: str | None) -> dict[str, str]:
    headers = {"content-type": content_type(fmt)} if body is not None else {}
    if isinstance(body, BodyChunks):
        headers["content-length"] = str(body.nbytes)  # else httpx would send it chunked
    if accept:
        headers["accept"] = accept
    if key:
        headers["idempotency-key"] = key
    return headers


def _read_within(
    client: httpx.Client, method: str, path: str, body: Any, headers: dict[str, str], limit: float
) -> httpx.Response:
    """One sync attempt, its answer read whole, ended past ``limit`` seconds (checked between chunks)."""
    end = time.monotonic() + limit
    with client.stream(method, path, content=body, headers=headers, timeout=limit) as resp:
        parts = []
        for chunk in resp.iter_bytes():
            parts.append(chunk)
            if time.monotonic() > end:
                raise httpx.ReadTimeout(f"the answer did not arrive within {limit:g} s", request=resp.request)
    kept = [
        (k, v)
        for k, v in resp.headers.multi_items()
        if k.lower() not in ("content-encoding", "content-length", "transfer-encoding")
    ]
    return httpx.Response(resp.status_code, headers=kept, content=b"".join(parts), request=resp.request)


class _HttpBase:
    """What the two HTTP backends share: configuration and the httpx client's settings.

    Args:
        url: the sidecar's base URL.
        token: bearer token, or None.
        timeout: seconds per attempt as a whole (module docstring).
        policy: retries and the total deadline.
        fmt: the body format sent and asked for.
        transport: an httpx transport (tests: ``httpx.ASGITransport``), or None.
        dedup: send shared prefixes as references (:func:`~treepack.proto.batch_wire.encode_pack_request`).
        idempotent: send each pack with a fresh ``Idempotency-Key`` (so it may be retried).
    """

    _client_type: Any = httpx.Client

    def __init__(
        self,
        url: str,
        *,
        token: str | None,
        timeout: float,
        policy: RetryPolicy,
        fmt: Format,
        transport: Any = None,
        dedup: bool = True,
        idempotent: bool = True,
    ) -> None:
        self.url = url.rstrip("/")
        self.fmt = fmt
        self.policy = policy
        self.timeout = timeout
        self.dedup = dedup
        self.idempotent = idempotent
        self._client = self._client_type(
            base_url=self.url, timeout=timeout, headers=_headers(token, fmt), transport=transport
        )

    def _call(self, method: str, path: str, safe: bool | None) -> _Call:
        """The deadlines and retries of one call; ``safe`` defaults to GET-only."""
        return _Call(self.policy, self.timeout, self.url + path, method == "GET" if safe is None else safe)

    def _idempotency_key(self) -> str | None:
        return uuid.uuid4().hex if self.idempotent else None


class HttpBackend(_HttpBase):
    """Synchronous HTTP backend (a :class:`~treepack.client.protocols.Backend`)."""

    def request(
        self,
        method: str,
        path: str,
        body: bytes | BodyChunks | None = None,
        *,
        accept: str | None = None,
        safe: bool | None = None,
        key: str | None = None,
    ) -> httpx.Response:
        """One call with retries and deadlines (module docstring); ``safe`` defaults to GET-only."""
        headers = _request_headers(self.fmt, body, accept, key)
        call = self._call(method, path, safe)
        while True:
            try:
                resp = _read_within(self._client, method, path, body, headers, call.attempt_timeout())
            except httpx.HTTPError as exc:
                wait = call.retry_after_failure(exc)
            else:
                wait = call.retry_after_answer(resp)
                if wait is None:
                    return resp
            time.sleep(wait)

    def pack(self, request: PackInput) -> Plan:
        body = pack_body(request, self.fmt, chunked=True, dedup=self.dedup)
        key = self._idempotency_key()
        return decode_pack(self.request("POST", "/v1/pack", body, safe=key is not None, key=key))

    def whatif(self, query: WhatIfQuery) -> list[WhatIfResult]:
        return decode_whatif(self.request("POST", "/v1/whatif", whatif_body(query, self.fmt), safe=True))

    def history(self) -> dict[str, Any]:
        return _decode(self.request("GET", "/v1/history", accept="application/json"), HistorySummary).model_dump()

    def health(self) -> dict[str, Any]:
        return {**self.request("GET", "/healthz", accept="application/json").json(), "backend": "http"}

    def close(self) -> None:
        self._client.close()


class AsyncHttpBackend(_HttpBase):
    """Asynchronous HTTP backend (a :class:`~treepack.client.protocols.AsyncBackend`)."""

    _client_type = httpx.AsyncClient

    async def request(
        self,
        method: str,
        path: str,
        body: bytes | None = None,
        *,
        accept: str | None = None,
        safe: bool | None = None,
        key: str | None = None,
    ) -> httpx.Response:
        """One call with retries and deadlines (module docstring); ``safe`` defaults to GET-only."""
        headers = _request_headers(self.fmt, body, accept, key)
        call = self._call(method, path, safe)
        while True:
            limit = call.attempt_timeout()
            try:
                resp = await asyncio.wait_for(self._client.request(method, path, content=body, headers=headers), limit)
            except (asyncio.TimeoutError, TimeoutError):
                raise TransportError(
                    f"request to {self.url + path} timed out: no whole answer within {limit:g} s",
                    path="$",
                    rule="ReadTimeout",
                ) from None
            except httpx.HTTPError as exc:
                wait = call.retry_after_failure(exc)
            else:
                wait = call.retry_after_answer(resp)
                if wait is None:
                    return resp
            await asyncio.sleep(wait)

    async def pack(self, request: PackInput) -> Plan:
        body = await asyncio.to_thread(pack_body, request, self.fmt, dedup=self.dedup)
        key = self._idempotency_key()
        resp = await self.request("POST", "/v1/pack", body, safe=key is not None, key=key)
        return await asyncio.to_thread(decode_pack, resp)

    async def whatif(self, query: WhatIfQuery) -> list[WhatIfResult]:
        return decode_whatif(await self.request("POST", "/v1/whatif", whatif_body(query, self.fmt), safe=True))

    async def history(self) -> dict[str, Any]:
        return _decode(await self.request("GET", "/v1/history", accept="application/json"), HistorySummary).model_dump()

    async def health(self) -> dict[str, Any]:
        return {**(await self.request("GET", "/healthz", accept="application/json")).json(), "backend": "http"}

    async def close(self) -> None:
        await self._client.aclose()
