"""What-if messages: :class:`~treepack.proto.whatif.Composition` and
:class:`~treepack.proto.whatif.WhatIfResult` <-> the ``WhatIfRequest`` / ``WhatIfResponse``
fields. The client encodes compositions and decodes results; the service the reverse.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from treepack.proto.buffers import Format
from treepack.proto.plan_wire import strategy_from_wire, strategy_to_wire
from treepack.proto.shape_wire import shape_to_wire
from treepack.proto.version import WIRE_VERSION
from treepack.proto.whatif import MIN_SUGGESTED_TRIALS, Composition, Distribution, WhatIfQuery, WhatIfResult
from treepack.proto.whatif_messages import Composition as CompositionMessage
from treepack.proto.whatif_messages import WhatIfResultMessage

__all__ = [
    "composition_to_wire",
    "composition_from_wire",
    "whatif_request",
    "whatif_result_to_wire",
    "whatif_result_from_wire",
]


def composition_to_wire(c: Composition) -> dict[str, Any]:
    return {"name": c.name, "groups": c.groups, "by_tag": None if c.by_tag is None else dict(c.by_tag)}


def composition_from_wire(c: CompositionMessage) -> Composition:
    return Composition(name=c.name, groups=c.groups, by_tag=None if c.by_tag is None else dict(c.by_tag))


def whatif_request(query: WhatIfQuery, fmt: Format) -> dict[str, Any]:
    """A ``WhatIfRequest`` dict: the compositions, the plan options as given (the server
    checks them), inline shapes if any, the other fields given (None = the server's default)."""
    msg: dict[str, Any] = {
        "version": WIRE_VERSION,
        "compositions": [composition_to_wire(c) for c in query.compositions],
        **query.options.to_wire(),
    }
    fields = {
        "trials": query.trials,
        "seed": query.seed,
        "max_rows": query.max_rows,
        "history_batches": query.history_batches,
        "history_seq_len": query.history_seq_len,
        "history_tags": None if query.history_tags is None else list(query.history_tags),
        "max_step_ms": query.max_step_ms,
    }
    msg.update({k: v for k, v in fields.items() if v is not None})
    if query.shapes is not None:
        msg["shapes"] = [shape_to_wire(s, fmt) for s in query.shapes]
    return msg


def _dist_to_wire(d: Distribution, version: int) -> dict[str, float]:
    out = {"mean": d.mean, "p50": d.p50, "p90": d.p90, "min": d.min, "max": d.max}
    return out if version < 2 else {**out, "std": d.std, "stderr": d.stderr}


def whatif_result_to_wire(r: WhatIfResult, version: int = WIRE_VERSION) -> dict[str, Any]:
    """The ``WhatIfResultMessage`` dict of a result; version 1 leaves out what version 2 added."""
    added = {
        "strategies": [strategy_to_wire(s) for s in r.strategies],
        "trial_step_ms": None if r.trial_step_ms is None else r.trial_step_ms.tolist(),
        "max_step_ms": r.max_step_ms,
        "p_step_over": r.p_step_over,
        "suggested_trials": r.suggested_trials,
    }
    return {
        **(added if version >= 2 else {}),
        "name": r.name,
        "groups": r.groups,
        "by_tag": r.by_tag,
        "trials": r.trials,
        "rows": _dist_to_wire(r.rows, version),
        "packed_tokens": _dist_to_wire(r.packed_tokens, version),
        "unpacked_tokens": _dist_to_wire(r.unpacked_tokens, version),
        "saved_fraction": _dist_to_wire(r.saved_fraction, version),
        "max_rows": r.max_rows,
        "p_rows_over": r.p_rows_over,
        "row_counts": r.row_counts.tolist(),
        "step_ms": None if r.step_ms is None else _dist_to_wire(r.step_ms, version),
    }


def _dist_from_wire(d: Any) -> Distribution:
    return Distribution(
        mean=d.mean, p50=d.p50, p90=d.p90, min=d.min, max=d.max, std=d.std or 0.0, stderr=d.stderr or 0.0
    )


def whatif_result_from_wire(r: WhatIfResultMessage) -> WhatIfResult:
    return WhatIfResult(
        name=r.name,
        groups=r.groups,
        by_tag=None if r.by_tag is None else dict(r.by_tag),
        trials=r.trials,
        rows=_dist_from_wire(r.rows),
        packed_tokens=_dist_from_wire(r.packed_tokens),
        unpacked_tokens=_dist_from_wire(r.unpacked_tokens),
        saved_fraction=_dist_from_wire(r.saved_fraction),
        max_rows=r.max_rows,
        p_rows_over=r.p_rows_over,
        row_counts=np.asarray(r.row_counts, dtype=np.int64),
        step_ms=None if r.step_ms is None else _dist_from_wire(r.step_ms),
        strategies=tuple(strategy_from_wire(s) for s in r.strategies or ()),
        trial_step_ms=None if r.trial_step_ms is None else np.asarray(r.trial_step_ms, dtype=np.float64),
        max_step_ms=r.max_step_ms,
        p_step_over=r.p_step_over,
        suggested_trials=MIN_SUGGESTED_TRIALS if r.suggested_trials is None else r.suggested_trials,
    )
