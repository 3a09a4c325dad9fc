"""Where an HTTP answer or a transport failure becomes the project's exception (httpx's habit: one place).

:func:`raise_for_response` turns a 4xx/5xx answer into the server's error kind, with its
message, path and rule (:func:`~treepack.proto.errors.error_from_payload`), and an
overloaded server's ``Retry-After`` (:func:`parse_retry_after`); :func:`transport_error`
does the same for httpx's transport failures. Both HTTP backends and their retry
decisions (:mod:`~treepack.client.retry`) raise through here.
"""

from __future__ import annotations

import email.utils
import json
import math
import time
from datetime import timezone
from typing import Any

import httpx
import msgpack

from treepack.proto.errors import OverloadedError, TransportError, error_from_payload

__all__ = ["raise_for_response", "transport_error", "parse_retry_after", "retry_after"]


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


def retry_after(resp: httpx.Response) -> float | None:
    """The answer's ``Retry-After`` as seconds (:func:`parse_retry_after`), or None."""
    return parse_retry_after(resp.headers.get("retry-after"))


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
        ra = retry_after(resp)
        if ra is not None:
            err.retry_after = ra
    raise err


def transport_error(exc: httpx.HTTPError, url: str) -> TransportError:
    """A :class:`TransportError` for an httpx failure, naming the URL and the cause."""
    kind = "timed out" if isinstance(exc, httpx.TimeoutException) else "failed"
    return TransportError(f"request to {url} {kind}: {type(exc).__name__}: {exc}", path="$", rule=type(exc).__name__)
