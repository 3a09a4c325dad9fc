"""The sidecar's planning work, without FastAPI: decode a body, call the planner, encode the answer.

:class:`PlanningService` holds one instance's parts (settings, planner pool, history,
metrics). :meth:`PlanningService.pack` and :meth:`PlanningService.whatif` take the raw body
and return the raw answer (an :class:`Answer`: its bytes, and the history record to queue
once it is final); the routes run them on a planner worker thread (decoding a large body
is CPU work too). Bodies are decoded within a bound of their size
(:mod:`treepack.proto.bounded`), and decoding counts against the request's deadline.
Errors are raised as the project's exceptions; the app maps them to HTTP in one place.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from treepack.proto import WIRE_VERSION
from treepack.proto.batch_wire import Limits, decode_pack_request
from treepack.proto.bounded import PACK_SPEC, WHATIF_SPEC, decode_request
from treepack.proto.codec import Format, encode_body, parse_message
from treepack.proto.cost import CostModel
from treepack.proto.cost_range import load_checked_cost_model
from treepack.proto.errors import PayloadTooLargeError, UnavailableError
from treepack.proto.history import HistoryStore
from treepack.proto.history_read import empty_summary
from treepack.proto.history_schema import HistoryDamaged, move_aside
from treepack.proto.options import OPTION_NAMES, PlanOptions
from treepack.proto.pack_messages import PackRequest
from treepack.proto.plan_wire import plan_to_wire
from treepack.proto.shape import BatchShape
from treepack.proto.shape_wire import shape_from_wire
from treepack.proto.whatif_messages import WhatIfRequest
from treepack.proto.whatif_wire import composition_from_wire, whatif_result_to_wire
from treepack.service.metrics import ServiceMetrics
from treepack.service.planner.api import plan_request
from treepack.service.planner.fingerprint import shape_job
from treepack.service.planner.options import check_options
from treepack.service.planner.ranks import check_cp_tiles
from treepack.service.planner.whatif import whatif
from treepack.service.planner.whatif_pool import (
    GroupPool,
    build_pool,
    history_scope,
    no_batches_error,
    pool_summary,
    whatif_work,
)
from treepack.service.pool import IntakeBudget, PlanPool
from treepack.service.recorder import HistoryRecorder
from treepack.service.replay import ReplayCache
from treepack.service.settings import Settings

__all__ = ["Answer", "PlanningService", "load_service_cost_model"]

log = logging.getLogger("treepack.service")


Check = Callable[[], None]


@dataclass(frozen=True, slots=True, kw_only=True)
class Answer:
    """A route's answer, as the planner worker leaves it.

    Attributes:
        body: the encoded response.
        record: queues what the answer promised the history (``recorded: true``); None
            when it promised nothing.
    """

    body: bytes
    record: Callable[[], None] | None = None

    def answered(self) -> None:
        """Call once the answer is final (the route answers 2xx with it): queue its record."""
        if self.record is not None:
            self.record()


def _inline_shapes(shapes: list[Any], check: Check | None) -> list[BatchShape]:
    """A what-if's inline shapes, each checked (``check`` between them: deadline, disconnect)."""
    out = []
    for i, s in enumerate(shapes):
        if check is not None:
            check()
        out.append(shape_from_wire(s, f"$.shapes[{i}]"))
    return out


def _check_tag_count(count: int, limit: int, what: str, path: str) -> None:
    """413 when a request carries more distinct tags than ``max_tags``."""
    if count > limit:
        raise PayloadTooLargeError(
            f"{what} {count} distinct tags, over the limit of {limit} (max_tags)", path=path, rule="max_tags"
        )


def load_service_cost_model(settings: Settings) -> CostModel | None:
    """The ``cost_model_path`` file, checked for finite predictions over every request the
    service accepts (any ``seq_len``, up to ``max_sequences`` rows, ``whatif_max_trials``
    trials summed), or None without one.

    Raises:
        CostModelError: one line naming the file and the field.
    """
    if settings.cost_model_path is None:
        return None
    return load_checked_cost_model(
        settings.cost_model_path, max_sequences=settings.max_sequences, trials=settings.whatif_max_trials
    )


class PlanningService:
    """One sidecar instance's state and request logic.

    Args:
        settings: the configuration.
    """

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.pool = PlanPool(settings.max_concurrent_plans, settings.max_queue, settings.retry_after_s)
        self.intake = IntakeBudget(
            settings.intake_budget_bytes, settings.retry_after_s, reserve=settings.intake_reserve_bytes
        )
        self.replay = ReplayCache(max_bytes=settings.idempotency_cache_bytes, ttl_s=settings.idempotency_ttl_s)
        self.store: HistoryStore | None = None
        self.recorder: HistoryRecorder | None = None
        self.history_problem: str | None = None
        self.history_problem_reason: str | None = None
        if settings.history_enabled:
            self.store = self._open_history()
            if self.store is not None:
                self.recorder = HistoryRecorder(self.store, max_pending=settings.history_max_pending)
            if settings.history_path is None:
                log.warning("the shape history is kept in memory; set TREEPACK_HISTORY_PATH to keep it across restarts")
        self.metrics = ServiceMetrics(self.pool, self.recorder, self)
        self.limits = Limits(max_sequences=settings.max_sequences, max_tokens=settings.max_tokens)
        self.cost_model = load_service_cost_model(settings)

    def _open_history(self) -> HistoryStore | None:
        """The store; a damaged file is moved aside (``history_recover``) or leaves the history off.

        Raises:
            HistoryPathError: the path cannot be created or written (moving nothing aside helps).
        """
        s = self.settings

        def open_store() -> HistoryStore:
            return HistoryStore(
                s.history_path,
                max_batches=s.history_max_batches,
                max_age_s=s.history_max_age_s,
                max_bytes=s.history_max_bytes,
            )

        try:
            return open_store()
        except HistoryDamaged as exc:
            if s.history_recover and s.history_path is not None:
                moved = move_aside(s.history_path)
                if moved is not None:
                    log.error("%s; moved it to %s and started a fresh history (history_recover)", exc, moved)
                    try:
                        return open_store()
                    except HistoryDamaged as again:
                        exc = again
                self._history_off(exc, "moving it aside did not help; see the server log")
                return None
            self._history_off(exc, "restart with TREEPACK_HISTORY_RECOVER=true to move the file aside")
            return None

    def _history_off(self, exc: HistoryDamaged, advice: str) -> None:
        self.history_problem = f"{exc} (the history is off; {advice})"
        self.history_problem_reason = f"{exc.reason} (the history is off; {advice})"
        log.error("%s", self.history_problem)

    def history_damage(self) -> str | None:
        if self.history_problem is not None:
            return self.history_problem
        return None if self.store is None else self.store.damaged

    def pack(self, body: bytes | bytearray, fmt_in: Format, fmt_out: Format, check: Check | None = None) -> Answer:
        """``POST /v1/pack``: body -> plan (worker thread); ``check`` stops it (deadline, disconnect).

        The batch is admitted to the history before the answer is encoded (the answer says
        ``recorded``) and queued only by :meth:`Answer.answered`, once the route has its
        answer: a plan that fails to encode, or a request abandoned before its answer, is
        not recorded (so its retry is not recorded twice).
        """
        if check is not None:
            check()  # it may have waited in the queue past its deadline
        t0 = time.perf_counter()
        msg = parse_message(PackRequest, decode_request(body, fmt_in, PACK_SPEC, check=check))
        # Options (422) before size limits (413); plan_request's check is then a no-op.
        check_options(PlanOptions(**{f: getattr(msg, f) for f in OPTION_NAMES}))
        request = decode_pack_request(msg, self.limits)
        if request.tags is not None:
            _check_tag_count(len(set(request.tags)), self.settings.max_tags, "the batch carries", "$.tags")
        self._check_cp_row(request.options)
        self.metrics.pack_phase.labels("decode").observe(time.perf_counter() - t0)
        result = plan_request(
            request, check=check, cost_model=self.cost_model, max_cp_tiles=self.settings.cp_tiles_limit
        )
        plan = result.plan
        recorder = self.recorder if request.record else None
        job = None if recorder is None else shape_job(result, request.tags)
        record = None
        if recorder is not None and job is not None and recorder.admit():
            record = functools.partial(recorder.record, job, plan.stats)
        self.metrics.observe_plan(plan)
        t0 = time.perf_counter()
        # A version-1 request gets a version-1 answer (treepack.proto.version).
        v = msg.version
        wire = {"version": v, "plan": plan_to_wire(plan, fmt_out, v), "recorded": record is not None}
        out = encode_body(wire, fmt_out)
        self.metrics.pack_phase.labels("encode").observe(time.perf_counter() - t0)
        return Answer(body=out, record=record)

    def _check_cp_row(self, options: Any) -> None:
        """413 before planning when one row's all-gather CP split is already over ``max_cp_tiles``."""
        if int(options.cp_size) > 1 and options.cp_attention == "allgather":
            check_cp_tiles(1, int(options.seq_len), int(options.cp_size), self.settings.cp_tiles_limit)

    def whatif(self, body: bytes | bytearray, fmt_in: Format, fmt_out: Format, check: Check | None = None) -> Answer:
        """``POST /v1/whatif``: compositions -> row distributions (worker thread).

        Priced before any trial: trials x compositions over ``whatif_max_trials``, more
        distinct tags than ``max_tags`` (``by_tag`` keys, inline shapes, ``history_tags``),
        one row's all-gather CP split over ``max_cp_tiles``, or a work estimate
        (:func:`~treepack.service.planner.whatif_pool.whatif_work`) over ``whatif_max_work``
        (default 4 x ``max_tokens``) are 413. ``check`` stops it inside the loops that
        grow (reading the history, indexing the pool, trials, CP splits): deadline, disconnect.
        """
        if check is not None:
            check()
        msg = parse_message(WhatIfRequest, decode_request(body, fmt_in, WHATIF_SPEC, check=check))
        # Whole-request validation (422) before resource limits (413): the options are
        # checked here first (whatif checks them again, a no-op on checked options).
        options = check_options(PlanOptions(**{f: getattr(msg, f) for f in OPTION_NAMES}))
        inline = None if msg.shapes is None else _inline_shapes(msg.shapes, check)
        runs = msg.trials * len(msg.compositions)
        if runs > self.settings.whatif_max_trials:
            raise PayloadTooLargeError(
                f"{msg.trials} trials x {len(msg.compositions)} compositions = {runs} planner runs, over the limit of "
                f"{self.settings.whatif_max_trials}",
                path="$.trials",
                rule="max_trials",
            )
        comps = [composition_from_wire(c) for c in msg.compositions]
        self._check_whatif_tags(comps, inline, msg.history_tags)
        self._check_cp_row(options)
        if inline is not None:
            source, pool = "shapes", build_pool(inline, check=check)
        else:
            source, pool = "history", self._history_pool(msg, options, check)
        self._check_work(pool, comps, msg.trials, options)
        results = whatif(
            pool,
            comps,
            options,
            trials=msg.trials,
            seed=msg.seed,
            max_rows=msg.max_rows,
            max_tokens=self.settings.max_tokens,
            check=check,
            cost_model=self.cost_model,
            max_cp_tiles=self.settings.cp_tiles_limit,
            max_step_ms=msg.max_step_ms,
        )
        self.metrics.whatif_trials.inc(runs)
        out = {
            "version": msg.version,  # a version-1 request gets a version-1 answer (treepack.proto.version)
            "source": source,
            "pool": pool_summary(pool, self.settings.max_tags),
            "results": [whatif_result_to_wire(r, msg.version) for r in results],
        }
        return Answer(body=encode_body(out, fmt_out))

    def _check_whatif_tags(self, comps: list[Any], inline: list[BatchShape] | None, history_tags: Any) -> None:
        """413 for more distinct tags than ``max_tags`` in one place of a what-if."""
        limit = self.settings.max_tags
        for i, c in enumerate(comps):
            if c.by_tag is not None:
                _check_tag_count(len(c.by_tag), limit, "by_tag names", f"$.compositions[{i}].by_tag")
        if history_tags is not None:
            _check_tag_count(len(set(history_tags)), limit, "history_tags names", "$.history_tags")
        if inline is not None:
            seen: set[str] = set()
            for sh in inline:
                seen.update(t or "" for t in sh.tags or (None,))
                _check_tag_count(len(seen), limit, "the shapes carry at least", "$.shapes")

    def _history_pool(self, msg: WhatIfRequest, options: PlanOptions, check: Check | None) -> GroupPool:
        """The pool of the recorded batches the what-if's scope selects (:func:`history_scope`).

        Raises:
            RequestError: the scope holds no group (422 ``no_history``, naming the recorded seq_lens).
            UnavailableError: the history is damaged (503; ``/readyz`` says why).
        """
        scope, tags = history_scope(int(options.seq_len), msg.history_seq_len, msg.history_tags)
        self._refuse_if_damaged()
        if self.recorder is None or self.store is None:
            raise no_batches_error(scope, [], tags)
        self.recorder.flush()
        store = self.store
        shapes = self._history_call(lambda: store.shapes(msg.history_batches, seq_len=scope, check=check))
        pool = build_pool(shapes, tags=tags, check=check)
        if not pool.num_groups:
            raise no_batches_error(scope, self._history_call(store.summary)["seq_lens"], tags)
        return pool

    def _check_work(self, pool: GroupPool, comps: list[Any], trials: int, options: PlanOptions) -> None:
        """413 when the what-if's work estimate passes ``whatif_max_work``."""
        work = whatif_work(
            pool,
            comps,
            trials,
            seq_len=int(options.seq_len),
            cp_size=int(options.cp_size),
            cp_attention=str(options.cp_attention),
        )
        limit = self.settings.whatif_work_limit
        if work > limit:
            setting = (
                "whatif_max_work"
                if self.settings.whatif_max_work is not None
                else "whatif_max_work, unset: 4 x max_tokens"
            )
            raise PayloadTooLargeError(
                f"{trials} trials of these compositions may plan {work} tokens, over the work limit of "
                f"{limit} ({setting})",
                path="$.trials",
                rule="max_work",
            )

    def history_summary(self) -> dict[str, Any]:
        """``GET /v1/history`` (blocking: waits for pending writes, then queries)."""
        s = self.settings
        self._refuse_if_damaged()
        if self.store is None or self.recorder is None:
            summary, enabled = empty_summary(), False
        else:
            self.recorder.flush()
            summary, enabled = self._history_call(self.store.summary), True
        return {
            "version": WIRE_VERSION,
            "enabled": enabled,
            **summary,
            "retention": {"max_batches": s.history_max_batches, "max_age_s": s.history_max_age_s},
        }

    def _refuse_if_damaged(self) -> None:
        problem = self.history_damage()
        if problem is not None:
            raise UnavailableError(f"the shape history is unavailable: {problem}", path="$", rule="history_damaged")

    def _history_call(self, fn: Callable[[], Any]) -> Any:
        try:
            return fn()
        except HistoryDamaged:
            self._refuse_if_damaged()
            raise

    def ready_checks(self, *, detail: bool = False) -> dict[str, str]:
        """Readiness: each part answers (``"ok"``, maybe with a note after ``"ok; "``) or says why not.

        Args:
            detail: name files (for an authenticated reader); else short reasons, no paths.
        """
        checks = {"planner": "ok"}
        if self.history_problem is not None:
            checks["history"] = f"damaged: {self.history_problem if detail else self.history_problem_reason}"
        elif self.store is not None:
            try:
                checks["history"] = self.store.check(detail=detail)
            except Exception as exc:  # any database failure means not ready
                checks["history"] = f"error: {exc}" if detail else f"error: {type(exc).__name__}"
        return checks

    def flush(self, timeout: float | None = 60.0) -> None:
        """Wait until every queued history write is done, then fold the WAL into the file."""
        if self.recorder is not None:
            self.recorder.flush(timeout)
        if self.store is not None:
            try:
                self.store.checkpoint()
            except HistoryDamaged:
                pass  # logged; readiness reports it

    def close(self) -> None:
        """Stop the workers, write what is pending, checkpoint and close the history."""
        self.pool.close()
        if self.recorder is not None:
            self.recorder.close()
