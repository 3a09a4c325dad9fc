"""Which leaves share a row (SPEC section 4).

Named placements:

- ``bfd`` — the reference sharing-aware best-fit decreasing: leaves bucketed by group,
  groups ordered by their largest leaf (descending, stable), leaves visited group by group
  in input order, each put into the open row with the least room left after adding its
  marginal cost (ties: the row opened first); a new row opens when none fits.
- ``in_order`` — next-fit in arrival order.
- ``no_share`` — classical first-fit decreasing on full lengths, no tree.
- ``auto`` — the best of several sharing-aware packings (see :mod:`.auto`), never more
  rows than ``bfd``.

A placement is ``row_of[s]`` per sequence (-1 for dropped sequences). Fast paths run on
:class:`~.rows.OpenRows`; :func:`naive_place` is the loop-based reference that scans every
row for every leaf.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from treepack.proto.errors import RequestError
from treepack.proto.options import PLACEMENTS, PlanOptions
from treepack.proto.index import csr_gather
from treepack.proto.batch import SequenceBatch
from treepack.service.planner.options import check_options
from treepack.service.planner.rows import OpenRows, naive_best_fit
from treepack.service.planner.tree import Tree

__all__ = ["PLACEMENTS", "naive_place", "bfd_order", "leaf_items", "row_costs"]



def bfd_order(batch: SequenceBatch) -> list[int]:
    """Visit order of ``bfd``: groups by largest leaf (desc, stable), input order inside."""
    kept = np.flatnonzero(batch.kept)
    codes = batch.group_codes[kept]
    lens = batch.lens[kept]
    ng = int(codes.max()) + 1 if codes.size else 0
    biggest = np.zeros(ng, dtype=np.int64)
    np.maximum.at(biggest, codes, lens)
    group_rank = np.empty(ng, dtype=np.int64)
    group_rank[np.argsort(-biggest, kind="stable")] = np.arange(ng)
    order = np.lexsort((kept, group_rank[codes]))
    return kept[order].tolist()


def leaf_items(tree: Tree) -> tuple[list[list[int]], list[list[int]]]:
    """Per sequence: its internal ancestors (root first) and their end positions.

    Sequences under the same parent share one pair of lists (siblings have one chain).
    """
    ptr = tree.path_ptr.tolist()
    nodes = tree.path_nodes.tolist()
    ends = tree.end.tolist()
    parent = tree.parent.tolist()
    leaf = tree.leaf_of.tolist()
    cache: dict[int, tuple[list[int], list[int]]] = {}
    anc, anc_end = [], []
    empty: tuple[list[int], list[int]] = ([], [])
    for s in range(len(ptr) - 1):
        if leaf[s] < 0:  # dropped: no path
            anc.append(empty[0])
            anc_end.append(empty[1])
            continue
        p = parent[leaf[s]]
        item = cache.get(p)
        if item is None:
            a = nodes[ptr[s] : ptr[s + 1] - 1]
            item = cache[p] = (a, [ends[x] for x in a])
        anc.append(item[0])
        anc_end.append(item[1])
    return anc, anc_end


def _bfd(tree: Tree, batch: SequenceBatch, seq_len: int) -> np.ndarray:
    row_of = np.full(batch.num_sequences, -1, dtype=np.int64)
    anc, ends = leaf_items(tree)
    lens = batch.lens.tolist()
    rows = OpenRows(seq_len)
    for s in bfd_order(batch):
        r, m = rows.best_fit(anc[s], ends[s], lens[s])
        if r < 0:
            r = rows.open_row()
        rows.add(r, anc[s], m)
        row_of[s] = r
    return row_of


def _in_order(tree: Tree, batch: SequenceBatch, seq_len: int) -> np.ndarray:
    row_of = np.full(batch.num_sequences, -1, dtype=np.int64)
    anc, ends = leaf_items(tree)
    lens = batch.lens.tolist()
    held: set[int] = set()
    room = seq_len
    r = -1
    for s in np.flatnonzero(batch.kept).tolist():
        e = 0
        for a, end in zip(anc[s], ends[s]):
            if a in held:
                e = end
        m = lens[s] - e
        if r < 0 or m > room:
            r += 1
            held = set()
            room = seq_len
            m = lens[s]
        held.update(anc[s])
        room -= m
        row_of[s] = r
    return row_of


class _MaxTree:
    """Segment tree over row slots holding the max room; finds the first row with room >= x."""

    def __init__(self, n: int) -> None:
        size = 1
        while size < max(n, 1):
            size *= 2
        self.size = size
        self.t = [0] * (2 * size)

    def first_fit(self, x: int) -> int:
        t = self.t
        if t[1] < x:
            return -1
        i = 1
        while i < self.size:
            i = 2 * i if t[2 * i] >= x else 2 * i + 1
        return i - self.size

    def set(self, i: int, v: int) -> None:
        t = self.t
        i += self.size
        t[i] = v
        i //= 2
        while i:
            t[i] = max(t[2 * i], t[2 * i + 1])
            i //= 2


def _no_share(batch: SequenceBatch, seq_len: int) -> np.ndarray:
    row_of = np.full(batch.num_sequences, -1, dtype=np.int64)
    kept = np.flatnonzero(batch.kept)
    order = kept[np.argsort(-batch.lens[kept], kind="stable")]
    mt = _MaxTree(kept.shape[0])
    room: list[int] = []
    lens = batch.lens.tolist()
    for s in order.tolist():
        r = mt.first_fit(lens[s])
        if r < 0:
            r = len(room)
            room.append(seq_len)
        room[r] -= lens[s]
        mt.set(r, room[r])
        row_of[s] = r
    return row_of


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
    return np.bincount(pair // tree.num_nodes, weights=tree.length[pair % tree.num_nodes], minlength=num_rows).astype(np.int64)


def naive_place(tree: Tree, batch: SequenceBatch, seq_len: int, placement: str) -> np.ndarray:
    """Loop-based reference of ``bfd``, ``in_order`` and ``no_share``: every row checked for every leaf.

    Returns:
        [S] int64 row of each sequence (-1 for dropped ones), equal to :func:`place_leaves`'s.
    """
    check_options(PlanOptions(seq_len=seq_len, placement=placement))
    if placement == "auto":
        raise RequestError("naive_place has no reference for 'auto'", path="$.placement", rule="enum")
    anc, ends = leaf_items(tree)
    lens = batch.lens.tolist()
    row_of = np.full(batch.num_sequences, -1, dtype=np.int64)
    held: list[set[int]] = []
    room: list[int] = []
    if placement == "bfd":
        order = bfd_order(batch)
    elif placement == "in_order":
        order = np.flatnonzero(batch.kept).tolist()
    else:
        kept = np.flatnonzero(batch.kept).tolist()
        order = sorted(kept, key=lambda s: -lens[s])
    for s in order:
        if placement == "bfd":
            r, m = naive_best_fit(held, room, anc[s], ends[s], lens[s])
        elif placement == "in_order":
            r, m = -1, lens[s]
            if room:
                last = len(room) - 1
                e = max([end for a, end in zip(anc[s], ends[s]) if a in held[last]], default=0)
                if lens[s] - e <= room[last]:
                    r, m = last, lens[s] - e
        else:
            r, m = next(((x, lens[s]) for x in range(len(room)) if room[x] >= lens[s]), (-1, lens[s]))
        if r < 0:
            held.append(set())
            room.append(seq_len)
            r = len(room) - 1
        if placement != "no_share":
            held[r].update(anc[s])
        room[r] -= m
        row_of[s] = r
    return row_of
