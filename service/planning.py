"""The sidecar's planning work, without FastAPI: decode a body, call the planner, encode the answer.

:class:`PlanningService` holds one instance's parts (settings, planner pool, history,
metrics). :meth:`PlanningService.pack` and :meth:`PlanningService.whatif` take the raw body
and return the raw answer; the routes run them on a planner worker thread (decoding a
large body is CPU work too). Errors are raised as the project's exceptions; the app maps
them to HTTP in one place.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from treepack.proto import WIRE_VERSION
from treepack.proto.codec import Format, decode_body, encode_body, parse_message
from treepack.proto.errors import PayloadTooLargeError
from treepack.proto.batch_wire import Limits, decode_pack_request
from treepack.proto.messages import PackRequest, WhatIfRequest
from treepack.proto.options import OPTION_NAMES, PlanOptions
from treepack.proto.plan_wire import plan_to_wire
from treepack.proto.shape import BatchShape
from treepack.proto.shape_wire import shape_from_wire
from treepack.proto.whatif_wire import composition_from_wire, whatif_result_to_wire
from treepack.service.history import HistoryRecorder, HistoryStore, empty_summary
from treepack.service.metrics import ServiceMetrics
from treepack.service.planner.api import plan_request
from treepack.service.planner.fingerprint import shape_job
from treepack.service.planner.options import check_options
from treepack.service.planner.whatif import build_pool, whatif
from treepack.service.pool import PlanPool
from treepack.service.settings import Settings

__all__ = ["PlanningService"]

log = logging.getLogger("treepack.service")


def _pool_summary(shapes: list[BatchShape]) -> dict[str, Any]:
    """What a what-if sampled from: batches, groups, sequences, tokens, groups per tag."""
    pool = build_pool(shapes)
    return {
        "batches": len(shapes),
        "groups": pool.num_groups,
        "sequences": pool.num_sequences,
        "tokens": int(pool.lens.sum()),
        "tags": {t: int(u.shape[0]) for t, u in pool.by_tag.items()},
    }


class PlanningService:
    """One sidecar instance's state and request logic.

    Args:
        settings: the configuration.
    """

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.pool = PlanPool(settings.max_concurrent_plans, settings.max_queue, settings.retry_after_s)
        self.store: HistoryStore | None = None
        self.recorder: HistoryRecorder | None = None
        if settings.history_enabled:
            self.store = HistoryStore(settings.history_path, max_batches=settings.history_max_batches, max_age_s=settings.history_max_age_s)
            self.recorder = HistoryRecorder(self.store, max_pending=settings.history_max_pending)
            if settings.history_path is None:
                log.warning("the shape history is kept in memory; set TREEPACK_HISTORY_PATH to keep it across restarts")
        self.metrics = ServiceMetrics(self.pool, self.recorder)
        self.limits = Limits(max_sequences=settings.max_sequences, max_tokens=settings.max_tokens)

    def pack(self, body: bytes, fmt_in: Format, fmt_out: Format) -> bytes:
        """``POST /v1/pack``: body -> plan (worker thread)."""
        t0 = time.perf_counter()
        msg = parse_message(PackRequest, decode_body(body, fmt_in))
        # Options (422) before size limits (413); plan_request's check is then a no-op.
        check_options(PlanOptions(**{f: getattr(msg, f) for f in OPTION_NAMES}))
        request = decode_pack_request(msg, self.limits)
        self.metrics.pack_phase.labels("decode").observe(time.perf_counter() - t0)
        result = plan_request(request)
        plan = result.plan
        recorded = bool(request.record and self.recorder is not None and self.recorder.submit(shape_job(result, request.tags), plan.stats))
        self.metrics.observe_plan(plan)
        t0 = time.perf_counter()
        out = encode_body({"version": WIRE_VERSION, "plan": plan_to_wire(plan, fmt_out), "recorded": recorded}, fmt_out)
        self.metrics.pack_phase.labels("encode").observe(time.perf_counter() - t0)
        return out

    def whatif(self, body: bytes, fmt_in: Format, fmt_out: Format) -> bytes:
        """``POST /v1/whatif``: compositions -> row distributions (worker thread)."""
        msg = parse_message(WhatIfRequest, decode_body(body, fmt_in))
        # Whole-request validation (422) before resource limits (413): the options are
        # checked here first (whatif checks them again, a no-op on checked options).
        options = check_options(PlanOptions(**{f: getattr(msg, f) for f in OPTION_NAMES}))
        inline = None if msg.shapes is None else [shape_from_wire(s, f"$.shapes[{i}]") for i, s in enumerate(msg.shapes)]
        runs = msg.trials * len(msg.compositions)
        if runs > self.settings.whatif_max_trials:
            raise PayloadTooLargeError(
                f"{msg.trials} trials x {len(msg.compositions)} compositions = {runs} planner runs, over the limit of "
                f"{self.settings.whatif_max_trials}",
                path="$.trials",
                rule="max_trials",
            )
        source, shapes = ("shapes", inline) if inline is not None else ("history", self._recorded_shapes(msg.history_batches))
        results = whatif(
            shapes,
            [composition_from_wire(c) for c in msg.compositions],
            options,
            trials=msg.trials,
            seed=msg.seed,
            max_rows=msg.max_rows,
            max_tokens=self.settings.max_tokens,
        )
        self.metrics.whatif_trials.inc(runs)
        out = {
            "version": WIRE_VERSION,
            "source": source,
            "pool": _pool_summary(shapes),
            "results": [whatif_result_to_wire(r) for r in results],
        }
        return encode_body(out, fmt_out)

    def _recorded_shapes(self, last: int | None) -> list[BatchShape]:
        """The ``last`` recorded batch shapes (all when None), pending writes included; none without a history."""
        if self.recorder is None or self.store is None:
            return []
        self.recorder.flush()
        return self.store.shapes(last)

    def history_summary(self) -> dict[str, Any]:
        """``GET /v1/history`` (blocking: waits for pending writes, then queries)."""
        s = self.settings
        if self.store is None or self.recorder is None:
            summary, enabled = empty_summary(), False
        else:
            self.recorder.flush()
            summary, enabled = self.store.summary(), True
        return {
            "version": WIRE_VERSION,
            "enabled": enabled,
            **summary,
            "retention": {"max_batches": s.history_max_batches, "max_age_s": s.history_max_age_s},
        }

    def ready_checks(self) -> dict[str, str]:
        """Readiness: each part answers (``"ok"``) or says why not."""
        checks = {"planner": "ok"}
        if self.store is not None:
            try:
                checks["history"] = self.store.check()
            except Exception as exc:  # any database failure means not ready
                checks["history"] = f"error: {exc}"
        return checks

    def flush(self, timeout: float | None = 60.0) -> None:
        """Wait until every queued history write is done."""
        if self.recorder is not None:
            self.recorder.flush(timeout)

    def close(self) -> None:
        self.pool.close()
        if self.recorder is not None:
            self.recorder.close()
