"""The HTTP client's transport policy: how often to retry, how long to wait, the deadlines of a call.

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

:class:`RetryPolicy` is the caller's choice; :class:`Call` applies it to one call of
either backend (:mod:`~treepack.client.http`), which only runs the I/O loop.
"""

from __future__ import annotations

import json
import math
import random
import time
from dataclasses import dataclass

import httpx

from treepack.client.http_errors import raise_for_response, retry_after, transport_error
from treepack.proto.errors import TransportError

__all__ = ["RetryPolicy", "Call"]

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


def retryable_503(resp: httpx.Response) -> bool:
    """A 503 worth retrying: overload (or uvicorn's connection limit), not a damaged history."""
    if resp.status_code != 503:
        return False
    try:
        return json.loads(resp.content).get("error") != "unavailable"
    except (ValueError, AttributeError):
        return True


class Call:
    """The deadlines and retry decisions of one client call (module docstring).

    Args:
        policy: retries, backoff and the total deadline.
        timeout: seconds per attempt as a whole.
        url: the request's URL, for errors.
        safe: a connection cut off after sending may be retried (module docstring).
    """

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
        wait = self.policy.delay(self.attempt, None if resp is None else retry_after(resp))
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
        wait = self.wait_for_retry(None, resp) if retryable_503(resp) else None
        if wait is None:
            raise_for_response(resp)
        return wait
