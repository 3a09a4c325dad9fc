"""The exact search's own rules, each against a search without it (negative controls).

- the copies bound (``exact_order.min_copies``): equal to its one-node-at-a-time reference,
  never above the rows that hold a node in a found fit, reached there, and refuting at the
  root what the search without it has to search for;
- the pass with one discrepancy per branch, and the second leaf order (tree by tree, the
  trees by their largest leaf): each finds fits the plain depth-first search in one order
  needs far more nodes for;
- the closed rows: rows that no remaining leaf fits lose their room, prompts counted;
- the subtree neighbourhoods of the repair pass, and the 24-row wide groups among its quick
  levels: a row found there that the other neighbourhoods miss within the same node limits.

The suite-level checks (every answer against the subset DP, ``auto`` at the optimum) are in
``test_planner_exact.py``; the searches at scale in ``test_exact_scale.py``.
"""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

from treepack.proto.batch import normalize_batch
from treepack.service.cli import workloads
from treepack.service.planner import build_tree, exact, exact_search, lower_bound_rows, place_leaves, repair
from treepack.service.planner.exact import FIT, NO_FIT, UNKNOWN, RowFit, fit_rows
from treepack.service.planner.exact_order import leaf_orders, min_copies, naive_min_copies_items
from treepack.service.planner.items import Item, leaf_items
from treepack.service.planner.repair import repair_rows
from treepack.service.planner.rows import row_costs

from helpers.hard_instances import HARD_FAMILIES, hard_instance


def _tree(kw: dict):
    batch = normalize_batch(kw["sequences"], seq_len=kw["seq_len"], trainable=kw["trainable"], groups=kw["groups"])
    return batch, build_tree(batch, kw["min_shared_len"])


def _decisions(seeds: int = 6):
    """(items, m, C, node_len) of the row groups the repair pass asks about: the leaves of k
    consecutive rows of the greedy placement of hard instances, into k - 1 rows."""
    for family in HARD_FAMILIES:
        for seed in range(seeds):
            kw = hard_instance(family, seed, 1 if family != "grpo" else 0)
            batch, tree = _tree(kw)
            C = kw["seq_len"]
            placed = place_leaves(tree, batch, C, "auto", repair_ms=0)
            items = leaf_items(tree, np.flatnonzero(tree.leaf_of >= 0))
            node_len = tree.length.tolist()
            for k in (2, 3, 4):
                for first in range(0, placed.num_rows - k + 1, 2):
                    rows = set(range(first, first + k))
                    group = [it for it in items if int(placed.row_of[it.seq]) in rows]
                    yield group, k - 1, C, node_len


def _held_rows(items: list[Item], assign: dict[int, int]) -> Counter:
    """Rows holding each chain node in a placement."""
    held: dict[int, set[int]] = {}
    for it in items:
        for v in it.chain:
            held.setdefault(v, set()).add(assign[it.seq])
    return Counter({v: len(rows) for v, rows in held.items()})


def test_min_copies_equals_its_reference():
    seen: Counter = Counter()
    for items, _m, C, node_len in _decisions(seeds=3):
        got = min_copies(items, C, node_len)
        assert got == naive_min_copies_items(items, C, node_len)
        seen["nodes"] += len(got)
        seen["above one"] += sum(k > 1 for k in got.values())
    assert seen["nodes"] >= 300 and seen["above one"] >= 50, seen


def test_min_copies_is_sound_and_reached():
    # Every fit the search finds holds each chain node in at least K(v) rows; some hold it
    # in exactly K(v) > 1 rows, so K(v) + 1 would refute a placement that exists.
    seen: Counter = Counter()
    for items, m, C, node_len in _decisions():
        status, assign = fit_rows(items, m + 1, C, node_len, node_limit=5_000)
        if status != FIT:
            continue
        k = min_copies(items, C, node_len)
        held = _held_rows(items, assign)
        assert all(held[v] >= k[v] for v in k), (held, k)
        seen["fits"] += 1
        seen["reached above one"] += sum(held[v] == k[v] > 1 for v in k)
    assert seen["fits"] >= 100 and seen["reached above one"] >= 20, seen


def _shared_prompt(n: int, m: int) -> tuple[list[Item], list[int]]:
    """n leaves of 9-11 own tokens below one 60-token prompt (node 0), rows of 100: a row
    holds at most 4 of them, so the prompt needs ceil(10 n / 40) copies."""
    tails = np.random.default_rng(n).integers(9, 12, n).tolist()
    return [Item(s, (0,), 60 + t, t) for s, t in enumerate(tails)], [60]


def test_copies_bound_refutes_at_the_root():
    items, node_len = _shared_prompt(30, 7)
    m = 7  # 7 rows of 100 hold the prompt once and 300 own tokens by volume, but 4 leaves a row at most
    assert 60 + sum(it.tail for it in items) <= m * 100
    fit = RowFit(items, m, 100, node_len)
    assert fit.run(20_000) == NO_FIT and fit.nodes == 0
    # Negative control: the search counting each missing prompt once (K = 1) has to search.
    blind = exact_search._Search(leaf_orders(items)[0], m, 100, node_len, min_copies(items, 100, node_len))
    blind.copies = dict.fromkeys(blind.copies, 1)
    blind.missing = 60
    with pytest.raises(exact_search._Limit):
        blind.run(20_000, None)


def _whole(kw: dict) -> tuple[list[Item], int, int, list[int]]:
    """Every leaf of a batch, into one row fewer than its greedy placement."""
    batch, tree = _tree(kw)
    C = kw["seq_len"]
    rows = place_leaves(tree, batch, C, "auto", repair_ms=0).num_rows
    return leaf_items(tree, np.flatnonzero(tree.leaf_of >= 0)), rows - 1, C, tree.length.tolist()


def _quick_repair(kw: dict, levels: tuple):
    """(greedy placement, bound, repair pass over it under ``levels`` with an unreachable budget)
    of a batch: the repair tests' common set-up."""
    batch, tree = _tree(kw)
    C = kw["seq_len"]
    greedy = place_leaves(tree, batch, C, "auto", repair_ms=0)
    bound = lower_bound_rows(tree, C)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(repair, "LEVELS", levels)
        res = repair_rows(tree, greedy.row_of, greedy.num_rows, C, bound, budget_ms=60_000.0)
    assert (row_costs(tree, res.row_of, res.num_rows) <= C).all()
    return greedy, bound, res


def _quick_levels() -> tuple:
    return tuple(lv for lv in repair.LEVELS if lv[2] <= repair.QUICK_LIMIT)


def test_one_discrepancy_pass_finds_fits_the_plain_search_misses(monkeypatch):
    # An agent tree (35 leaves, 16 rows greedy, 15 exist): one leaf off its preferred row
    # on one branch, and the fit is there; depth first alone, the early choices cost whole
    # subtrees first.
    items, m, C, node_len = _whole(hard_instance("deep", 5, 2))
    fit = RowFit(items, m, C, node_len)
    assert fit.run(2_000) == FIT and fit.nodes < 500, fit.nodes
    assert max(row_costs_from(items, fit.assign, node_len, m)) <= C
    monkeypatch.setattr(exact_search, "DISCREPANCIES", 10**9)  # negative control: the first pass is the whole search
    plain = RowFit(items, m, C, node_len)
    assert plain.run(2_000) == UNKNOWN


def row_costs_from(items: list[Item], assign: dict[int, int], node_len: list[int], m: int) -> list[int]:
    """Each row's tokens from scratch: its leaves' own segments and its chain nodes once."""
    tails, held = [0] * m, [set() for _ in range(m)]
    for it in items:
        tails[assign[it.seq]] += it.tail
        held[assign[it.seq]].update(it.chain)
    return [tails[r] + sum(node_len[v] for v in held[r]) for r in range(m)]


def test_tree_by_tree_order_finds_what_largest_first_misses(monkeypatch):
    # A distillation batch of 77 leaves behind 7 prompts, 24 rows greedy and 23 exist: tree
    # by tree, the trees in the order of their largest leaf, the first dive fits (77 nodes);
    # largest first interleaves the prompts, and the trees by their total size put a tree of
    # many small leaves before one with a leaf of most of a row: neither finds it in 20,000.
    w = workloads.distillation(7, seed=11, seq_len=16384)
    kw = dict(sequences=w.sequences, trainable=w.trainable, groups=w.groups, seq_len=w.seq_len, min_shared_len=64)
    items, m, C, node_len = _whole(kw)
    assert (len(items), m) == (77, 23)
    assert len(leaf_orders(items)) == 2
    fit = RowFit(items, m, C, node_len)
    assert fit.run(20_000) == FIT and fit.nodes < 300, fit.nodes
    assert max(row_costs_from(items, fit.assign, node_len, m)) <= C
    first = leaf_orders(items)[0]
    monkeypatch.setattr(exact, "leaf_orders", lambda its: [first])  # negative control: largest first only
    assert RowFit(items, m, C, node_len).run(20_000) == UNKNOWN
    total: dict[int, int] = {}
    for it in items:
        total[it.chain[0]] = total.get(it.chain[0], 0) + it.cost
    by_total = sorted(items, key=lambda it: (-total[it.chain[0]], it.chain[0], -it.cost, it.chain, it.seq))
    monkeypatch.setattr(exact, "leaf_orders", lambda its: [first, by_total])  # ... and trees by total size
    assert RowFit(items, m, C, node_len).run(20_000) == UNKNOWN


def test_rows_no_remaining_leaf_fits_are_closed(monkeypatch):
    # Leaves behind 5 prompts (15-39 tokens) with own segments of 8-39, rows of 100: by
    # volume and copies 8 rows could hold them, with 8 tokens to spare. A row holding some
    # prompts with room left for one more own segment of those but not for any other
    # prompt with its leaf can take nothing more: its room is lost, and the search refutes
    # the 8 rows in about a hundred nodes. Counting only the rows with less room than the
    # smallest own segment (the rule before prompts were looked at) it does not settle
    # in 20,000.
    rng = np.random.default_rng(377)
    prompts = rng.integers(15, 40, int(rng.integers(3, 6))).tolist()
    items: list[Item] = []
    for p, length in enumerate(prompts):
        for _ in range(int(rng.integers(2, 7))):
            t = int(rng.integers(8, 40))
            items.append(Item(len(items), (p,), length + t, t))
    copies = min_copies(items, 100, prompts)
    need = sum(it.tail for it in items) + sum(prompts[v] * k for v, k in copies.items())
    m = 8
    assert (len(items), len(prompts), need) == (25, 5, 792)  # the root's bound leaves room
    fit = RowFit(items, m, 100, prompts)
    assert fit.run(20_000) == NO_FIT and fit.nodes < 200, fit.nodes
    # Negative control: the rule before, every row with room for the smallest own segment open.
    set_up = exact_search._Search.__init__

    def before(self, *args):
        set_up(self, *args)
        self.min_cost = self.min_tail

    monkeypatch.setattr(exact_search._Search, "__init__", before)
    assert RowFit(items, m, 100, prompts).run(20_000) == UNKNOWN


def test_wide_groups_of_24_rows_in_the_quick_levels():
    # GRPO, 117 completions behind 13 prompts: 26 rows greedy, 25 exist (the bound). The 24-row
    # wide group of a light row fits in a few hundred nodes; the whole batch (the 48-row wide
    # group of a 26-row batch) does not within the quick levels' limits, and neither do the
    # 12-row or subtree groups.
    kw = hard_instance("grpo", 11, 0)
    greedy, bound, res = _quick_repair(kw, _quick_levels())
    assert (len(kw["sequences"]), greedy.num_rows, bound) == (117, 26, 25)
    assert res.num_rows == bound and not res.out_of_time
    narrow = tuple(lv for lv in _quick_levels() if lv[:2] != ("wide", 24))  # negative control
    assert _quick_repair(kw, narrow)[2].num_rows == greedy.num_rows


def test_subtree_neighbourhoods_find_a_row_the_others_miss():
    # Agent trees with deep chains (31 leaves, 15 rows greedy): re-pairing the branches below
    # one shared turn frees a row; the rows holding that turn fit one fewer at once, the
    # 12-row and wide neighbourhoods do not within the same node limits.
    kw = hard_instance("deep", 12, 2)
    greedy, _, res = _quick_repair(kw, _quick_levels())
    assert res.num_rows == greedy.num_rows - 1 == 14 and not res.out_of_time
    narrow = tuple(lv for lv in _quick_levels() if lv[0] != "subtree")  # negative control
    res = _quick_repair(kw, narrow)[2]
    assert res.num_rows == greedy.num_rows and not res.out_of_time
