"""The bounded planner pool: planning runs off the event loop, and excess load is refused.

``max_concurrent`` worker threads run jobs; up to ``max_queue`` more may wait for one.
A job beyond that is refused at once with :class:`~treepack.proto.errors.OverloadedError`
(HTTP 503 + Retry-After): the service never queues without bound and never hangs.

A slot is released when the job *finishes*, not when its awaiting request goes away, so
admission always counts the threads' real work. A job carries a :class:`Ticket`: the
planner calls it between phases and trials, and it raises
:class:`~treepack.proto.errors.DeadlineError` once the request's deadline has passed or
its client went away (:meth:`Ticket.cancel`), so abandoned work stops within one phase.

:class:`IntakeBudget` is the admission of request bodies: the bytes of bodies being read
or held at once, charged as they arrive.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, TypeVar

from treepack.proto.errors import DeadlineError, OverloadedError

__all__ = ["PlanPool", "Ticket", "IntakeBudget"]

T = TypeVar("T")


class Ticket:
    """The stop condition of one request's work: a deadline and a cancel flag.

    Args:
        timeout_s: seconds from now until the deadline.
    """

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self.deadline = time.monotonic() + timeout_s
        self._cancelled = threading.Event()

    def cancel(self) -> None:
        """Mark the work abandoned (its client disconnected)."""
        self._cancelled.set()

    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set()

    def __call__(self) -> None:
        """Raise :class:`DeadlineError` when the work should stop (the planner's ``check``)."""
        if self._cancelled.is_set():
            raise DeadlineError("the client went away; the work was stopped", path="$", rule="cancelled")
        if time.monotonic() > self.deadline:
            raise DeadlineError(
                f"the work ran past the request deadline of {self.timeout_s:g} s and was stopped",
                path="$",
                rule="deadline",
            )


class IntakeBudget:
    """Bytes of request bodies being read or held at once, bounded (module docstring).

    Bytes are charged as they arrive, so a client that announces a large body and sends
    nothing holds nothing. Small bodies may also use ``reserve`` bytes beyond the budget,
    so large uploads cannot starve a small pack.

    Args:
        budget: the bound in bytes.
        reserve: extra room for small bodies.
        retry_after_s: advised back-off carried by the 503.
    """

    def __init__(self, budget: int, retry_after_s: float = 1.0, *, reserve: int = 0) -> None:
        self.budget = budget
        self.reserve = reserve
        self.retry_after_s = retry_after_s
        self.in_flight = 0
        self.rejected = 0
        self._lock = threading.Lock()

    def acquire(self, nbytes: int, *, held: int = 0, small: bool = False) -> None:
        """Charge ``nbytes`` more to a body that already holds ``held``, or raise
        :class:`OverloadedError` (503) when the budget (plus the reserve, for a small
        body) would pass.

        A body larger than the whole budget is still admitted when no other body holds
        bytes (``max_body_bytes`` is its bound), so a budget below it never locks a size out.
        """
        with self._lock:
            limit = self.budget + (self.reserve if small else 0)
            if self.in_flight > held and self.in_flight + nbytes > limit:
                self.rejected += 1
                raise OverloadedError(
                    f"{self.in_flight} bytes of request bodies are being read (budget {self.budget}); retry later",
                    path="$",
                    rule="intake_budget",
                    retry_after=self.retry_after_s,
                )
            self.in_flight += nbytes

    def release(self, nbytes: int) -> None:
        with self._lock:
            self.in_flight -= nbytes


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

    def submit(self, fn: Callable[..., T], *args: Any) -> Future[T]:
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
