"""SPEC section 4's golden example, reproduced exactly."""

from __future__ import annotations

import numpy as np
import pytest

from treepack.service.planner import PLACEMENTS, lower_bound_rows, plan_batch, validate_plan

from helpers.trees import plan_result


def _groups_in_rows(plan, groups):
    out = []
    for r in range(plan.num_rows):
        members = np.flatnonzero(plan.row_of == r)
        labels = [groups[s] for s in members]
        out.append({g: labels.count(g) for g in sorted(set(labels))})
    return out


def test_tree_size(golden):
    result = plan_result(**golden.plan_kwargs(), placement="bfd")
    plan, tree = result.plan, result.tree
    assert plan.stats.tree_tokens == 236_124
    assert plan.stats.unpacked_tokens == 699_072
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
    result = plan_result(**golden.plan_kwargs())
    plan = result.plan
    validate_plan(plan, golden.sequences, trainable=golden.trainable)
    assert plan.stats.lower_bound_rows == lower_bound_rows(result.tree, golden.seq_len) == 2
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


def test_generalized_mode_shares_the_common_start_of_completions():
    """share_trainable: trainable tokens are shared up to the last position before a scored divergence."""
    prompt = list(range(1000, 1100))  # 100 non-trainable tokens
    a = np.array(prompt + [7, 8, 9, 11, 12])
    b = np.array(prompt + [7, 8, 10, 13])
    default_r = plan_result([a, b], seq_len=512, trainable=[100, 100])
    general_r = plan_result([a, b], seq_len=512, trainable=[100, 100], share_trainable=True)
    default, general = default_r.plan, general_r.plan
    for plan in (default, general):
        validate_plan(plan, [a, b], trainable=[100, 100])
    # Default: the join token (position 99) and everything after it is per sequence.
    assert default_r.tree.length[0] == 99 and default_r.tree.sharers[0] == 2
    # Generalized: [7] (trainable, predicted from the shared position 99) is shared too;
    # position 101 (token 8) predicts 9 vs 10, so it opens each leaf.
    assert general_r.tree.length[0] == 101 and general_r.tree.sharers[0] == 2
    assert general_r.tree.length[general_r.tree.leaf_of].tolist() == [4, 3]
    ptr, who = general.segment_sharers()
    assert who[ptr[0] : ptr[1]].tolist() == [0, 1]


def test_scaled_golden_keeps_the_shape():
    from treepack.service.cli.workloads import golden_example

    w = golden_example(scale=64)
    plan = plan_batch(**w.plan_kwargs(), placement="bfd", min_shared_len=1)
    validate_plan(plan, w.sequences, trainable=w.trainable)
    assert w.seq_len == 2048 and len(w.sequences) == 32
    # 64 system tokens, 4 group prefixes of 188 (187 shared + the join token in each leaf),
    # completions of 31 / 31 / 188 / 109 tokens.
    assert plan.stats.tree_tokens == 64 + 4 * 187 + 8 * ((1 + 31) + (1 + 31) + (1 + 188) + (1 + 109))
