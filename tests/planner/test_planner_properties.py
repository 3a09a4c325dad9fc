"""Hypothesis properties of the planner over random batches with heavy prefix sharing.

Every plan passes validate_plan (every token placed once and read back, rows within
capacity, interval mask == ancestor relation token by token); the fast tree and fast
placements equal their naive references; auto never needs more rows than bfd; the lower
bound never exceeds the optimum (brute force on tiny batches). Each test counts the
structures its examples exercised and fails if they were vacuous.
"""

from __future__ import annotations

from collections import Counter
from itertools import combinations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from treepack.proto.batch import normalize_batch
from treepack.service.planner import (
    PLACEMENTS,
    build_tree,
    lower_bound_rows,
    naive_build_tree,
    naive_place,
    place_leaves,
    plan_batch,
    validate_plan,
)
from treepack.service.planner.rows import row_costs

TREE_FIELDS = ("parent", "start", "length", "source", "sharers", "depth", "leaf_of", "path_ptr", "path_nodes")


@st.composite
def batches(draw, max_seqs: int = 12, overflow: bool = False):
    vocab = draw(st.integers(2, 4))
    pieces = [draw(st.lists(st.integers(0, vocab - 1), max_size=24)) for _ in range(draw(st.integers(1, 4)))]
    seqs: list[list[int]] = []
    for _ in range(draw(st.integers(1, max_seqs))):
        if seqs and draw(st.integers(0, 2)):
            # Extend a prefix of an earlier sequence: nested sharing, deep trees.
            base = seqs[draw(st.integers(0, len(seqs) - 1))]
            seq = base[: draw(st.integers(0, len(base)))]
        else:
            seq = []
            for _ in range(draw(st.integers(0, 3))):
                seq += pieces[draw(st.integers(0, len(pieces) - 1))]
        seq += draw(st.lists(st.integers(0, vocab - 1), max_size=10))
        seqs.append(seq or [0])
    n = len(seqs)
    mode = draw(st.sampled_from(["none", "prompt", "mask"]))
    if mode == "none":
        trainable = None
    elif mode == "prompt":
        # Mostly completions at the end (deep shared prompts), sometimes anywhere (trainable
        # runs inside shared prefixes, which the generalized mode shares).
        trainable = [
            max(0, len(s) - draw(st.integers(0, 6))) if draw(st.booleans()) else draw(st.integers(0, len(s)))
            for s in seqs
        ]
    else:
        trainable = [np.array(draw(st.lists(st.booleans(), min_size=len(s), max_size=len(s)))) for s in seqs]
    groups = draw(
        st.one_of(
            st.none(), st.lists(st.one_of(st.none(), st.integers(0, 3), st.sampled_from("xyz")), min_size=n, max_size=n)
        )
    )
    keys = None
    if draw(st.integers(0, 4)) == 0:
        keys = [
            None if draw(st.booleans()) else np.array([draw(st.integers(0, 1)) for _ in s], dtype=np.uint64)
            for s in seqs
        ]
    longest = max(len(s) for s in seqs)
    if overflow:
        seq_len = draw(st.integers(1, longest))
    else:
        seq_len = draw(st.integers(longest, 3 * longest))
    return dict(
        sequences=[np.array(s, dtype=np.int64) for s in seqs],
        trainable=trainable,
        groups=groups,
        keys=keys,
        seq_len=seq_len,
        min_shared_len=draw(st.integers(1, 6)),
        share_trainable=draw(st.booleans()),
    )


def _record(seen: Counter, plan) -> None:
    seg = plan.segments
    seen["plans"] += 1
    seen["shared"] += bool((seg.sharers >= 2).any())
    seen["deep"] += bool((seg.depth >= 2).any())
    seen["trees_per_row>1"] += bool(np.any(np.bincount(seg.row[seg.parent < 0], minlength=plan.num_rows) > 1))
    seen["padding"] += bool(plan.stats.padding_tokens > 0)
    seen["rows>1"] += plan.num_rows > 1


def test_every_plan_is_valid():
    seen: Counter = Counter()

    @settings(max_examples=120, deadline=None)
    @given(b=batches(), placement=st.sampled_from(PLACEMENTS), num_ranks=st.integers(1, 3), width=st.integers(1, 5))
    def check(b, placement, num_ranks, width):
        plan = plan_batch(**b, placement=placement, num_ranks=num_ranks, conv_width=width)
        validate_plan(plan, b["sequences"], trainable=b["trainable"], keys=b["keys"])
        _record(seen, plan)

    check()
    for what in ("shared", "deep", "trees_per_row>1", "padding", "rows>1"):
        assert seen[what] >= 5, f"vacuous: only {seen[what]} of {seen['plans']} plans had {what}"


def test_overflow_truncate_and_drop_keep_every_kept_token():
    seen: Counter = Counter()

    @settings(max_examples=60, deadline=None)
    @given(
        b=batches(overflow=True), action=st.sampled_from(["truncate", "drop"]), placement=st.sampled_from(PLACEMENTS)
    )
    def check(b, action, placement):
        plan = plan_batch(**b, placement=placement, on_overflow=action)
        validate_plan(plan, b["sequences"], trainable=b["trainable"], keys=b["keys"])
        over = [i for i, s in enumerate(b["sequences"]) if len(s) > b["seq_len"]]
        assert [e.index for e in plan.overflow] == over
        for e in plan.overflow:
            assert e.action == action and e.length == len(b["sequences"][e.index])
            if action == "drop":
                assert plan.row_of[e.index] == -1 and plan.seq_lens[e.index] == 0
            else:
                assert plan.seq_lens[e.index] == b["seq_len"]
        seen["overflowed"] += bool(over)

    check()
    assert seen["overflowed"] >= 10


def test_fast_tree_equals_naive():
    seen: Counter = Counter()

    @settings(max_examples=200, deadline=None)
    @given(b=batches(max_seqs=16))
    def check(b):
        batch = normalize_batch(
            b["sequences"], seq_len=b["seq_len"], trainable=b["trainable"], groups=b["groups"], keys=b["keys"]
        )
        fast = build_tree(batch, b["min_shared_len"], share_trainable=b["share_trainable"])
        ref = naive_build_tree(batch, b["min_shared_len"], share_trainable=b["share_trainable"])
        for f in TREE_FIELDS:
            assert np.array_equal(getattr(fast, f), getattr(ref, f)), f
        seen["internal"] += bool((fast.sharers >= 2).any())
        seen["depth>=2"] += bool((fast.depth >= 2).any())
        sh = (batch.lens if b["share_trainable"] else batch.shareable_lens()).tolist()
        seen["repeated prefix"] += any(  # the builder's shortcut for a prefix equal to the last one
            sh[i] == sh[i + 1] >= b["min_shared_len"]
            and np.array_equal(batch.tokens[i][: sh[i]], batch.tokens[i + 1][: sh[i]])
            for i in range(batch.num_sequences - 1)
        )
        if b["share_trainable"]:
            shared = np.flatnonzero(fast.sharers >= 2)
            seen["shared trainable"] += any(
                batch.trainable_of(int(fast.source[v]))[fast.start[v] : fast.end[v]].any() for v in shared
            )

    check()
    assert seen["internal"] >= 20 and seen["depth>=2"] >= 5 and seen["shared trainable"] >= 5
    assert seen["repeated prefix"] >= 5, seen


def test_a_repeated_prefix_takes_the_last_path_and_only_then():
    """Each way an insertion can end (at an existing node, in a new leaf, at a split, below
    a split), followed by the same prefix again (the builder's shortcut) or by one of the
    same length differing in its last token or in its first (the negative controls, which
    must walk the trie), with and without keys: the tree equals the reference's."""
    base = list(range(100, 140))
    shapes = [
        [base[:20], base[:20], base[:20]],  # new leaf, then twice its prefix (a node's terminals)
        [base, base[:30] + [7] * 10, base[:30] + [7] * 10],  # a split with a new tail below it
        [base, base[:25], base[:25], base],  # a split ending at the middle node
        [base[:30], base[:30] + [5], base[:30] + [5]],  # ending below an existing node
        [base[:20], base[:19] + [1], base[:19] + [1], [1] + base[1:20]],  # same length, other tokens
    ]
    for seqs in shapes:
        for keys in (None, [np.arange(len(x) + 2, dtype=np.uint64) % 2 for x in seqs]):
            batch = normalize_batch(
                [np.array(x + [9, 9], dtype=np.uint32) for x in seqs],
                seq_len=64,
                trainable=[len(x) + 1 for x in seqs],
                keys=keys,
            )
            fast, ref = build_tree(batch, 4), naive_build_tree(batch, 4)
            for f in TREE_FIELDS:
                assert np.array_equal(getattr(fast, f), getattr(ref, f)), (seqs, f)
    # Not vacuous: equal prefixes share one node; one differing in its last token does not.
    batch = normalize_batch(
        [np.array(x + [9, 9], dtype=np.uint32) for x in shapes[4][:3]], seq_len=64, trainable=[21] * 3
    )
    tree = build_tree(batch, 4)
    assert tree.sharers.max() == 3 and int(tree.length[tree.sharers == 3][0]) == 19


def test_fast_placements_equal_naive_and_auto_beats_bfd():
    seen: Counter = Counter()

    @settings(max_examples=150, deadline=None)
    @given(b=batches(max_seqs=20))
    def check(b):
        batch = normalize_batch(
            b["sequences"], seq_len=b["seq_len"], trainable=b["trainable"], groups=b["groups"], keys=b["keys"]
        )
        tree = build_tree(batch, b["min_shared_len"], share_trainable=b["share_trainable"])
        for name in ("bfd", "in_order", "no_share"):
            fast = place_leaves(tree, batch, b["seq_len"], name).row_of
            assert np.array_equal(fast, naive_place(tree, batch, b["seq_len"], name)), name
        bfd = place_leaves(tree, batch, b["seq_len"], "bfd")
        auto = place_leaves(tree, batch, b["seq_len"], "auto")
        bound = lower_bound_rows(tree, b["seq_len"])
        assert bound <= auto.num_rows <= bfd.num_rows
        # auto <= bfd only says something where bfd left room above the bound.
        seen["bfd above bound"] += bfd.num_rows > bound
        seen["auto<bfd"] += auto.num_rows < bfd.num_rows
        seen["bfd rows>2"] += bfd.num_rows > 2

    check()
    assert seen["bfd rows>2"] >= 10
    assert seen["auto<bfd"] >= 1, f"auto never beat bfd in {seen['bfd above bound']} examples where it had room"
    assert seen["bfd above bound"] >= 5, (
        f"vacuous: bfd met the lower bound in all but {seen['bfd above bound']} examples"
    )


def _optimal_rows(tree, n_leaves: list[int], seq_len: int) -> int:
    """Brute force: the fewest rows over all set partitions of the leaves."""
    best = len(n_leaves)

    def fits(group):
        row_of = np.full(tree.leaf_of.shape[0], -1, dtype=np.int64)
        row_of[list(group)] = 0
        return int(row_costs(tree, row_of, 1)[0]) <= seq_len

    def rec(rest, rows):
        nonlocal best
        if rows >= best:
            return
        if not rest:
            best = rows
            return
        first, others = rest[0], rest[1:]
        for k in range(len(others), -1, -1):
            for comb in combinations(others, k):
                group = (first,) + comb
                if fits(group):
                    rec([x for x in others if x not in comb], rows + 1)

    rec(n_leaves, 0)
    return best


def test_lower_bound_never_exceeds_optimum():
    seen: Counter = Counter()

    @settings(max_examples=80, deadline=None)
    @given(b=batches(max_seqs=6))
    def check(b):
        batch = normalize_batch(b["sequences"], seq_len=b["seq_len"], trainable=b["trainable"], keys=b["keys"])
        tree = build_tree(batch, b["min_shared_len"], share_trainable=b["share_trainable"])
        opt = _optimal_rows(tree, list(range(len(b["sequences"]))), b["seq_len"])
        bound = lower_bound_rows(tree, b["seq_len"])
        auto = place_leaves(tree, batch, b["seq_len"], "auto").num_rows
        assert bound <= opt <= auto
        seen["opt>1"] += opt > 1
        seen["tight"] += bound == opt
        seen["examples"] += 1

    check()
    assert seen["opt>1"] >= 10
    # Tightness is measured, so it is asserted: a weaker bound (even 0) falls below this floor
    # (73 of 80 replayed examples are tight; Hypothesis draws are not pinned across versions).
    assert seen["tight"] >= 0.85 * seen["examples"], seen


def test_sorted_row_indexes_equal_naive(monkeypatch):
    """With SMALL = 0 every node keeps a sorted index: the bisect paths face the naive scan."""
    import treepack.service.planner.rows as rows_mod

    monkeypatch.setattr(rows_mod, "SMALL", 0)
    seen: Counter = Counter()

    @settings(max_examples=120, deadline=None)
    @given(b=batches(max_seqs=24))
    def check(b):
        batch = normalize_batch(
            b["sequences"], seq_len=b["seq_len"], trainable=b["trainable"], groups=b["groups"], keys=b["keys"]
        )
        tree = build_tree(batch, b["min_shared_len"], share_trainable=b["share_trainable"])
        fast = place_leaves(tree, batch, b["seq_len"], "bfd")
        assert np.array_equal(fast.row_of, naive_place(tree, batch, b["seq_len"], "bfd"))
        seen["rows>2"] += fast.num_rows > 2

    check()
    assert seen["rows>2"] >= 10
