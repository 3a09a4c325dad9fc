"""The ``auto`` placement: the best of several sharing-aware packings, never worse than ``bfd``.

Candidates, tried in this order, cheapest first; the first one that reaches the proven
lower bound (:func:`~.bounds.lower_bound_rows`) wins at once since nothing can beat it:

1. ``grouped`` — best-fit decreasing over *units*: the maximal subtrees that fit one row
   with their root path (``start(v) + S(v) <= C``). A GRPO group, its prompt and all its
   completions travel as one item, so a shared prompt is not split across rows unless it
   must be; a unit's marginal cost in a row is its cost minus the part of its root path
   the row already holds, exactly as for leaves. Units are visited tree by tree (trees by
   total size, largest first; units largest first inside a tree), so rows fill with units
   of one system prompt and its copies stay few.
2. the **repair pass** (:mod:`.repair`) on the best so far when it is above the bound: an
   exact re-packing of neighbourhoods of light rows (widening from 12 to 48 rows), within
   ``repair_ms``.
3. ``grouped+split`` — as ``grouped``, but a unit that fits no open row is split into its
   child units (which then fill the gaps of open rows) before a new row is opened.
4. ``bfd`` — the reference leaf-level best fit (SPEC section 4; :mod:`.baselines`).

If a later candidate wins and is still above the bound, the repair pass runs on it with
what is left of the budget. (A global order, units largest first across all trees, never
beat the grouped order on the benchmark workloads, so it is not a candidate.)

**Skipping what cannot win.** A candidate is abandoned as soon as it provably cannot use
fewer rows than the best so far: its open rows, or ``ceil((T + dup) / C)`` where T is the
tree's tokens and ``dup`` the copies of internal nodes it has made so far (its final rows
hold every tree token at least once plus at least those copies), reach the best's rows.
Scores are kept incrementally: a candidate's packed tokens are ``C * rows - sum(room)``.
Every candidate is one run of :func:`~.rows.best_fit_decreasing` (over units, or over
leaves for ``bfd``), which does this bookkeeping, and returns a :class:`~.rows.Candidate`.

The winner has the fewest rows, then (among candidates that ran to the end) the fewest
packed tokens, then the earliest; since ``bfd`` is a candidate whenever no earlier one
reaches the bound, and is only abandoned once it cannot use fewer rows, ``auto`` never
uses more rows than ``bfd``.

Time: units are far fewer than leaves (about one per group); each best-fit query costs
O(depth log R) (:mod:`.rows`), so the whole is near-linear in the number of leaves; the
repair pass is bounded by its budget.
"""

from __future__ import annotations

import time

import numpy as np

from treepack.proto.batch import SequenceBatch
from treepack.proto.options import REPAIR_MS
from treepack.service.planner.baselines import bfd_candidate
from treepack.service.planner.bounds import lower_bound_rows, subtree_sizes
from treepack.service.planner.items import Chains
from treepack.service.planner.repair import repair_rows
from treepack.service.planner.rows import Candidate, best_fit_decreasing, row_costs
from treepack.service.planner.tree import Tree

__all__ = ["auto_place", "unit_place"]


def unit_place(
    tree: Tree,
    batch: SequenceBatch,
    seq_len: int,
    *,
    split: bool,
    stop_rows: int | None = None,
    chains: Chains | None = None,
) -> Candidate | None:
    """Best-fit decreasing over units (see module docstring).

    Args:
        tree: the batch's tree.
        batch: the batch.
        seq_len: row capacity C.
        split: split a unit that fits no open row into its child units first.
        stop_rows: give up (return None) once the result cannot have fewer rows than this.
        chains: the tree's :class:`~.items.Chains`, shared between candidates.

    Returns:
        The :class:`~.rows.Candidate`, or None (given up; or ``split`` where every unit is
        a leaf, so that splitting would change nothing: the unsplit run is the same).
    """
    size = subtree_sizes(tree)
    cost = tree.start + size
    parent = tree.parent
    fits = cost <= seq_len
    pfits = np.where(parent >= 0, fits[np.maximum(parent, 0)], False)
    units = np.flatnonzero(fits & ~pfits)
    kids = None
    if split and not (tree.sharers[units] > 1).any():
        return None  # every unit is a leaf: nothing to split, the run would be the unsplit one's
    if split:
        # Children of each node, largest cost first (CSR over a stable sort by parent).
        child = np.flatnonzero(parent >= 0)
        child = child[np.lexsort((-cost[child], parent[child]))]
        kids = (np.searchsorted(parent[child], np.arange(tree.num_nodes + 1)).tolist(), child.tolist())
    root = tree.path_nodes[tree.path_ptr[tree.source]]  # [N] root of each node's tree
    order = units[np.lexsort((-cost[units], root[units], -size[root[units]]))].tolist()
    return best_fit_decreasing(tree, order, cost, seq_len, kids=kids, stop_rows=stop_rows, chains=chains)


def auto_place(
    tree: Tree, batch: SequenceBatch, seq_len: int, *, bound: int | None = None, repair_ms: float = REPAIR_MS
) -> tuple[np.ndarray, str, dict[str, float]]:
    """Run the candidates of the module docstring.

    Args:
        tree, batch, seq_len: as for :func:`~.placement.place_leaves`.
        bound: the tree's :func:`~.bounds.lower_bound_rows`, if already known.
        repair_ms: the repair pass's budget, CPU ms of this thread (0: no repair).

    Returns:
        (row_of, winning strategy, sub-phase timings in ms: ``repair``).
    """
    if bound is None:
        bound = lower_bound_rows(tree, seq_len)
    spent = cpu = 0.0  # the repair pass's wall time (reported) and CPU time (budgeted), ms
    chains = Chains(tree)
    candidates = (
        ("grouped", lambda stop: unit_place(tree, batch, seq_len, split=False, stop_rows=stop, chains=chains)),
        ("grouped+split", lambda stop: unit_place(tree, batch, seq_len, split=True, stop_rows=stop, chains=chains)),
        ("bfd", lambda stop: bfd_candidate(tree, batch, seq_len, stop_rows=stop, chains=chains)),
    )
    best: Candidate | None = None
    winner = ""
    for name, run in candidates:
        got = run(None if best is None else best.num_rows)
        if got is None:
            continue
        if best is None or got.score < best.score:
            best, winner = got, name
        if best.num_rows > bound and winner == name and repair_ms > 0:
            t, c = time.perf_counter(), time.thread_time()
            budget = repair_ms - cpu
            if budget > 0:
                res = repair_rows(
                    tree, best.row_of, best.num_rows, seq_len, bound, budget_ms=budget, loads=best.loads, chains=chains
                )
                if res.removed:
                    loads = row_costs(tree, res.row_of, res.num_rows)
                    best = Candidate(
                        row_of=res.row_of, num_rows=res.num_rows, packed_tokens=int(loads.sum()), loads=loads
                    )
                    winner = name + "+repair"
            spent += (time.perf_counter() - t) * 1e3
            cpu += (time.thread_time() - c) * 1e3
        if best.num_rows <= bound:
            break
    assert best is not None
    return best.row_of, winner, {"repair": spent}
