"""The repair pass: a bounded large-neighbourhood search that removes rows after the greedy.

Greedy packings lose rows the classic first-fit way: a late leaf finds no room and opens
a row that ends up light, though moving a few leaves between it and the rows that share
its prefix would have made room. :func:`repair_rows` looks for exactly that:

1. take the lightest rows first; for such a row r, form neighbourhoods of k = 2..MAX_ROWS
   rows: r plus the rows sharing most of its prefix (tokens of internal nodes both
   hold), and r plus the lightest other rows;
2. decide exactly whether the leaves of those k rows fit into k - 1 rows
   (:func:`~.exact.fit_rows`, a branch and bound with a node limit per neighbourhood);
3. if they do, rewrite those rows (r disappears) and start again from the lightest row;
   stop at the lower bound, when no neighbourhood of any light row helps, or when the
   time budget is spent.

Every step keeps a valid placement (all leaves placed, every row within C) and removes one
row, so the result never has more rows than its input. The search order depends on the
input only (rows by load then index, neighbours by shared tokens, load, index; the node
limit counts search nodes), so it is deterministic; the time budget is checked between
neighbourhoods, so a run that spends the whole budget may stop earlier on a slower machine.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from treepack.proto.index import ragged_arange
from treepack.service.planner.exact import FIT, Item, fit_rows, leaf_items_of
from treepack.service.planner.tree import Tree

__all__ = ["RepairResult", "repair_rows", "MAX_ROWS", "LIGHT_ROWS", "NODE_LIMIT"]

MAX_ROWS = 12  # largest neighbourhood: this many rows into one fewer
LIGHT_ROWS = 8  # light rows tried per round
NODE_LIMIT = 4_000  # branch-and-bound nodes per neighbourhood


@dataclass(frozen=True, slots=True, kw_only=True)
class RepairResult:
    """What :func:`repair_rows` did.

    Attributes:
        row_of: [S] int64 new row of each sequence (-1 for dropped), rows numbered 0..R-1
            in the order of their old numbers.
        num_rows: R.
        removed: rows removed.
        tried: neighbourhoods searched.
        out_of_time: the budget ran out before the search finished.
    """

    row_of: np.ndarray
    num_rows: int
    removed: int
    tried: int
    out_of_time: bool


class _Rows:
    """Rows as sets of sequences, with their loads and the internal nodes they hold."""

    def __init__(self, tree: Tree, row_of: np.ndarray, num_rows: int) -> None:
        self.tree = tree
        self.node_len = tree.length.tolist()
        kept = np.flatnonzero(row_of >= 0)
        by_row = kept[np.argsort(row_of[kept], kind="stable")]
        cuts = np.searchsorted(row_of[by_row], np.arange(num_rows + 1))
        self.members: list[list[int]] = [by_row[cuts[r] : cuts[r + 1]].tolist() for r in range(num_rows)]
        self.alive = set(range(num_rows))
        self.items: dict[int, Item] = {}
        # (row, internal node) pairs, vectorized: every path position but the leaf's.
        counts = tree.path_ptr[kept + 1] - tree.path_ptr[kept] - 1
        idx = np.repeat(tree.path_ptr[kept], counts) + ragged_arange(counts)
        pair = np.unique(np.repeat(row_of[kept], counts) * tree.num_nodes + tree.path_nodes[idx])
        prow, pnode = (pair // tree.num_nodes).tolist(), (pair % tree.num_nodes).tolist()
        self.held: list[set[int]] = [set() for _ in range(num_rows)]
        self.node_rows: dict[int, set[int]] = {}
        for r, v in zip(prow, pnode):
            self.held[r].add(v)
            self.node_rows.setdefault(v, set()).add(r)
        tails = tree.length[tree.leaf_of[kept]]
        self.tail = np.bincount(row_of[kept], weights=tails, minlength=num_rows).astype(np.int64).tolist()
        inner = np.bincount(pair // tree.num_nodes, weights=tree.length[pair % tree.num_nodes], minlength=num_rows)
        self.load = (np.asarray(self.tail) + inner.astype(np.int64)).tolist()

    def item(self, s: int) -> Item:
        it = self.items.get(s)
        if it is None:
            it = self.items[s] = leaf_items_of(self.tree, [s])[0]
        return it

    def _reindex(self, r: int) -> None:
        for v in self.held[r]:
            self.node_rows[v].discard(r)
        held: set[int] = set()
        tail = 0
        for s in self.members[r]:
            it = self.item(s)
            tail += it.tail
            held.update(it.chain)
        for v in held:
            self.node_rows.setdefault(v, set()).add(r)
        self.held[r] = held
        self.tail[r] = tail
        self.load[r] = tail + sum(self.node_len[v] for v in held)

    def neighbourhoods(self, r: int, max_rows: int, seq_len: int):
        """Row groups containing r, most promising first (module docstring).

        From each pool (rows by shared tokens, rows by load) rows join r until the group's
        tokens could fit one row fewer, then up to two more for slack.
        """
        shared: dict[int, int] = {}
        for v in self.held[r]:
            for x in self.node_rows[v]:
                if x != r:
                    shared[x] = shared.get(x, 0) + self.node_len[v]
        by_share = sorted(shared, key=lambda x: (-shared[x], self.load[x], x))
        by_room = sorted((x for x in self.alive if x != r), key=lambda x: (self.load[x], x))
        for pool in (by_share, by_room):
            group, nodes, tail, extra = [r], set(self.held[r]), self.tail[r], 0
            for x in pool[: max_rows - 1]:
                group.append(x)
                nodes |= self.held[x]
                tail += self.tail[x]
                if tail + sum(self.node_len[v] for v in nodes) <= (len(group) - 1) * seq_len:
                    yield sorted(group)
                    extra += 1
                    if extra == 3:
                        break

    def replace(self, group: list[int], drop: int, assign: dict[int, int]) -> None:
        keep = [x for x in group if x != drop]
        for x in group:
            self.members[x] = []
        for s, b in sorted(assign.items()):
            self.members[keep[b]].append(s)
        for x in group:
            self._reindex(x)
        self.alive.discard(drop)


def repair_rows(
    tree: Tree,
    row_of: np.ndarray,
    num_rows: int,
    seq_len: int,
    bound: int,
    *,
    budget_ms: float,
    max_rows: int = MAX_ROWS,
    node_limit: int = NODE_LIMIT,
) -> RepairResult:
    """Remove rows from a placement by exact re-packing of small neighbourhoods (module docstring).

    Args:
        tree: the batch's tree.
        row_of: [S] int64 a valid placement (-1 for dropped sequences).
        num_rows: its rows.
        seq_len: C.
        bound: a proven lower bound on the rows: the search stops there.
        budget_ms: wall-clock budget; 0 disables the pass.
        max_rows: largest neighbourhood.
        node_limit: branch-and-bound nodes per neighbourhood.

    Returns:
        The :class:`RepairResult` (``row_of`` is the input itself when nothing changed).
    """
    deadline = time.perf_counter() + budget_ms / 1e3
    if budget_ms <= 0 or num_rows <= bound:
        return RepairResult(row_of=row_of, num_rows=num_rows, removed=0, tried=0, out_of_time=False)
    rows = _Rows(tree, row_of, num_rows)
    failed: set[frozenset[int]] = set()
    tried = 0
    out_of_time = False
    while len(rows.alive) > bound and not out_of_time:
        improved = False
        light = sorted(rows.alive, key=lambda x: (rows.load[x], x))[:LIGHT_ROWS]
        for r in light:
            for group in rows.neighbourhoods(r, max_rows, seq_len):
                key = frozenset(group)
                if key in failed:
                    continue
                if time.perf_counter() > deadline:
                    out_of_time = True
                    break
                tried += 1
                items = [rows.item(s) for x in group for s in rows.members[x]]
                status, assign = fit_rows(items, len(group) - 1, seq_len, rows.node_len, node_limit=node_limit)
                if status != FIT:
                    failed.add(key)
                    continue
                rows.replace(group, r, assign)
                failed = {f for f in failed if not (f & key)}
                improved = True
                break
            if improved or out_of_time:
                break
        if not improved:
            break
    removed = num_rows - len(rows.alive)
    if removed == 0:
        return RepairResult(row_of=row_of, num_rows=num_rows, removed=0, tried=tried, out_of_time=out_of_time)
    new_id = {x: i for i, x in enumerate(sorted(rows.alive))}
    out = np.full(row_of.shape[0], -1, dtype=np.int64)
    for x in rows.alive:
        out[rows.members[x]] = new_id[x]
    return RepairResult(row_of=out, num_rows=len(new_id), removed=removed, tried=tried, out_of_time=out_of_time)
