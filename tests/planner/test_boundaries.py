"""Boundary cases, each at its limit and one step past it: a shared run of exactly
``min_shared_len`` (shared) and one token shorter (not), a row filled to exactly ``seq_len``
(one row) and one token over (two), leaves of exactly half a row (two fit a row; the big-leaf
bound counts them as small) and one token over. Fast builder, reference builder, every
placement and the lower bound, each against a count worked out by hand here.
"""

from __future__ import annotations

import numpy as np
import pytest

from treepack.proto.batch import normalize_batch
from treepack.proto.errors import CapacityError
from treepack.service.planner import (
    PLACEMENTS,
    build_tree,
    lower_bound_rows,
    naive_build_tree,
    plan_batch,
    validate_plan,
)

MSL = 8


def _seqs(*parts_list):
    """Sequences from (token, count) runs, e.g. ((1, 8), (2, 3))."""
    return [np.concatenate([np.full(n, t, np.uint32) for t, n in parts]) for parts in parts_list]


def _shared_lengths(tree) -> list[int]:
    return sorted(int(n) for n in tree.length[tree.sharers >= 2])


@pytest.mark.parametrize("builder", [build_tree, naive_build_tree], ids=["fast", "naive"])
def test_a_run_of_exactly_min_shared_len_is_shared_and_one_shorter_is_not(builder):
    # Two pairs: one agrees on MSL tokens, the other on MSL - 1, then each diverges. Runs of
    # one token repeated cannot be confused with a longer common run: the next token differs.
    seqs = _seqs(((1, MSL), (2, 5)), ((1, MSL), (3, 5)), ((4, MSL - 1), (5, 5)), ((4, MSL - 1), (6, 5)))
    batch = normalize_batch(seqs, seq_len=64)
    tree = builder(batch, MSL)
    assert _shared_lengths(tree) == [MSL]
    # Rule 2 at its boundary: trainable from MSL + 1 on makes position MSL scored, so the
    # shareable prefix is exactly MSL; trainable from MSL leaves MSL - 1: nothing shared.
    same = _seqs(((1, MSL + 1), (2, 4)), ((1, MSL + 1), (3, 4)))
    for first, want in ((MSL + 1, [MSL]), (MSL, [])):
        tree = builder(normalize_batch(same, seq_len=64, trainable=[first, first]), MSL)
        assert _shared_lengths(tree) == want, (first, _shared_lengths(tree))


def test_the_plans_hold_the_min_shared_len_boundary():
    seqs = _seqs(((1, MSL), (2, 5)), ((1, MSL), (3, 5)), ((4, MSL - 1), (5, 5)), ((4, MSL - 1), (6, 5)))
    plan = plan_batch(seqs, seq_len=64, min_shared_len=MSL)
    validate_plan(plan, seqs)
    assert plan.stats.tree_tokens == sum(map(len, seqs)) - MSL  # only the MSL run saved, once


@pytest.mark.parametrize("placement", PLACEMENTS)
def test_a_row_filled_to_exactly_seq_len(placement):
    C = 32
    # A 12-token shared prefix and two tails: 12 + 10 + 10 = C tokens in one row.
    exact = _seqs(((1, 12), (2, 10)), ((1, 12), (3, 10)))
    plan = plan_batch(exact, seq_len=C, min_shared_len=MSL, placement=placement)
    validate_plan(plan, exact)
    want_rows = 2 if placement == "no_share" else 1  # no_share: 22 + 22 > 32
    assert plan.num_rows == want_rows and int(plan.row_len.max()) == (22 if placement == "no_share" else C)
    over = _seqs(((1, 12), (2, 10)), ((1, 12), (3, 11)))
    plan = plan_batch(over, seq_len=C, min_shared_len=MSL, placement=placement)
    validate_plan(plan, over)
    assert plan.num_rows == 2
    one = _seqs(((7, C),))
    plan = plan_batch(one, seq_len=C, placement=placement)
    validate_plan(plan, one)
    assert plan.num_rows == 1 and int(plan.row_len[0]) == C
    with pytest.raises(CapacityError):
        plan_batch(_seqs(((7, C + 1),)), seq_len=C, placement=placement)


@pytest.mark.parametrize("placement", PLACEMENTS)
def test_leaves_of_exactly_half_a_row(placement):
    C = 32
    for n, leaves, want in ((C // 2, 2, 1), (C // 2, 3, 2), (C // 2 + 1, 2, 2), (C // 2 + 1, 3, 3)):
        seqs = _seqs(*(((10 + i, n),) for i in range(leaves)))
        batch = normalize_batch(seqs, seq_len=C)
        assert lower_bound_rows(build_tree(batch, MSL), C) == want, (n, leaves)
        plan = plan_batch(seqs, seq_len=C, min_shared_len=MSL, placement=placement)
        validate_plan(plan, seqs)
        assert plan.num_rows == want and plan.stats.lower_bound_rows == want, (placement, n, leaves, plan.num_rows)
