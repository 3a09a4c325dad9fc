"""Tree or plain packing by predicted step time: ``placement="auto"`` with a cost model.

Rows and tokens are not time: a tree row pays for its segments (metadata, per-segment
kernel work, gathered ancestor keys, one recurrent call per depth level) and a dense-mask
backend pays for every row's full [C, C] attention whatever the sharing. With a
:class:`~treepack.proto.cost.CostModel`, ``auto`` plans the candidates of
:func:`time_candidates`, predicts each one's step time and keeps the fastest:

- ``tree``: the tree plan (``auto``'s own placement, the plan it makes without a cost model);
- ``no_share``: plain sequence packing of the same batch (no tree);
- ``min_shared_len=m``: the tree again with a larger rule-4 threshold (``m`` = 4x and 16x
  the asked one, at most ``seq_len``), only where the tree plan has a shared segment
  shorter than ``m`` (where it would change anything): fewer, longer segments.

Ties go to the simpler plan (``no_share`` first, then the larger thresholds). ``plan.strategy``
names the winner, its predicted ms and the runner-up's; ``plan.stats.predicted_ms`` holds the
winner's prediction. When the winner shares nothing although the tree plan did (plain
packing, or a threshold above every shared run), a :class:`~treepack.proto.cost.CostWarning`
says that the tree does not pay on this batch. (On a batch with nothing to share the tree
plan is itself plain packing, placed by ``auto``; it competes with ``no_share`` on rows.)

**The repair budget by what a row is worth.** Every row ``auto``'s repair pass removes
saves :meth:`~treepack.proto.cost.CostModel.row_ms` of step time, and the pass runs once
per step; with a cost model the pass may spend up to :data:`REPAIR_ROW_SHARE` of that
(:func:`repair_budget_ms`: never less than the asked ``repair_ms``, at most
:data:`REPAIR_MS_CAP`; ``repair_ms=0`` still turns the pass off). A 131k-token row of
seconds of GPU time buys the pass its cap; a small CPU row leaves it at ``repair_ms``.
``stats.timings_ms["repair_budget"]`` records the budget used.
"""

from __future__ import annotations

import dataclasses
import time
import warnings
from collections.abc import Callable
from typing import Any

from treepack.proto.batch import SequenceBatch
from treepack.proto.cost import CostModel, CostWarning
from treepack.proto.options import PlanOptions
from treepack.proto.plan import Plan

__all__ = [
    "LARGER_MIN_SHARED",
    "STRATEGY_MAX_LEN",
    "REPAIR_ROW_SHARE",
    "REPAIR_MS_CAP",
    "repair_budget_ms",
    "time_candidates",
    "choose_by_time",
    "with_prediction",
]

LARGER_MIN_SHARED = (4, 16)
"""Factors of ``min_shared_len`` tried as candidates (where a shared segment is shorter)."""

STRATEGY_MAX_LEN = 64  # the wire's limit on ``strategy``
REPAIR_ROW_SHARE = 0.25
"""Share of one row's predicted step time the repair pass may spend trying to remove it."""
REPAIR_MS_CAP = 1000.0
"""Most CPU ms a cost model buys the repair pass (the asked ``repair_ms`` may be higher)."""


def repair_budget_ms(cost: CostModel, options: PlanOptions) -> float:
    """The repair pass's budget, ms, with a cost model (module docstring).

    Args:
        cost: the cost model.
        options: the checked options (``repair_ms``, ``seq_len``).
    """
    asked = float(options.repair_ms)
    if asked <= 0:
        return 0.0
    return max(asked, min(REPAIR_MS_CAP, REPAIR_ROW_SHARE * cost.row_ms(int(options.seq_len))))


def time_candidates(tree_plan: Plan) -> list[tuple[str, PlanOptions]]:
    """(label, options) of the alternatives to the tree plan ``auto`` made.

    Args:
        tree_plan: the plan ``auto`` made without a cost model.
    """
    opts = tree_plan.options
    out = [("no_share", dataclasses.replace(opts, placement="no_share"))]
    seg = tree_plan.segments
    shared = seg.length[seg.sharers >= 2]
    for f in LARGER_MIN_SHARED:
        m = int(opts.min_shared_len) * f
        if m <= int(opts.seq_len) and bool((shared < m).any()):
            out.append((f"min_shared_len={m}", dataclasses.replace(opts, min_shared_len=m)))
    return out


def with_prediction(plan: Plan, cost: CostModel) -> Plan:
    """``plan`` with ``stats.predicted_ms`` filled in."""
    return dataclasses.replace(plan, stats=dataclasses.replace(plan.stats, predicted_ms=cost.predict_ms(plan)))


def _strategy(label: str, ms: float, runner: tuple[str, float] | None) -> str:
    s = f"{label} by time: {ms:.4g} ms"
    if runner is not None:
        s += f" vs {runner[0]} {runner[1]:.4g} ms"
    return s[:STRATEGY_MAX_LEN]


def choose_by_time(
    batch: SequenceBatch, options: PlanOptions, cost: CostModel, plan_fn: Callable[[SequenceBatch, PlanOptions], Any]
) -> Any:
    """Plan every candidate, predict its step time, return the fastest (module docstring).

    Args:
        batch: the normalized batch.
        options: the checked options (``placement="auto"``).
        cost: the cost model.
        plan_fn: plans one candidate without a cost model: ``(batch, options) ->`` a
            ``PlanResult`` (the planner's ``plan_with_tree``).

    Returns:
        The winner's ``PlanResult`` (its ``tree`` the one of the asked options, what the
        history records) with ``options.placement`` still ``auto`` (what was asked), its
        ``strategy`` saying which candidate won and by how much, its
        ``stats.predicted_ms``, and ``stats.timings_ms["by_time"]``: planning and
        predicting the other candidates, ms (also in ``total``).
    """
    assert options.placement == "auto", options.placement
    first = plan_fn(batch, options)
    t0 = time.perf_counter()
    results = [("tree", first)] + [(label, plan_fn(batch, o)) for label, o in time_candidates(first.plan)]
    preds = [cost.predict_ms(r.plan) for _, r in results]
    # Ties go to the simpler plan: later candidates are simpler (fewer shared segments).
    order = sorted(range(len(results)), key=lambda i: (preds[i], -i))
    win, runner = order[0], (order[1] if len(order) > 1 else None)
    label, res = results[win]
    plan = res.plan
    name = plan.strategy if label == "tree" else label
    spent = (time.perf_counter() - t0) * 1e3
    timings = dict(plan.stats.timings_ms)
    timings["by_time"] = spent
    timings["total"] = first.plan.stats.timings_ms.get("total", 0.0) + spent
    stats = dataclasses.replace(plan.stats, predicted_ms=preds[win], timings_ms=timings)
    chosen_options = dataclasses.replace(plan.options, placement="auto")
    strategy = _strategy(name, preds[win], None if runner is None else (results[runner][0], preds[runner]))
    plan = dataclasses.replace(plan, options=chosen_options, strategy=strategy, stats=stats)
    shares = bool((plan.segments.sharers >= 2).any())
    if not shares and bool((first.plan.segments.sharers >= 2).any()):
        warnings.warn(
            CostWarning(
                f"tree packing does not pay on this batch: {name} (no shared segment) is predicted at "
                f"{preds[win]:.4g} ms per step, the tree at {preds[0]:.4g} ms ({plan.stats.sequences} sequences, "
                f"tree tokens {first.plan.stats.tree_tokens} of {plan.stats.unpacked_tokens}); "
                "auto packed them without sharing"
            ),
            stacklevel=4,
        )
    # The tree beside the plan is the one built with the asked options: the history records
    # the batch's shape at the asked min_shared_len, whichever candidate won.
    return dataclasses.replace(res, plan=plan, tree=first.tree)
