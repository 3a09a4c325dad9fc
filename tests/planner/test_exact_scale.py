"""The exact search and the repair pass at the sizes trainers send (issue 37).

Hundreds of short leaves fit one row of 8,192 tokens, and the repair pass hands the search
the leaves of several rows at once: the recursive search overflowed Python's stack there
(``RecursionError`` at 256 GRPO groups of 4). These tests plan that shape, run the search
itself at 100,000 leaves, hold its time bounds, and keep recursion out of the planner.
"""

from __future__ import annotations

import ast
import time
from pathlib import Path

import numpy as np
import pytest

from treepack.proto.batch import normalize_batch
from treepack.service.planner import build_tree, exact_search, lower_bound_rows, plan_batch, repair, validate_plan
from treepack.service.planner.auto import unit_place
from treepack.service.planner.exact import FIT, NO_FIT, UNKNOWN, RowFit, fit_rows
from treepack.service.planner.exact_order import leaf_orders, min_copies
from treepack.service.planner.items import Item, leaf_items
from treepack.service.planner.repair import repair_rows
from treepack.service.planner.rows import row_costs

from helpers.hard_instances import hard_instance
from helpers.shapes import grpo_groups

PLANNER = Path(__file__).resolve().parents[2] / "service" / "planner"


@pytest.mark.parametrize("groups", [256, 512])
def test_short_grpo_groups_in_long_rows_plan(groups, monkeypatch):
    # 4 x 80 tokens per group, nothing shared (63 shareable prompt tokens < min_shared_len):
    # 102 leaves fill a row, so ceil(4 groups / 102) rows, which the count bound proves (the
    # tokens alone say one fewer). The repair pass, run on a bound that does not see the
    # count, hands the search whole rows of leaves.
    kw = grpo_groups(groups)
    plan = plan_batch(**kw, placement="auto")
    validate_plan(plan, kw["sequences"], trainable=kw["trainable"])
    assert plan.num_rows == -(-4 * groups // 102) == plan.stats.lower_bound_rows
    assert plan.stats.timings_ms["repair"] == 0  # proven optimal: no repair pass
    handed = []

    class Spy(RowFit):
        __slots__ = ()

        def __init__(self, items, *args) -> None:
            handed.append(len(items))
            super().__init__(items, *args)

    monkeypatch.setattr(repair, "RowFit", Spy)
    batch = normalize_batch(kw["sequences"], seq_len=8192, trainable=kw["trainable"], groups=kw["groups"])
    tree = build_tree(batch)
    volume = -(-tree.num_tokens // 8192)
    assert volume == plan.num_rows - 1
    # A budget the searches never reach, so a loaded machine cannot skip the deep ones.
    res = repair_rows(tree, plan.row_of, plan.num_rows, 8192, volume, budget_ms=60_000.0)
    assert res.num_rows == plan.num_rows and not res.out_of_time
    assert max(handed) >= 1000, max(handed)  # not vacuous: deeper than Python's default stack


def _flat_items(n: int, seed: int = 0) -> tuple[list[Item], list[int], int]:
    """n leaves of 1-3 own tokens below one 100-token prompt (node 0)."""
    tails = np.random.default_rng(seed).integers(1, 4, n).tolist()
    return [Item(s, (0,), 100 + t, t) for s, t in enumerate(tails)], [100], sum(tails)


def _loads(items: list[Item], assign: dict[int, int], node_len: list[int], m: int) -> list[int]:
    """Each row's tokens, from scratch: its leaves' own segments and its chain nodes once."""
    tails, held = [0] * m, [set() for _ in range(m)]
    for it in items:
        tails[assign[it.seq]] += it.tail
        held[assign[it.seq]].update(it.chain)
    return [tails[r] + sum(node_len[v] for v in held[r]) for r in range(m)]


def test_search_at_100k_leaves():
    items, node_len, tails = _flat_items(100_000)
    m = 25
    C = 100 + -(-tails // m) + 3
    status, assign = fit_rows(items, m, C, node_len, node_limit=200_000)
    assert status == FIT and sorted(assign) == list(range(len(items)))
    assert max(_loads(items, assign, node_len, m)) <= C
    # Refuted by volume at the root, and "unknown" (not a wrong "no") past the node limit.
    assert fit_rows(items, m, (100 + tails) // m - 1, node_len, node_limit=200_000)[0] == NO_FIT
    assert fit_rows(items, m, C, node_len, node_limit=99_999)[0] == UNKNOWN


def test_search_stops_at_its_deadline():
    # 60 items of 20-44 tokens in 20 rows of 100 (at most 4 a row): the search cannot
    # settle it in 20,000 nodes (tens of ms here), so only the deadline stops it.
    sizes = np.random.default_rng(0).integers(20, 45, 60).tolist()
    items = [Item(s, (), n, n) for s, n in enumerate(sizes)]
    m = -(-sum(sizes) // 100)
    assert fit_rows(items, m, 100, [], node_limit=20_000)[0] == UNKNOWN  # hard: not settled early
    for budget in (0.005, 0.02):
        t0 = time.thread_time()
        status, _ = fit_rows(items, m, 100, [], node_limit=10**9, deadline=t0 + budget)
        spent = time.thread_time() - t0
        assert status == UNKNOWN and budget <= spent < budget + 0.05, spent


def test_a_search_goes_on_where_its_node_limit_stopped_it():
    # A search stopped at 500 nodes and run on to 4,000 answers as one run to 4,000, with
    # the same rows, visiting no node twice (the repair pass's quick levels cost nothing
    # when a thorough level has to search the same group).
    kw = hard_instance("deep", 11, 1)  # 23 leaves of agent trees: 9 rows, found after ~1,200 nodes
    batch = normalize_batch(kw["sequences"], seq_len=kw["seq_len"], trainable=kw["trainable"], groups=kw["groups"])
    tree = build_tree(batch, kw["min_shared_len"])
    items, node_len, C = leaf_items(tree, np.flatnonzero(tree.leaf_of >= 0)), tree.length.tolist(), kw["seq_len"]
    whole, steps = RowFit(items, 9, C, node_len), RowFit(items, 9, C, node_len)
    assert steps.run(500) == UNKNOWN and steps.nodes == 500  # negative control: 500 nodes are too few
    assert whole.run(4_000) == steps.run(4_000) == FIT
    assert steps.nodes == whole.nodes < 4_000 and steps.assign == whole.assign
    assert sorted(steps.assign) == sorted(it.seq for it in items)
    assert max(_loads(items, steps.assign, node_len, 9)) <= C


def test_rows_too_full_for_any_leaf_left_lose_their_room():
    # 40 items of 26-44 tokens (at most 3 a row) in 14 rows of 100: the volume leaves
    # room, but a row holding three of them has less room than the smallest leaf left,
    # and that room counts as lost: refuted at once (the search without the rule cannot
    # settle it in 300,000 nodes).
    sizes = np.random.default_rng(0).integers(26, 45, 40).tolist()
    items = [Item(s, (), n, n) for s, n in enumerate(sizes)]
    m = -(-sum(sizes) // 100)
    assert sum(sizes) <= m * 100 and len(items) <= 3 * m  # neither the volume nor the count refutes it
    fit = RowFit(items, m, 100, [])
    assert fit.run(20_000) == NO_FIT and not fit._searches  # settled: no search state kept
    # Negative control: the same search without the rule does not settle it in 20,000 nodes.
    blind = exact_search._Search(leaf_orders(items)[0], m, 100, [], min_copies(items, 100, []))
    blind.min_tail = [0] * (len(items) + 1)
    blind.min_cost = [0] * (len(items) + 1)
    with pytest.raises(exact_search._Limit):
        blind.run(20_000, None)


def test_repair_at_100k_leaves_keeps_its_budget():
    # 25,000 groups of 4: 100,000 leaves in 981 rows, which the count bound proves; given only
    # the volume bound (977), the repair pass runs to its budget: it sets up lazily and keeps
    # to its CPU budget within one search node or one row's index. (Planning and validating
    # this batch whole takes ~15 s here, mostly the validator's per-sequence walk; the 256-
    # and 512-group plans above are validated.)
    kw = grpo_groups(25_000)
    batch = normalize_batch(kw["sequences"], seq_len=8192, trainable=kw["trainable"], groups=kw["groups"])
    tree = build_tree(batch)
    bound = -(-tree.num_tokens // 8192)
    greedy = unit_place(tree, batch, 8192, split=False)
    assert greedy.num_rows == -(-100_000 // 102) == lower_bound_rows(tree, 8192) == bound + 4
    for budget_ms in (10.0, 50.0):
        t0 = time.thread_time()
        res = repair_rows(tree, greedy.row_of, greedy.num_rows, 8192, bound, budget_ms=budget_ms)
        spent = (time.thread_time() - t0) * 1e3
        assert res.out_of_time and spent < budget_ms + 40, spent
        assert (res.row_of >= 0).all() and (row_costs(tree, res.row_of, res.num_rows) <= 8192).all()


def recursive_functions(source: str, name: str) -> set[str]:
    """Functions of one module that can reach themselves through calls inside the module.

    Calls are matched by name (``f(...)`` for a function, ``self.f(...)`` for a method), so a
    cycle through several functions (``a -> b -> a``) counts as well as a direct self-call.

    Returns:
        ``{"<name>:<function>"}`` for every function on a cycle.
    """
    tree = ast.parse(source)
    calls: dict[str, set[str]] = {}
    for fn in ast.walk(tree):
        if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            out = calls.setdefault(fn.name, set())
            for call in ast.walk(fn):
                f = call.func if isinstance(call, ast.Call) else None
                if isinstance(f, ast.Name):
                    out.add(f.id)
                elif isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) and f.value.id == "self":
                    out.add(f.attr)
    found = set()
    for start in calls:
        seen, stack = set(), [start]
        while stack:  # can start reach itself?
            for callee in calls.get(stack.pop(), ()):
                if callee == start:
                    found.add(f"{name}:{start}")
                elif callee in calls and callee not in seen:
                    seen.add(callee)
                    stack.append(callee)
    return found


# Recursion bounded by construction: plan_with_tree plans by cost through _plan_by_cost,
# which calls plan_with_tree again without the cost model (depth 2 at most).
BOUNDED = {"api.py:plan_with_tree", "api.py:_plan_by_cost"}


def test_no_recursion_in_the_planner():
    found = set().union(*(recursive_functions(p.read_text(), p.name) for p in sorted(PLANNER.glob("*.py"))))
    assert found <= BOUNDED, sorted(found - BOUNDED)
    # Not vacuous: the scan sees the known bounded cycle, a direct self-call and a method's.
    assert BOUNDED <= found
    toy = (
        "def f(n):\n    return f(n - 1)\nclass C:\n    def g(self):\n        return self.g()\ndef h():\n    return 1\n"
    )
    assert recursive_functions(toy, "toy.py") == {"toy.py:f", "toy.py:g"}
