"""Very wide and very deep trees through the planner, at Python's default recursion limit.

The house rule is no recursion whose depth grows with the input: these inputs would break
one. A wide tree: 100,000 single-token leaves under one shared root. A deep tree: a chain of
nested prefixes (sequence i is the first ``DEPTH - i`` tokens of one sequence, every token
shared, ``min_shared_len=1``), so the tree is ``DEPTH`` levels deep. A tree ``d`` levels
deep has sequences of at least ``d * (d + 1) / 2`` tokens and about as many path entries
(each level needs a sequence of its own branching off there), so ``DEPTH`` is the depth
that stays within seconds, not 100,000: a few times the recursion limit, which the
negative control shows a recursive walk of the same tree hitting. Both go through both
tree builders, the plan (placement, the DFS row layout with its ``subtree_end`` and depths,
metadata) and :func:`validate_plan` with the sequences.
"""

from __future__ import annotations

import sys

import numpy as np
import pytest

from treepack.proto.batch import normalize_batch
from treepack.service.planner import build_tree, naive_build_tree, plan_batch, validate_plan

WIDTH = 100_000
DEPTH = 2_500
PREFIX = 4  # the wide tree's shared root, and its min_shared_len
WIDE_SEQ_LEN = 2048
TREE_FIELDS = ("parent", "start", "length", "source", "sharers", "depth", "leaf_of", "path_ptr", "path_nodes")


def _wide_sequences() -> list[np.ndarray]:
    prefix = np.arange(1, PREFIX + 1, dtype=np.uint32)
    return [np.append(prefix, np.uint32(1000 + i)) for i in range(WIDTH)]


def _deep_sequences() -> list[np.ndarray]:
    # Views of one array: the batch is DEPTH^2 / 2 tokens, held once.
    base = np.arange(1, DEPTH + 1, dtype=np.uint32)
    return [base[: DEPTH - i] for i in range(DEPTH)]


def _recursive_preorder(children: list[list[int]], v: int, out: list[int]) -> None:
    """The textbook recursive DFS (the form the rule forbids), for the negative control."""
    out.append(v)
    for c in children[v]:
        _recursive_preorder(children, c, out)


def _children(parent: np.ndarray) -> list[list[int]]:
    kids: list[list[int]] = [[] for _ in range(parent.shape[0] + 1)]  # the last: a virtual root
    for v, p in enumerate(parent.tolist()):
        kids[p].append(v)  # -1 is the virtual root; nodes come in pre-order, so children in order
    return kids


def _assert_same_trees(fast, ref) -> None:
    for f in TREE_FIELDS:
        assert np.array_equal(getattr(fast, f), getattr(ref, f)), f


@pytest.fixture(scope="module")
def wide():
    seqs = _wide_sequences()
    return seqs, normalize_batch(seqs, seq_len=WIDE_SEQ_LEN)


@pytest.fixture(scope="module")
def deep():
    seqs = _deep_sequences()
    return seqs, normalize_batch(seqs, seq_len=DEPTH)


def test_the_default_recursion_limit_is_in_force():
    """The deep tree is deeper than the limit by a wide margin (no test raised it)."""
    assert sys.getrecursionlimit() <= 1000 and DEPTH >= 2 * sys.getrecursionlimit()


def test_wide_tree_builders_agree(wide):
    _, batch = wide
    tree = build_tree(batch, PREFIX)
    root_kids = np.flatnonzero(tree.parent == 0)
    assert tree.num_nodes == WIDTH + 1 and int(tree.depth.max()) == 1 and root_kids.shape[0] == WIDTH
    assert int(tree.sharers[0]) == WIDTH and bool(np.all(tree.length[root_kids] == 1))
    _assert_same_trees(tree, naive_build_tree(batch, PREFIX))


def test_wide_tree_plans_and_validates(wide):
    seqs, batch = wide
    plan = plan_batch(seqs, seq_len=WIDE_SEQ_LEN, min_shared_len=PREFIX)
    seg = plan.segments
    per_row = WIDE_SEQ_LEN - PREFIX
    assert plan.num_rows == -(-WIDTH // per_row) and int(seg.depth.max()) == 1
    assert int((seg.depth == 0).sum()) == plan.num_rows  # the root copied once per row
    validate_plan(plan, seqs)


def test_deep_tree_builders_agree(deep):
    _, batch = deep
    tree = build_tree(batch, 1)
    # One shared node per level, each with the empty leaf of the sequence ending there.
    assert int(tree.depth.max()) == DEPTH - 1 and tree.num_nodes == 2 * DEPTH - 1
    # Path entries: a sequence of length L < DEPTH goes through L shared nodes and its leaf.
    assert int(tree.path_ptr[-1]) == DEPTH * (DEPTH - 1) // 2 + 2 * DEPTH - 1
    _assert_same_trees(tree, naive_build_tree(batch, 1))


def test_deep_tree_plans_and_validates(deep):
    seqs, _ = deep
    plan = plan_batch(seqs, seq_len=DEPTH, min_shared_len=1)
    seg = plan.segments
    assert plan.num_rows == 1 and seg.num_segments == DEPTH and int(seg.depth.max()) == DEPTH - 1
    # A chain laid out in DFS order: every subtree runs to the end of the row.
    assert bool(np.all(seg.subtree_end == DEPTH)) and np.array_equal(seg.row_start, np.arange(DEPTH))
    validate_plan(plan, seqs)


def test_negative_control_recursion_fails_on_the_deep_tree(deep):
    """The deep input does catch recursion: a recursive pre-order walk of its tree runs out
    of stack at the default limit, while the same walk numbers a small tree in the builder's
    pre-order (so the walk itself is right)."""
    _, batch = deep
    tree = build_tree(batch, 1)
    with pytest.raises(RecursionError):
        _recursive_preorder(_children(tree.parent), tree.num_nodes, [])
    small = build_tree(normalize_batch(_deep_sequences()[-50:], seq_len=DEPTH), 1)
    order: list[int] = []
    _recursive_preorder(_children(small.parent), small.num_nodes, order)
    assert order[1:] == list(range(small.num_nodes)) and int(small.depth.max()) == 49
