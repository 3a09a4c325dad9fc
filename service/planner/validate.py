"""The plan's invariants in one entry point: :func:`validate_plan`.

``validate_plan(plan)`` checks what a plan alone can prove; given the sequences it also
checks them against the tokens. The checks sit by concept, each raising
:class:`~.invariant.PlanInvariantError`:

- :mod:`~.validate_rows`: rows tile ``[0, row_len)`` contiguously in pre-order within
  ``seq_len``; the tree in each row (parents, depths, ``subtree_end``); the mask (the
  interval form equals the ancestor relation, segment by segment, and token by token via
  :func:`~.validate_rows.naive_tree_mask` when ``dense_check_max`` allows); no data loss
  (each kept sequence a root-to-leaf chain of its row covering ``0 .. len-1`` exactly
  once, sharer counts, dropped sequences with no segments);
- :mod:`~.validate_metadata`: attention chains, GDN levels (each segment once, at its depth,
  ``cu_seqlens``, parent slots, conv context equal to :func:`~.metadata.naive_conv_context`),
  and what the plan carries about its batch (``first_trainable``, flags, group codes);
- :mod:`~.validate_ranks`: ranks (each row once), the CP split, stats;
- :mod:`~.validate_tokens`, with sequences: every token at ``idx(s, p)`` is ``s[p]`` (keys
  too), a shared segment is at least ``min_shared_len`` long (or, with
  ``min_shared_saving``, saves enough) and holds no trainable token and no scored position
  of any sharer (generalized mode: no scored position its sharers predict differently);
  the per-token gather views read every sequence back.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from treepack.proto.batch import SequenceBatch, normalize_batch
from treepack.proto.plan import Plan
from treepack.service.planner.validate_metadata import check_attention, check_gdn, check_planned_with
from treepack.service.planner.validate_ranks import check_ranks_and_stats
from treepack.service.planner.validate_rows import check_row_trees, check_rows, check_sequences
from treepack.service.planner.validate_tokens import check_gather, check_tokens

__all__ = ["validate_plan"]


def validate_plan(
    plan: Plan,
    sequences: Sequence[Any] | SequenceBatch | None = None,
    *,
    trainable: Sequence[Any] | None = None,
    keys: Sequence[Any] | None = None,
    dense_check_max: int = 2048,
    gather_check_max: int = 1 << 24,
) -> None:
    """Check every plan invariant (module docstring); raise :class:`~.invariant.PlanInvariantError`.

    Args:
        plan: the plan.
        sequences: optionally the planned sequences (or their :class:`SequenceBatch`) for the
            token-level checks; ``trainable`` and ``keys`` as given to the planner
            (``trainable`` defaults to the flags the plan carries).
        dense_check_max: rows up to this many tokens also get the token-level mask check.
        gather_check_max: with sequences, plans of up to this many row slots (R * C) are
            also materialized through ``token_source``/``token_index`` and read back (the
            segment-level checks above already cover every token; this checks the
            per-token views the trainer uses, within a bounded memory).
    """
    check_rows(plan)
    check_row_trees(plan, dense_check_max)
    check_sequences(plan)
    check_attention(plan)
    check_gdn(plan)
    check_ranks_and_stats(plan)
    check_planned_with(plan)
    if sequences is None:
        return
    batch = _as_batch(plan, sequences, trainable, keys)
    check_tokens(plan, batch)
    if plan.num_rows * plan.seq_len <= gather_check_max:
        check_gather(plan, batch)


def _as_batch(plan: Plan, sequences: Any, trainable: Any, keys: Any) -> SequenceBatch:
    if isinstance(sequences, SequenceBatch):
        return sequences
    if trainable is None:
        trainable = _planned_trainable(plan, sequences)
    return normalize_batch(sequences, seq_len=plan.seq_len, trainable=trainable, keys=keys, on_overflow="truncate")


def _planned_trainable(plan: Plan, sequences: Any) -> list[Any]:
    """The flags the plan says it was planned with, at the submitted lengths (a truncated
    or dropped tail is not trainable)."""
    out: list[Any] = []
    for s in range(min(len(sequences), plan.num_sequences)):
        n = len(sequences[s])
        if plan.trainable is None:
            out.append(min(int(plan.first_trainable[s]), n) if plan.seq_lens[s] else n)
        else:
            flags = np.zeros(n, dtype=bool)
            flags[: int(plan.seq_lens[s])] = plan.trainable_of(s)
            out.append(flags)
    return out
