"""Prometheus metrics of one service instance (its own registry, so apps never share state).

Exported (``GET /metrics``, text format):

- ``treepack_requests_total{route,method,status}`` and ``treepack_request_seconds{route}``
  (histogram): every HTTP request, timed by an ASGI middleware.
- ``treepack_plan_seconds``: planner time per packed batch.
- ``treepack_pack_phase_seconds{phase}``: the rest of a pack's work on the worker:
  ``decode`` (body to validated batch) and ``encode`` (plan to answer body).
- ``treepack_tokens_in_total``, ``treepack_packed_tokens_total``: unpacked tokens received
  and tokens laid out in rows; ``treepack_saved_fraction`` and ``treepack_rows``
  (histograms, per batch).
- ``treepack_errors_total{kind}``: error responses by the error kind of the body.
- ``treepack_queue_depth``, ``treepack_plans_running``: the planner pool now;
  ``treepack_overloaded_total``: requests refused with 503.
- ``treepack_history_recorded_total``, ``treepack_history_skipped_total``,
  ``treepack_history_failed_total``, ``treepack_history_pending``: the shape recorder.
- ``treepack_whatif_trials_total``: planner runs made by what-if requests.
- ``treepack_history_undecodable_total``: stored shapes skipped because they fail their
  checksum or do not decode; ``treepack_history_damaged``: 1 while the history is damaged (``/readyz``
  says why).
- ``treepack_intake_bytes``: bytes of request bodies being read or held for planning;
  ``treepack_intake_refused_total``: bodies refused with 503 before they were read.
- ``treepack_work_stopped_total{reason}``: planning stopped at its deadline
  (``deadline``) or because its client went away (``cancelled``).
- ``treepack_idempotent_replays_total``: packs answered from the idempotency cache.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from treepack.proto.plan import Plan
from treepack.service.pool import PlanPool
from treepack.service.recorder import HistoryRecorder

__all__ = ["ServiceMetrics", "MetricsMiddleware", "ROUTES"]

ROUTES = ("/v1/pack", "/v1/whatif", "/v1/history", "/healthz", "/readyz", "/metrics", "/docs", "/openapi.json")
_LATENCY = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
)
_ROWS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 4096)
_SAVED = (0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 1.0)


class _StateCollector(Collector):
    """Reads the pool's and the recorder's counters at scrape time."""

    def __init__(self, pool: PlanPool, recorder: HistoryRecorder | None, service: Any = None) -> None:
        self.pool = pool
        self.recorder = recorder
        self.service = service

    def collect(self) -> Iterable[Any]:
        yield GaugeMetricFamily(
            "treepack_queue_depth", "planner jobs waiting for a worker", value=self.pool.queue_depth
        )
        yield GaugeMetricFamily("treepack_plans_running", "planner jobs running", value=self.pool.running)
        yield CounterMetricFamily(
            "treepack_overloaded", "requests refused with 503 (queue full)", value=self.pool.rejected
        )
        rec = self.recorder
        yield CounterMetricFamily("treepack_history_recorded", "batch shapes written", value=rec.recorded if rec else 0)
        yield CounterMetricFamily(
            "treepack_history_skipped",
            "batch shapes not recorded: writer backlog full",
            value=rec.skipped if rec else 0,
        )
        yield CounterMetricFamily(
            "treepack_history_failed", "batch shapes that failed to record", value=rec.failed if rec else 0
        )
        yield GaugeMetricFamily(
            "treepack_history_pending", "batch shapes waiting for the writer", value=rec.pending if rec else 0
        )
        svc = self.service
        if svc is None:
            return
        store = svc.store
        yield CounterMetricFamily(
            "treepack_history_undecodable",
            "stored shapes skipped: they fail their checksum or do not decode",
            value=store.undecodable if store else 0,
        )
        yield GaugeMetricFamily(
            "treepack_history_damaged", "1 while the history is damaged", value=int(svc.history_damage() is not None)
        )
        yield GaugeMetricFamily(
            "treepack_intake_bytes", "bytes of request bodies being read or held", value=svc.intake.in_flight
        )
        yield CounterMetricFamily(
            "treepack_intake_refused", "bodies refused with 503 before reading", value=svc.intake.rejected
        )
        yield CounterMetricFamily(
            "treepack_idempotent_replays", "packs answered from the idempotency cache", value=svc.replay.replayed
        )


class ServiceMetrics:
    """The metric objects of one service instance."""

    def __init__(self, pool: PlanPool, recorder: HistoryRecorder | None, service: Any = None) -> None:
        r = self.registry = CollectorRegistry()
        self.requests = Counter("treepack_requests", "HTTP requests", ["route", "method", "status"], registry=r)
        self.latency = Histogram(
            "treepack_request_seconds", "HTTP request latency", ["route"], buckets=_LATENCY, registry=r
        )
        self.plan_seconds = Histogram(
            "treepack_plan_seconds", "planner time per packed batch", buckets=_LATENCY, registry=r
        )
        self.pack_phase = Histogram(
            "treepack_pack_phase_seconds",
            "pack work besides planning: decode (body to batch), encode (plan to body)",
            ["phase"],
            buckets=_LATENCY,
            registry=r,
        )
        self.tokens_in = Counter("treepack_tokens_in", "unpacked tokens of packed batches", registry=r)
        self.packed_tokens = Counter("treepack_packed_tokens", "tokens laid out in rows", registry=r)
        self.saved = Histogram(
            "treepack_saved_fraction", "1 - packed/unpacked tokens, per batch", buckets=_SAVED, registry=r
        )
        self.rows = Histogram("treepack_rows", "rows per packed batch", buckets=_ROWS, registry=r)
        self.errors = Counter("treepack_errors", "error responses by kind", ["kind"], registry=r)
        self.whatif_trials = Counter("treepack_whatif_trials", "planner runs made by what-if requests", registry=r)
        self.work_stopped = Counter(
            "treepack_work_stopped", "planning stopped: deadline or client gone", ["reason"], registry=r
        )
        r.register(_StateCollector(pool, recorder, service))

    def observe_plan(self, plan: Plan) -> None:
        st = plan.stats
        self.plan_seconds.observe(st.timings_ms.get("total", 0.0) / 1e3)
        self.tokens_in.inc(st.unpacked_tokens)
        self.packed_tokens.inc(st.packed_tokens)
        self.saved.observe(st.saved_fraction)
        self.rows.observe(st.rows)

    def render(self) -> tuple[bytes, str]:
        """(exposition body, its content type)."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]


class MetricsMiddleware:
    """Pure ASGI middleware: counts and times every HTTP request by route and status.

    Unknown paths are labelled ``other`` so random URLs cannot blow up label cardinality.
    """

    def __init__(self, app: Callable[[Scope, Receive, Send], Awaitable[None]], metrics: ServiceMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope.get("path", "")
        route = path if path in ROUTES else "other"
        status = 500
        t0 = time.perf_counter()

        async def send_wrapper(message: dict[str, Any]) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = int(message["status"])
            await send(message)

        try:
            await self.app(scope, receive, send_wrapper)
        finally:
            self.metrics.requests.labels(route, scope.get("method", ""), str(status)).inc()
            self.metrics.latency.labels(route).observe(time.perf_counter() - t0)
