"""The bounded planner pool: planning runs off the event loop, and excess load is refused.

``max_concurrent`` worker threads run jobs; up to ``max_queue`` more may wait for one.
A job beyond that is refused at once with :class:`~treepack.proto.errors.OverloadedError`
(HTTP 503 + Retry-After): the service never queues without bound and never hangs.

A slot is released when the job *finishes*, not when its awaiting request goes away
(a client that disconnects does not stop numpy), so admission always counts the threads'
real work.
"""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, TypeVar

from treepack.proto.errors import OverloadedError

__all__ = ["PlanPool"]

T = TypeVar("T")


class PlanPool:
    """Admission-controlled thread pool.

    Args:
        max_concurrent: worker threads (>= 1).
        max_queue: jobs allowed to wait for a worker (>= 0).
        retry_after_s: advised back-off carried by the 503.
    """

    def __init__(self, max_concurrent: int, max_queue: int, retry_after_s: float = 1.0) -> None:
        self.max_concurrent = max_concurrent
        self.max_queue = max_queue
        self.retry_after_s = retry_after_s
        self._executor = ThreadPoolExecutor(max_concurrent, thread_name_prefix="treepack-plan")
        self._lock = threading.Lock()
        self._admitted = 0
        self.rejected = 0

    @property
    def admitted(self) -> int:
        """Jobs running or waiting."""
        return self._admitted

    @property
    def running(self) -> int:
        return min(self._admitted, self.max_concurrent)

    @property
    def queue_depth(self) -> int:
        """Jobs waiting for a worker."""
        return max(0, self._admitted - self.max_concurrent)

    def _release(self, _: Future) -> None:
        with self._lock:
            self._admitted -= 1

    def submit(self, fn: Callable[..., T], *args: Any) -> "Future[T]":
        """Admit and start ``fn(*args)``, or raise :class:`OverloadedError` when full."""
        with self._lock:
            if self._admitted >= self.max_concurrent + self.max_queue:
                self.rejected += 1
                raise OverloadedError(
                    f"the planner is busy ({self.max_concurrent} running, {self.max_queue} queued); retry later",
                    path="$",
                    rule="queue_full",
                    retry_after=self.retry_after_s,
                )
            self._admitted += 1
        try:
            fut = self._executor.submit(fn, *args)
        except BaseException:
            with self._lock:
                self._admitted -= 1
            raise
        fut.add_done_callback(self._release)
        return fut

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """Run ``fn(*args)`` on a worker and await its result (see :meth:`submit`)."""
        return await asyncio.wrap_future(self.submit(fn, *args))

    def close(self) -> None:
        self._executor.shutdown(wait=True, cancel_futures=True)
