"""The embedded backend: the planner in this process, no server.

``pack`` is :func:`~treepack.service.planner.plan_batch`; ``whatif`` is
:func:`~treepack.service.planner.whatif.whatif` over inline shapes or over a local
history file (when ``history_path`` is given, every ``pack(record=True)`` records its
batch's shape there, as the sidecar does).
"""

from __future__ import annotations

from typing import Any

from treepack.proto import WIRE_VERSION
from treepack.proto.batch import PackInput
from treepack.proto.cost import CostModel
from treepack.proto.history import HistoryStore
from treepack.proto.history_read import empty_summary
from treepack.proto.plan import Plan
from treepack.proto.whatif import WhatIfQuery, WhatIfResult
from treepack.service.planner.api import plan_request
from treepack.service.planner.fingerprint import shape_job
from treepack.service.planner.options import check_options
from treepack.service.planner.whatif import whatif
from treepack.service.planner.whatif_pool import build_pool, history_scope, no_batches_error

__all__ = ["EmbeddedBackend"]


class EmbeddedBackend:
    """Plans in-process (a :class:`~treepack.client.protocols.Backend`).

    Args:
        history_path: optional SQLite file for a local shape history (see module docstring).
        history_max_batches: its retention by count.
        cost_model: plan with this :class:`~treepack.proto.cost.CostModel` (predicted
            step times; ``auto`` by time), as a sidecar with ``cost_model_path`` does.
    """

    def __init__(
        self, history_path: str | None = None, *, history_max_batches: int = 1000, cost_model: CostModel | None = None
    ) -> None:
        self._store = None
        self._cost = cost_model
        self._max_batches = history_max_batches
        if history_path is not None:
            self._store = HistoryStore(history_path, max_batches=history_max_batches)

    def pack(self, request: PackInput) -> Plan:
        """``plan_batch``; records the batch's shape when a history is set."""
        result = plan_request(request, cost_model=self._cost)
        if self._store is not None and request.record:
            job = shape_job(result, request.tags)
            if job is not None:
                st = result.plan.stats
                self._store.record(
                    job(), rows=st.rows, packed_tokens=st.packed_tokens, saved_fraction=st.saved_fraction
                )
        return result.plan

    def whatif(self, query: WhatIfQuery) -> list[WhatIfResult]:
        """What-if over ``query.shapes``, or over the local history when none are given
        (the batches and groups of the query's history scope, as the sidecar samples them)."""
        if query.shapes is not None:
            pool = build_pool(list(query.shapes))
        else:
            seq_len = check_options(query.options).seq_len
            scope, tags = history_scope(seq_len, query.history_seq_len, query.history_tags)
            shapes = [] if self._store is None else self._store.shapes(query.history_batches, seq_len=scope)
            pool = build_pool(shapes, tags=tags)
            if not pool.num_groups:
                raise no_batches_error(scope, [] if self._store is None else self._store.summary()["seq_lens"], tags)
        return whatif(
            pool,
            list(query.compositions),
            query.options,
            trials=query.trials,
            seed=query.seed,
            max_rows=query.max_rows,
            cost_model=self._cost,
            max_step_ms=query.max_step_ms,
        )

    def history(self) -> dict[str, Any]:
        summary = empty_summary() if self._store is None else self._store.summary()
        retention = {"max_batches": self._max_batches, "max_age_s": None}
        return {"version": WIRE_VERSION, "enabled": self._store is not None, **summary, "retention": retention}

    def health(self) -> dict[str, Any]:
        return {"version": WIRE_VERSION, "status": "ok", "backend": "embedded"}

    def close(self) -> None:
        if self._store is not None:
            self._store.close()
