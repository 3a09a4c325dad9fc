"""Idempotent packs: an ``Idempotency-Key`` makes a retried ``POST /v1/pack`` safe.

A client that lost the answer to a pack (the connection dropped mid-response) cannot know
whether the server planned and recorded the batch. With a key, it may send the request
again: while the first is still running the retry waits for it, and once it has answered
the retry gets the same bytes; either way the batch is planned and recorded once. The
same key with a different body (any byte of it: the whole body is hashed as it is read) or
another response format is a 409.

Answers are kept for ``ttl_s`` seconds and within ``max_bytes`` in all (oldest go first);
a failed first attempt is not kept, so its retry plans afresh.
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from fastapi.responses import Response

from treepack.proto.errors import ConflictError

__all__ = ["ReplayCache", "request_digest"]


@dataclass(slots=True)
class _Entry:
    digest: bytes
    created: float
    future: asyncio.Future[Response]
    nbytes: int = field(default=0)


def request_digest(body_digest: bytes, fmt: str) -> bytes:
    """What a replay must match: the SHA-256 of every byte of the body (taken while it was
    read) and the response format."""
    return hashlib.sha256(fmt.encode() + b":" + body_digest).digest()


class ReplayCache:
    """Answers by idempotency key (module docstring).

    Args:
        max_bytes: bytes of kept answers in all.
        ttl_s: how long an answer is kept.
    """

    def __init__(self, *, max_bytes: int = 64 << 20, ttl_s: float = 600.0) -> None:
        self.max_bytes = max_bytes
        self.ttl_s = ttl_s
        self.replayed = 0
        self._entries: OrderedDict[str, _Entry] = OrderedDict()
        self._bytes = 0

    def _evict(self, now: float) -> None:
        while self._entries:
            key, e = next(iter(self._entries.items()))
            if e.future.done() and (self._bytes > self.max_bytes or now - e.created > self.ttl_s):
                self._entries.pop(key)
                self._bytes -= e.nbytes
            else:
                break

    async def run(self, key: str, body_digest: bytes, fmt: str, work: Callable[[], Awaitable[Response]]) -> Response:
        """The answer for ``key``: ``work()``'s, computed once per key and body.

        Args:
            key: the Idempotency-Key.
            body_digest: the SHA-256 of the whole body.
            fmt: the response format.
            work: computes the answer.

        Raises:
            ConflictError: the key was used for another body or response format.
        """
        now = time.monotonic()
        self._evict(now)
        digest = request_digest(body_digest, fmt)
        entry = self._entries.get(key)
        if entry is not None and entry.digest != digest:
            raise ConflictError(
                "this Idempotency-Key was used for a different request; use a new key per request",
                path="Idempotency-Key",
                rule="idempotency",
            )
        if entry is not None:
            try:
                resp = await asyncio.shield(entry.future)
            except Exception:  # the first attempt failed or was abandoned: plan afresh
                return await self.run(key, body_digest, fmt, work)
            self.replayed += 1
            return Response(
                resp.body,
                status_code=resp.status_code,
                media_type=resp.media_type,
                headers={"idempotent-replay": "true"},
            )
        entry = _Entry(digest=digest, created=now, future=asyncio.get_running_loop().create_future())
        self._entries[key] = entry
        try:
            resp = await work()
        except BaseException as exc:
            self._entries.pop(key, None)
            if not entry.future.done():
                entry.future.set_exception(
                    exc if isinstance(exc, Exception) else RuntimeError("the first attempt was abandoned")
                )
                entry.future.exception()  # retrieved: a failure with no waiter is not an asyncio warning
            raise
        entry.nbytes = len(resp.body)
        self._bytes += entry.nbytes
        entry.future.set_result(resp)
        self._evict(now)
        return resp
