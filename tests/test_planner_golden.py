"""SPEC section 4's golden example, reproduced exactly."""

from __future__ import annotations

import numpy as np
import pytest

from treepack.service.planner import PLACEMENTS, lower_bound_rows, plan_batch, validate_plan


def _groups_in_rows(plan, groups):
    out = []
    for r in range(plan.num_rows):
        members = np.flatnonzero(plan.row_of == r)
        labels = [groups[s] for s in members]
        out.append({g: labels.count(g) for g in sorted(set(labels))})
    return out


def test_tree_size(golden):
    plan = plan_batch(**golden.plan_kwargs(), placement="bfd")
    assert plan.stats.tree_tokens == 236_124
    assert plan.stats.unpacked_tokens == 699_072
    tree = plan.tree
    # One 4,096-token root shared by all 32, four 11,999-token group prefixes shared by 8.
    assert tree.length[0] == 4096 and tree.sharers[0] == 32 and tree.parent[0] == -1
    group_nodes = np.flatnonzero(tree.parent == 0)
    assert tree.length[group_nodes].tolist() == [11_999] * 4
    assert tree.sharers[group_nodes].tolist() == [8] * 4
    # Each leaf is the join token + the completion.
    leaf_len = tree.length[tree.leaf_of]
    assert leaf_len.tolist() == [2001] * 8 + [2001] * 8 + [12_001] * 8 + [7001] * 8


def test_bfd_two_rows(golden):
    plan = plan_batch(**golden.plan_kwargs(), placement="bfd")
    validate_plan(plan, golden.sequences, trainable=golden.trainable)
    assert plan.num_rows == 2
    assert plan.row_len.tolist() == [130_105, 122_114]
    assert _groups_in_rows(plan, golden.groups) == [{"A": 3, "C": 8}, {"A": 5, "B": 8, "D": 8}]


def test_in_order_three_rows(golden):
    plan = plan_batch(**golden.plan_kwargs(), placement="in_order")
    validate_plan(plan, golden.sequences, trainable=golden.trainable)
    assert plan.row_len.tolist() == [120_113, 125_105, 23_096]


def test_lower_bound_and_auto(golden):
    plan = plan_batch(**golden.plan_kwargs())
    validate_plan(plan, golden.sequences, trainable=golden.trainable)
    assert plan.stats.lower_bound_rows == lower_bound_rows(plan.tree, golden.seq_len) == 2
    assert plan.num_rows == 2
    assert plan.placement == "auto"


@pytest.mark.parametrize("placement", PLACEMENTS)
def test_every_placement_valid(golden, placement):
    plan = plan_batch(**golden.plan_kwargs(), placement=placement, num_ranks=2)
    validate_plan(plan, golden.sequences, trainable=golden.trainable)
    assert plan.ranks.rank_rows.shape[0] == 2


def test_no_share_is_plain_packing(golden):
    plan = plan_batch(**golden.plan_kwargs(), placement="no_share")
    assert plan.stats.packed_tokens == 699_072
    assert bool(np.all(plan.segments.sharers == 1))
    # First-fit decreasing on 32 items of 28,096 / 23,096 / 18,096 tokens.
    assert plan.num_rows == 6
