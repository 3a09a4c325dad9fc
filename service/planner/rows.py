"""Open rows, the sharing-aware best-fit query, and the one best-fit-decreasing loop over
them (the engine under ``bfd`` and every ``auto`` candidate).

An *item* is a leaf (or, for ``auto``, a whole subtree) with a full cost and a chain of
internal ancestors ``anc[0..k)`` (root first) ending at ``ends[i]`` tokens. A row holds
an ancestor-closed set of nodes, so the part of an item's path a row already holds is a
prefix of its chain, up to the deepest ancestor ``d`` the row has; the item's marginal cost
there is ``cost - ends[d]`` (``cost`` if it holds none).

Best fit asks for the row minimizing ``room - marginal >= 0`` (ties: the row opened
first). Rows split by the deepest ancestor they hold: class i = rows holding ``anc[i]``
but not ``anc[i+1]``; class "none" = rows holding none. Each class is searched in
increasing room from the smallest room that fits, skipping rows of deeper classes and
stopping as soon as no better row can follow, so a query costs O(depth * log R) plus the
skipped rows, not O(R):

- a node held by few rows (``<= SMALL``) is scanned directly;
- a node held by many rows keeps a sorted list of ``room << 32 | row`` keys;
- the "none" class walks a global sorted list of every open row.

:func:`naive_best_fit` is the obviously correct O(R) scan the tests compare against.

:func:`best_fit_decreasing` puts items (tree nodes: leaves for ``bfd``, subtrees for
``auto``'s grouped candidates) into rows in the order given, each into its best-fitting
open row, opening a row when none fits; it can split an item that fits nowhere into its
children first, and give up as soon as it cannot beat a known row count. Its result is a
:class:`Candidate`. :func:`row_costs` gives any placement's tokens per row.
"""

from __future__ import annotations

from bisect import bisect_left, insort
from dataclasses import dataclass

import numpy as np

from treepack.proto.index import csr_gather
from treepack.service.planner.items import Chains
from treepack.service.planner.tree import Tree

__all__ = ["OpenRows", "naive_best_fit", "SMALL", "Candidate", "best_fit_decreasing", "row_costs"]

SMALL = 12
_MASK = (1 << 32) - 1


class OpenRows:
    """Rows being filled, with the per-node indexes the best-fit query needs.

    Args:
        capacity: tokens per row (C).
    """

    __slots__ = ("capacity", "room", "held", "node_rows", "node_sorted", "row_big", "all_sorted", "copies")

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.room: list[int] = []
        self.held: list[set[int]] = []  # per row: internal nodes it holds
        self.node_rows: dict[int, set[int]] = {}  # node -> rows holding it
        self.node_sorted: dict[int, list[int]] = {}  # big node -> sorted keys of its rows
        self.row_big: list[list[int]] = []  # per row: big nodes it holds
        self.all_sorted: list[int] = []  # every row's key
        self.copies = 0  # tokens of internal nodes held by a row other than the first (when add() gets ends)

    def best_fit(self, anc: list[int], ends: list[int], cost: int) -> tuple[int, int]:
        """(row, marginal cost) of the best-fitting open row, or (-1, cost) if none fits."""
        best_ra = self.capacity + 1  # room left after placing, of the best row so far
        best_r = -1
        best_m = cost
        node_rows = self.node_rows
        room = self.room
        k = len(anc)
        below: set[int] | None = None  # rows holding anc[i+1] (a deeper class)
        for i in range(k - 1, -1, -1):
            a = anc[i]
            rows = node_rows.get(a)
            if rows is None:
                continue  # no row holds anc[i], hence none holds a shallower-class row either
            m = cost - ends[i]
            keys = self.node_sorted.get(a)
            if keys is None:
                for r in rows:
                    ra = room[r] - m
                    if ra >= 0 and (ra < best_ra or (ra == best_ra and r < best_r)):
                        if below is not None and r in below:
                            continue
                        best_ra, best_r, best_m = ra, r, m
            else:
                found = _scan_sorted(keys, m, below, best_ra, best_r)
                if found is not None:
                    best_ra, best_r, best_m = found[0], found[1], m
            below = rows
        found = _scan_sorted(self.all_sorted, cost, node_rows.get(anc[0]) if k else None, best_ra, best_r)
        if found is not None:
            best_r, best_m = found[1], cost
        return best_r, best_m

    def open_row(self) -> int:
        r = len(self.room)
        self.room.append(self.capacity)
        self.held.append(set())
        self.row_big.append([])
        insort(self.all_sorted, (self.capacity << 32) | r)
        return r

    def add(self, r: int, anc: list[int], marginal: int, ends: list[int] | None = None) -> None:
        """Put an item with ancestors ``anc`` into row r, charging ``marginal`` tokens.

        With the ancestors' ``ends``, also counts in :attr:`copies` the tokens of the
        ancestors this row copies from another row.
        """
        old = self.room[r]
        new = old - marginal
        assert new >= 0, "row over capacity"
        held = self.held[r]
        for i, a in enumerate(anc):
            if a in held:
                continue
            held.add(a)
            rows = self.node_rows.get(a)
            if rows is None:
                self.node_rows[a] = {r}
                continue
            rows.add(r)
            if ends is not None:
                self.copies += ends[i] - (ends[i - 1] if i else 0)
            keys = self.node_sorted.get(a)
            if keys is not None:
                insort(keys, (old << 32) | r)
                self.row_big[r].append(a)
            elif len(rows) > SMALL:
                self.node_sorted[a] = sorted((self.room[x] << 32) | x for x in rows)
                for x in rows:
                    self.row_big[x].append(a)
        if new != old:
            self.room[r] = new
            okey, nkey = (old << 32) | r, (new << 32) | r
            for a in self.row_big[r]:
                keys = self.node_sorted[a]
                del keys[bisect_left(keys, okey)]
                insort(keys, nkey)
            keys = self.all_sorted
            del keys[bisect_left(keys, okey)]
            insort(keys, nkey)


def _scan_sorted(
    keys: list[int], m: int, exclude: set[int] | None, best_ra: int, best_r: int
) -> tuple[int, int] | None:
    """First row in ``keys`` (sorted ``room << 32 | row``) that fits ``m`` tokens, is not in
    ``exclude`` and beats (best_ra, best_r); returns (room after, row) or None.

    Keys ascend in (room, row), so the first acceptable key is the class's best fit, and
    the scan stops as soon as no later key can beat the best found elsewhere.
    """
    j = bisect_left(keys, m << 32)
    nk = len(keys)
    while j < nk:
        key = keys[j]
        r = key & _MASK
        ra = (key >> 32) - m
        if ra > best_ra or (ra == best_ra and r > best_r):
            return None
        if exclude is None or r not in exclude:
            return ra, r
        j += 1
    return None


def naive_best_fit(
    held: list[set[int]], room: list[int], anc: list[int], ends: list[int], cost: int
) -> tuple[int, int]:
    """Reference: scan every row, compute its marginal cost, keep the best fit.

    Args:
        held: per row, the internal nodes it holds.
        room: per row, tokens left.
        anc, ends, cost: the item (see module docstring).

    Returns:
        (row, marginal) minimizing room - marginal >= 0, ties to the lowest row; (-1, cost)
        if no row fits.
    """
    best = (-1, cost)
    best_ra = None
    for r in range(len(room)):
        e = 0
        for a, end in zip(anc, ends):
            if a in held[r]:
                e = end
        m = cost - e
        ra = room[r] - m
        if ra >= 0 and (best_ra is None or ra < best_ra):
            best_ra, best = ra, (r, m)
    return best


@dataclass(frozen=True, slots=True, kw_only=True)
class Candidate:
    """A packing of every kept sequence, with its score.

    Attributes:
        row_of: [S] int64 row of each sequence, -1 for dropped ones.
        num_rows: R.
        packed_tokens: tokens the rows hold together (sum of ``loads``).
        loads: [R] int64 tokens each row holds.
    """

    row_of: np.ndarray
    num_rows: int
    packed_tokens: int
    loads: np.ndarray

    @property
    def score(self) -> tuple[int, int]:
        """(rows, packed tokens): lower is better."""
        return self.num_rows, self.packed_tokens


def best_fit_decreasing(
    tree: Tree,
    order: list[int],
    cost: np.ndarray,
    seq_len: int,
    *,
    kids: tuple[list[int], list[int]] | None = None,
    stop_rows: int | None = None,
    chains: Chains | None = None,
) -> Candidate | None:
    """Put the items ``order`` (tree nodes) into rows, each into its best-fitting open row.

    Every kept sequence's path must cross exactly one placed item (leaves of every kept
    sequence; or subtrees covering them, split further by ``kids``): its row is that item's.

    Args:
        tree: the batch's tree.
        order: [K] nodes in the order they are visited (largest first, by the caller's rule).
        cost: [N] int64 full cost of each node as an item (``end`` for a leaf; start plus
            subtree size for a subtree).
        seq_len: row capacity C.
        kids: (ptr [N+1], nodes) CSR of the children to visit, in order, instead of opening a
            row for an item that fits no open row; None: never split.
        stop_rows: give up (return None) once the result cannot have fewer rows than this.
        chains: the tree's :class:`~.items.Chains`, shared between calls (else built here).

    Returns:
        The :class:`Candidate`, or None if given up.
    """
    chains = Chains(tree) if chains is None else chains
    parent = chains.parent
    costl = cost.tolist()
    rows = OpenRows(seq_len)
    room = rows.room
    # Give up once the result cannot have fewer than stop_rows rows: its open rows, or
    # ceil((T + copies) / C) with T the tree's tokens and ``copies`` the tokens of internal
    # nodes already held by a second row (the final rows hold every tree token once plus those).
    limit = None if stop_rows is None else (stop_rows - 1) * seq_len - tree.num_tokens
    placed: list[int] = []
    placed_row: list[int] = []
    best_fit, add = rows.best_fit, rows.add
    stack = order[::-1]
    pop = stack.pop
    while stack:
        v = pop()
        anc, aend = chains[parent[v]]
        r, m = best_fit(anc, aend, costl[v])
        if r < 0:
            if kids is not None and kids[0][v] < kids[0][v + 1]:
                ptr, kid = kids
                stack.extend(kid[ptr[v + 1] - 1 : ptr[v] - 1 if ptr[v] else None : -1])
                continue
            r = rows.open_row()
        add(r, anc, m, aend)
        if limit is not None and stop_rows is not None and (rows.copies > limit or len(room) >= stop_rows):
            return None
        placed.append(v)
        placed_row.append(r)
    node_row = np.full(tree.num_nodes, -1, dtype=np.int64)
    node_row[placed] = placed_row
    row_of = np.full(tree.leaf_of.shape[0], -1, dtype=np.int64)
    kept = np.flatnonzero(tree.leaf_of >= 0)
    if kept.shape[0]:
        row_of[kept] = np.maximum.reduceat(node_row[tree.path_nodes], tree.path_ptr[kept])
    loads = rows.capacity - np.asarray(rows.room, dtype=np.int64)
    return Candidate(row_of=row_of, num_rows=len(rows.room), packed_tokens=int(loads.sum()), loads=loads)


def row_costs(tree: Tree, row_of: np.ndarray, num_rows: int, *, share: bool = True) -> np.ndarray:
    """[R] int64 tokens each row holds: the size of the union of its leaves' paths."""
    kept = row_of >= 0
    if not share:
        lens = tree.end[tree.leaf_of]
        return np.bincount(row_of[kept], weights=lens[kept], minlength=num_rows).astype(np.int64)
    seqs = np.flatnonzero(kept)
    counts = tree.path_ptr[seqs + 1] - tree.path_ptr[seqs]
    nodes = csr_gather(tree.path_ptr, tree.path_nodes, seqs)
    rows = np.repeat(row_of[seqs], counts)
    pair = np.unique(rows * tree.num_nodes + nodes)
    return np.bincount(pair // tree.num_nodes, weights=tree.length[pair % tree.num_nodes], minlength=num_rows).astype(
        np.int64
    )
