"""What-if planning: row distributions for candidate batch compositions, from recorded shapes.

An autotuner asks "if the next batch held 48 groups (or 20 of task A and 28 of task B),
how many rows would it need at seq_len C?". :func:`whatif` answers by sampling: each trial
draws groups without replacement from a pool of recorded batch shapes, turns them back
into a batch and plans it with :func:`~.api.plan_with_tree`, the very code ``/v1/pack`` runs.

Why synthesize tokens instead of building a :class:`~.tree.Tree` from the hashes directly:
the planner's input is a :class:`~treepack.proto.batch.SequenceBatch` of token arrays; feeding it token runs
made from the hashes (:func:`~treepack.proto.shape.run_tokens`) exercises the whole real path
(validation, tree builder with rule 4 and the shareable-length rule, placement, layout,
metadata) with no second tree builder to keep in step. The made-up runs rebuild exactly
the recorded tree (same nodes and sharers), so a trial that samples a whole recorded batch
gets exactly the recorded plan's rows; the cost is generating the tokens (about 10 numpy
passes over them), small next to planning.

Sampling rules (the pool's own: :mod:`~.whatif_pool`):

- The unit is a group of one recorded batch (a sequence without a group is a group of
  its own); a group's task tag is its first sequence's tag (``""`` when untagged).
- A trial's batch lists the drawn groups' sequences in recorded order (batch by batch,
  sequence index inside), so group order effects on placement stay realistic.
- Groups of different recorded batches stay different groups, even with equal labels.
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from treepack.proto.batch import PackInput
from treepack.proto.cost import CostModel, CostWarning
from treepack.proto.errors import CapacityError, PayloadTooLargeError, RequestError
from treepack.proto.index import csr_gather, csr_index
from treepack.proto.options import PlanOptions, as_options
from treepack.proto.shape import BatchShape, run_tokens
from treepack.proto.strategy import Strategy
from treepack.proto.whatif import (
    Composition,
    CompositionLike,
    Distribution,
    WhatIfResult,
    as_composition,
    suggest_trials,
)
from treepack.service.planner.api import plan_with_tree
from treepack.service.planner.options import check_options
from treepack.service.planner.whatif_pool import GroupPool, build_pool

_TAIL_BASE = np.uint64(0x7A11_5EED_0000_0000)

__all__ = ["GroupPool", "build_pool", "sample_groups", "synthesize", "whatif"]


def _check_composition(pool: GroupPool, comp: Composition, path: str) -> None:
    if comp.groups is not None:
        if comp.groups > pool.num_groups:
            raise RequestError(
                f"composition asks for {comp.groups} groups, the pool holds {pool.num_groups}",
                path=f"{path}.groups",
                rule="pool_size",
            )
        return
    for tag, k in (comp.by_tag or {}).items():
        have = pool.by_tag.get(tag, np.zeros(0)).shape[0]
        if k > have:
            raise RequestError(
                f"composition asks for {k} groups tagged {tag!r}, the pool holds {have}",
                path=f"{path}.by_tag[{json.dumps(tag)}]",
                rule="pool_size",
            )


def sample_groups(pool: GroupPool, comp: Composition, rng: np.random.Generator) -> np.ndarray:
    """[k] int64 group ids drawn without replacement, in recorded order."""
    if comp.groups is not None:
        picked = rng.choice(pool.num_groups, size=comp.groups, replace=False)
    else:
        parts = [rng.choice(pool.by_tag[t], size=k, replace=False) for t, k in sorted((comp.by_tag or {}).items()) if k]
        picked = np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)
    return np.sort(picked.astype(np.int64))


def synthesize(pool: GroupPool, units: np.ndarray) -> dict[str, Any]:
    """The batch of the given groups as ``plan_batch`` arguments (no ``seq_len``).

    Returns:
        ``dict(sequences=[S] uint32 views into one buffer, trainable=[S] prompt lengths,
        groups=[S] group ids)``, sequences in recorded order.
    """
    seqs = _unit_seqs(pool, units)
    owner = np.repeat(units, pool.unit_ptr[units + 1] - pool.unit_ptr[units])
    order = np.argsort(seqs, kind="stable")
    seqs, owner = seqs[order], owner[order]
    batch_of = np.searchsorted(pool.seq_base, seqs, side="right") - 1
    hashes, lengths, first = [], [], []
    for b in np.unique(batch_of).tolist():
        sh = pool.shapes[b]
        local = seqs[batch_of == b] - pool.seq_base[b]
        runs = csr_index(sh.seq_ptr, local)
        hashes.append(sh.run_hash[runs])
        lengths.append(sh.run_len[runs])
        first.append(sh.first_trainable[local])
    run_ids = np.concatenate(hashes)
    tails = run_ids == 0
    # Unshareable tails get ids of their own (never 0, never each other's), so their
    # made-up tokens match nothing.
    run_ids[tails] = _TAIL_BASE + np.arange(int(tails.sum()), dtype=np.uint64)
    tokens = run_tokens(run_ids, np.concatenate(lengths))
    lens = pool.lens[seqs]
    off = np.zeros(lens.shape[0] + 1, dtype=np.int64)
    np.cumsum(lens, out=off[1:])
    sequences = [tokens[a:b] for a, b in zip(off[:-1].tolist(), off[1:].tolist())]
    return dict(sequences=sequences, trainable=np.concatenate(first).tolist(), groups=owner.tolist())


def whatif(
    shapes: Sequence[BatchShape] | GroupPool,
    compositions: Sequence[CompositionLike],
    options: PlanOptions | None = None,
    *,
    trials: int = 32,
    seed: int = 0,
    max_rows: int | None = None,
    max_tokens: int | None = None,
    check: Callable[[], None] | None = None,
    cost_model: CostModel | None = None,
    max_cp_tiles: int | None = None,
    max_step_ms: float | None = None,
    **option_kwargs: Any,
) -> list[WhatIfResult]:
    """Row distributions of candidate compositions (module docstring).

    Args:
        shapes: the recorded batches to sample groups from, or their
            :class:`~.whatif_pool.GroupPool` (built once by a caller that priced it).
        compositions: the candidates: each a :class:`~treepack.proto.whatif.Composition`,
            a group count or a dict (:func:`~treepack.proto.whatif.as_composition`).
        options: as for :func:`~.api.plan_batch` (or its fields as keywords), applied to
            every trial, checked once. Shapes
            do not record trainable tokens (their runs are unique per sequence), so the
            generalized mode shares no trainable token in a trial: its rows are an upper
            bound.
        trials: trials per composition (>= 1).
        seed: the sampling seed; equal seeds give equal answers.
        max_rows: report the fraction of trials needing more rows than this.
        max_tokens: refuse trials with more tokens than this (the service's limit).
        check: called before every trial and between its planning phases; it raises to
            stop the work (the sidecar's deadline and cancellation), or None.
        cost_model: a :class:`~treepack.proto.cost.CostModel`: every trial is planned with
            it (as ``/v1/pack`` would: ``auto`` picks tree or plain packing by time) and the
            results carry ``step_ms``, the predicted step time over the trials. The repair
            pass keeps the asked ``repair_ms`` (not the larger budget the model gives a row
            in ``/v1/pack``): a what-if plans many trials, and its work stays what was asked.
        max_cp_tiles: refuse (413) a trial whose all-gather CP split holds more tiles than
            this (:func:`~.ranks.check_cp_tiles`); None: no limit.
        max_step_ms: with ``cost_model``, report the fraction of trials predicted slower
            than this (``p_step_over``).

    Returns:
        One :class:`WhatIfResult` per composition, in order.

    Raises:
        RequestError: an empty pool, a composition the pool cannot fill, sequences longer
            than ``seq_len`` with ``on_overflow="error"``, ``max_step_ms`` without a cost
            model, or any planner argument error.
    """
    opts = check_options(as_options(options, option_kwargs))
    seq_len = opts.seq_len
    pool = shapes if isinstance(shapes, GroupPool) else build_pool(shapes, check=check)
    if not pool.num_groups:
        raise RequestError(
            "there are no recorded batches to sample from: pack with record=true first, or send shapes",
            path="$.shapes",
            rule="no_history",
        )
    if trials < 1:
        raise RequestError(f"trials must be >= 1, got {trials}", path="$.trials", rule="range")
    if max_step_ms is not None and cost_model is None:
        raise RequestError(
            "max_step_ms asks about predicted step times, which need a cost model "
            "(the sidecar's cost_model_path setting, or Packer(cost_model=...))",
            path="$.max_step_ms",
            rule="needs_cost_model",
        )
    comps = [as_composition(c, i) for i, c in enumerate(compositions)]
    longest = int(pool.lens[pool.unit_seqs].max(initial=0))
    if opts.on_overflow == "error" and longest > seq_len:
        raise CapacityError(
            f"the pool holds sequences of up to {longest} tokens, longer than seq_len {seq_len} "
            "(set on_overflow='truncate' or 'drop' to allow)",
            path="$.seq_len",
            rule="max_len",
        )
    for i, comp in enumerate(comps):
        _check_composition(pool, comp, f"$.compositions[{i}]")
    rng = np.random.default_rng(seed)
    limits = _Limits(max_rows=max_rows, max_step_ms=max_step_ms, max_tokens=max_tokens)
    return [
        _trials(
            pool, comp, opts, f"$.compositions[{i}]", rng, trials, limits, check, cost_model, max_cp_tiles=max_cp_tiles
        )
        for i, comp in enumerate(comps)
    ]


@dataclass(frozen=True, slots=True, kw_only=True)
class _Limits:
    """The thresholds asked about (``max_rows``, ``max_step_ms``) and the trial size limit (``max_tokens``)."""

    max_rows: int | None
    max_step_ms: float | None
    max_tokens: int | None


def _trials(
    pool: GroupPool,
    comp: Composition,
    opts: PlanOptions,
    path: str,
    rng: np.random.Generator,
    trials: int,
    limits: _Limits,
    check: Callable[[], None] | None = None,
    cost_model: CostModel | None = None,
    *,
    max_cp_tiles: int | None = None,
) -> WhatIfResult:
    """Plan ``trials`` sampled batches of one composition and summarize them."""
    max_tokens = limits.max_tokens
    strategies: list[Strategy] = []
    rows = np.zeros(trials, dtype=np.int64)
    step_ms = np.zeros(trials, dtype=np.float64)
    packed = np.zeros(trials, dtype=np.int64)
    unpacked = np.zeros(trials, dtype=np.int64)
    saved = np.zeros(trials, dtype=np.float64)
    for t in range(trials):
        if check is not None:
            check()
        units = sample_groups(pool, comp, rng)
        if max_tokens is not None:
            total = int(pool.lens[_unit_seqs(pool, units)].sum())
            if total > max_tokens:
                raise PayloadTooLargeError(
                    f"a trial batch holds {total} tokens, over the limit of {max_tokens}", path=path, rule="max_tokens"
                )
        trial = PackInput(**synthesize(pool, units), options=opts)
        with warnings.catch_warnings():
            # A trial's plan is never run: whether its tree pays is in step_ms, not a warning.
            warnings.simplefilter("ignore", CostWarning)
            plan = plan_with_tree(
                trial.normalize(opts.seq_len, opts.on_overflow),
                opts,
                check=check,
                cost_model=cost_model,
                repair_ms=float(opts.repair_ms),
                max_cp_tiles=max_cp_tiles,
            ).plan
        st = plan.stats
        rows[t], packed[t], unpacked[t], saved[t] = st.rows, st.packed_tokens, st.unpacked_tokens, st.saved_fraction
        step_ms[t] = 0.0 if st.predicted_ms is None else st.predicted_ms
        strategies.append(plan.packing)
    timed = None if cost_model is None else Distribution.of(step_ms)
    rows_dist = Distribution.of(rows)
    max_rows, max_step_ms = limits.max_rows, limits.max_step_ms
    return WhatIfResult(
        name=comp.name,
        groups=comp.total_groups,
        by_tag=None if comp.by_tag is None else dict(comp.by_tag),
        trials=trials,
        rows=rows_dist,
        packed_tokens=Distribution.of(packed),
        unpacked_tokens=Distribution.of(unpacked),
        saved_fraction=Distribution.of(saved),
        max_rows=max_rows,
        p_rows_over=None if max_rows is None else float(np.mean(rows > max_rows)),
        row_counts=rows,
        step_ms=timed,
        strategies=tuple(strategies),
        trial_step_ms=None if cost_model is None else step_ms,
        max_step_ms=max_step_ms,
        p_step_over=None if max_step_ms is None or timed is None else float(np.mean(step_ms > max_step_ms)),
        suggested_trials=suggest_trials(rows_dist if timed is None else timed),
    )


def _unit_seqs(pool: GroupPool, units: np.ndarray) -> np.ndarray:
    return csr_gather(pool.unit_ptr, pool.unit_seqs, units)
