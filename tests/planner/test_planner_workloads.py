"""The planner on the documented realistic workloads (scaled down to stay fast)."""

from __future__ import annotations

import numpy as np
import pytest

from treepack.proto.batch import normalize_batch
from treepack.service.cli import workloads as W
from treepack.service.planner import build_tree, naive_place, place_leaves, plan_batch, validate_plan

from helpers.trees import plan_result

SMALL = {
    "curriculum": lambda: W.curriculum(48, seq_len=32768),
    "agentic": lambda: W.agentic(12, seq_len=32768),
    "distillation": lambda: W.distillation(24, seq_len=32768),
}


@pytest.fixture(scope="module", params=sorted(SMALL))
def workload(request):
    return SMALL[request.param]()


@pytest.mark.parametrize("placement", ["auto", "bfd", "in_order", "no_share"])
def test_plans_valid(workload, placement):
    plan = plan_batch(**workload.plan_kwargs(), placement=placement, num_ranks=4)
    validate_plan(plan, workload.sequences, trainable=workload.trainable, dense_check_max=0)
    assert plan.num_rows >= plan.stats.lower_bound_rows
    if placement != "no_share":
        assert plan.stats.packed_tokens < plan.stats.unpacked_tokens


def test_fast_bfd_equals_naive(workload):
    batch = normalize_batch(
        workload.sequences, seq_len=workload.seq_len, trainable=workload.trainable, groups=workload.groups
    )
    tree = build_tree(batch, 64)
    for name in ("bfd", "in_order", "no_share"):
        assert np.array_equal(
            place_leaves(tree, batch, workload.seq_len, name).row_of, naive_place(tree, batch, workload.seq_len, name)
        )


def test_auto_never_more_rows_than_bfd(workload):
    auto = plan_batch(**workload.plan_kwargs())
    bfd = plan_batch(**workload.plan_kwargs(), placement="bfd")
    assert auto.num_rows <= bfd.num_rows


def test_generators_are_deterministic_and_sized():
    a, b = W.curriculum(12, seed=3), W.curriculum(12, seed=3)
    assert all(np.array_equal(x, y) for x, y in zip(a.sequences, b.sequences))
    assert 8 * 12 <= len(a.sequences) <= 9 * 12
    g = W.golden_example()
    assert len(g.sequences) == 32 and g.num_tokens == 699_072


def test_distillation_header_is_not_shared():
    """The 24-token header is shorter than min_shared_len: rule 4 keeps it unshared."""
    w = W.distillation(6, seq_len=32768)
    result = plan_result(**w.plan_kwargs())
    tree = result.tree
    roots = np.flatnonzero(tree.parent < 0)
    assert len(roots) == 6  # one tree per source, none for the header
    assert bool(np.all(tree.length[roots] >= 64))
