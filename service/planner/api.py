"""The planner's entry points: :func:`plan_batch` (sequences in, a :class:`Plan` out) and
:func:`plan_with_tree` (a normalized batch in, the plan and its tree out).

Every path checks the options once, with :func:`~.options.check_options`; the tree is
returned beside the plan (:class:`PlanResult`) to whoever needs it (the history recorder,
the embedded client's what-if), never as part of the plan.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from treepack.proto.batch import PackInput, SequenceBatch
from treepack.proto.cost import CostModel
from treepack.proto.errors import NoTrainableWarning
from treepack.proto.options import PlanOptions, as_options
from treepack.proto.plan import Plan, PlanStats, Segments
from treepack.proto.strategy import strategy_of
from treepack.service.planner.bounds import lower_bound_rows
from treepack.service.planner.by_time import choose_by_time, repair_budget_ms, with_prediction
from treepack.service.planner.layout import layout_rows
from treepack.service.planner.metadata import attention_meta, gdn_meta
from treepack.service.planner.options import check_options
from treepack.service.planner.placement import Placement, place_leaves
from treepack.service.planner.ranks import assign_ranks
from treepack.service.planner.tree import Tree, build_tree, flat_tree

__all__ = ["PlanResult", "plan_batch", "plan_request", "plan_normalized", "plan_with_tree"]


@dataclass(frozen=True, slots=True, kw_only=True)
class PlanResult:
    """A plan, and the batch and global tree it was planned from (planner side only)."""

    plan: Plan
    batch: SequenceBatch
    tree: Tree


def plan_batch(
    sequences: Sequence[Any], options: PlanOptions | None = None, *, cost_model: CostModel | None = None, **kwargs: Any
) -> Plan:
    """Pack a batch as one global prefix tree into rows of ``seq_len`` tokens.

    Args:
        sequences: S sequences of token ids in [0, 2**32).
        options: a :class:`~treepack.proto.options.PlanOptions`; or give its fields as
            keywords instead (``seq_len=``, ``min_shared_len=64``, ``placement="auto"``
            (``bfd``, ``in_order``, ``no_share``), ``num_ranks=1``, ``conv_width=4``,
            ``share_trainable=False``, ``on_overflow="error"`` (``truncate``, ``drop``)).
        cost_model: a :class:`~treepack.proto.cost.CostModel`: the plan's predicted step
            time goes in ``stats.predicted_ms``, and ``placement="auto"`` picks the tree
            or plain packing by it (:mod:`~.by_time`).
        **kwargs: the option keywords, and the rest of the batch as
            :class:`~treepack.proto.batch.PackInput` names it: ``trainable`` (per sequence a
            bool array or a prompt length; ``None``: no token is a loss target, every
            sequence fully shareable; left out, the same with a
            :class:`~treepack.proto.errors.NoTrainableWarning`), ``groups`` (per sequence an int/str
            id: orders ``bfd``, never limits sharing), ``keys`` (per sequence None or one
            uint64 per token that must also match to share). ``tags`` and ``record`` are
            taken and unused: there is no history here.

    Returns:
        The :class:`Plan`.

    Raises:
        RequestError: (or a subclass) for any invalid argument, naming it.
    """
    if "trainable" not in kwargs and not isinstance(sequences, PackInput):
        warnings.warn(
            NoTrainableWarning(
                "plan_batch got no trainable=: every token is planned as a non-target (shared wherever the "
                "sequences agree, no join token duplicated), which a loss on this plan would read wrongly; pass "
                "trainable= (per sequence a prompt length or 0/1 flags), or trainable=None to say nothing is trained"
            ),
            stacklevel=2,
        )
    return plan_request(PackInput.of(sequences, options, **kwargs), cost_model=cost_model).plan


def plan_request(
    request: PackInput,
    *,
    check: Callable[[], None] | None = None,
    cost_model: CostModel | None = None,
    max_cp_tiles: int | None = None,
) -> PlanResult:
    """Check the options, normalize the batch with them, plan it (the sidecar's path too).

    ``check``, ``cost_model`` and ``max_cp_tiles`` are as for :func:`plan_with_tree`.
    """
    t0 = time.perf_counter()
    opts = check_options(request.options)
    return plan_with_tree(
        request.normalize(opts.seq_len, opts.on_overflow),
        opts,
        t0=t0,
        check=check,
        cost_model=cost_model,
        max_cp_tiles=max_cp_tiles,
    )


def plan_normalized(
    batch: SequenceBatch,
    options: PlanOptions | None = None,
    *,
    cost_model: CostModel | None = None,
    **option_kwargs: Any,
) -> Plan:
    """:func:`plan_batch` on an already normalized :class:`SequenceBatch`."""
    return plan_with_tree(batch, check_options(as_options(options, option_kwargs)), cost_model=cost_model).plan


def _no_check() -> None:
    return None


def plan_with_tree(
    batch: SequenceBatch,
    options: PlanOptions,
    *,
    t0: float | None = None,
    check: Callable[[], None] | None = None,
    cost_model: CostModel | None = None,
    repair_ms: float | None = None,
    max_cp_tiles: int | None = None,
) -> PlanResult:
    """Plan a normalized batch with options as returned by :func:`~.options.check_options`.

    Args:
        batch: the batch (normalized with ``options.seq_len`` and ``options.on_overflow``).
        options: the checked options.
        t0: when the request started (``perf_counter``), for the ``normalize`` timing.
        check: called between phases; it raises to stop the work (the sidecar's
            deadline and cancellation), or None.
        cost_model: predicts the step time (``stats.predicted_ms``); with
            ``placement="auto"`` the fastest of the candidates of :mod:`~.by_time` wins,
            each with the repair budget the model gives a row (:func:`~.by_time.repair_budget_ms`)
            unless ``repair_ms`` is given.
        repair_ms: the repair pass's budget instead of ``options.repair_ms`` or the cost
            model's (then also recorded as ``stats.timings_ms["repair_budget"]``); None: the
            option's, or with a cost model the one it gives a row.
        max_cp_tiles: refuse (413) an all-gather CP split of more tiles than this
            (:func:`~.ranks.check_cp_tiles`, before the split runs); None: no limit.

    Returns:
        The plan and its tree.

    Raises:
        PayloadTooLargeError: the all-gather CP split is over ``max_cp_tiles``.
    """
    if cost_model is not None:
        return _plan_by_cost(
            batch, options, cost_model, t0=t0, check=check, repair_ms=repair_ms, max_cp_tiles=max_cp_tiles
        )
    t0 = time.perf_counter() if t0 is None else t0
    check = check or _no_check
    seq_len = options.seq_len
    t1 = time.perf_counter()
    check()
    tree = build_tree(
        batch,
        options.min_shared_len,
        share_trainable=options.share_trainable,
        min_shared_saving=options.min_shared_saving,
    )
    t2 = time.perf_counter()
    check()
    bound = lower_bound_rows(tree, seq_len)
    budget = options.repair_ms if repair_ms is None else repair_ms
    placed = place_leaves(tree, batch, seq_len, options.placement, bound=bound, repair_ms=budget)
    row_of, strategy, num_rows = placed.row_of, placed.strategy, placed.num_rows
    t3 = time.perf_counter()
    check()
    seg = layout_rows(flat_tree(batch) if options.placement == "no_share" else tree, row_of, num_rows)
    t4 = time.perf_counter()
    check()
    att = attention_meta(seg)
    gdn = gdn_meta(seg, seq_len, options.conv_width)
    rk = assign_ranks(
        seg,
        num_rows,
        options.num_ranks,
        seq_len=seq_len,
        cp_size=options.cp_size,
        cp_attention=options.cp_attention,
        max_cp_tiles=max_cp_tiles,
        check=check,
    )
    t5 = time.perf_counter()
    stats = _plan_stats(batch, tree, seg, placed, bound, seq_len, (t0, t1, t2, t3, t4, t5), repair_ms)
    plan = Plan(
        options=options,
        num_rows=num_rows,
        strategy=strategy,
        packing=strategy_of(seg.sharers, options.min_shared_len),
        seq_lens=batch.lens,
        orig_lens=batch.orig_lens,
        row_of=row_of,
        first_trainable=batch.first_trainable,
        trainable=batch.flat_trainable(),
        group_codes=batch.group_codes,
        segments=seg,
        attention=att,
        gdn=gdn,
        ranks=rk,
        stats=stats,
        overflow=batch.overflow,
    )
    return PlanResult(plan=plan, batch=batch, tree=tree)


def _plan_by_cost(
    batch: SequenceBatch,
    options: PlanOptions,
    cost_model: CostModel,
    *,
    t0: float | None,
    check: Callable[[], None] | None,
    repair_ms: float | None,
    max_cp_tiles: int | None,
) -> PlanResult:
    """:func:`plan_with_tree` with a cost model: the candidates by time, or one plan and its prediction.

    Every plan is made by :func:`plan_with_tree` without a cost model, so this recursion is
    one level deep by construction.

    Args:
        batch, options, t0, check, repair_ms, max_cp_tiles: as for :func:`plan_with_tree`.
        cost_model: the cost model.

    Returns:
        The plan (``stats.predicted_ms`` set) and its tree.
    """
    if options.placement == "auto":
        # Each candidate through the module's own entry point (so whatever wraps it sees every plan).
        budget = repair_budget_ms(cost_model, options) if repair_ms is None else repair_ms
        return choose_by_time(
            batch,
            options,
            cost_model,
            lambda b, o: plan_with_tree(b, o, t0=t0, check=check, repair_ms=budget, max_cp_tiles=max_cp_tiles),
        )
    res = plan_with_tree(batch, options, t0=t0, check=check, max_cp_tiles=max_cp_tiles)
    return PlanResult(plan=with_prediction(res.plan, cost_model), batch=res.batch, tree=res.tree)


def _plan_stats(
    batch: SequenceBatch,
    tree: Tree,
    seg: Segments,
    placed: Placement,
    bound: int,
    seq_len: int,
    times: tuple[float, float, float, float, float, float],
    repair_ms: float | None,
) -> PlanStats:
    """The plan's stats: token counts of the batch, tree and rows, and the phases' timings.

    Args:
        batch, tree, seg, placed: the batch, its tree, the rows' segments and the placement.
        bound: the lower bound on rows.
        seq_len: the row capacity.
        times: ``perf_counter`` at the request's start and after normalize, tree,
            placement, layout and metadata.
        repair_ms: the repair budget given instead of the option's, or None.

    Returns:
        The :class:`PlanStats`.
    """
    t0, t1, t2, t3, t4, t5 = times
    num_rows = placed.num_rows
    unpacked = int(batch.lens.sum())
    packed = int(seg.row_len.sum())
    return PlanStats(
        sequences=batch.num_sequences,
        kept_sequences=int(batch.kept.sum()),
        unpacked_tokens=unpacked,
        tree_tokens=tree.num_tokens,
        packed_tokens=packed,
        rows=num_rows,
        lower_bound_rows=bound,
        padding_tokens=num_rows * seq_len - packed,
        saved_fraction=(1.0 - packed / unpacked) if unpacked else 0.0,
        timings_ms={
            "normalize": (t1 - t0) * 1e3,
            "tree": (t2 - t1) * 1e3,
            "placement": (t3 - t2) * 1e3,
            "repair": placed.timings_ms.get("repair", 0.0),
            "layout": (t4 - t3) * 1e3,
            "metadata": (t5 - t4) * 1e3,
            "total": (t5 - t0) * 1e3,
        }
        | ({} if repair_ms is None else {"repair_budget": float(repair_ms)}),
    )
