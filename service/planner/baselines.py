"""The baseline placements ``bfd``, ``in_order`` and ``no_share`` (SPEC section 4), and
:func:`naive_place`, their loop-based reference.

- :func:`bfd` — the reference sharing-aware best-fit decreasing: leaves bucketed by group,
  groups ordered by their largest leaf (descending, stable), leaves visited group by group
  in input order (:func:`bfd_order`), each put into the open row with the least room left
  after adding its marginal cost (ties: the row opened first); a new row opens when none
  fits. It is :func:`~.rows.best_fit_decreasing` over the leaves; :func:`bfd_candidate`
  is the same run as an ``auto`` candidate.
- :func:`in_order` — next-fit in arrival order.
- :func:`no_share` — classical first-fit decreasing on full lengths, no tree.

Each takes ``(tree, batch, seq_len)`` and returns ``row_of``: [S] int64 row of each
sequence, -1 for dropped ones. :func:`naive_place` scans every row for every leaf.
"""

from __future__ import annotations

import numpy as np

from treepack.proto.batch import SequenceBatch
from treepack.proto.errors import RequestError
from treepack.proto.options import PlanOptions
from treepack.service.planner.items import Chains
from treepack.service.planner.options import check_options
from treepack.service.planner.rows import Candidate, best_fit_decreasing, naive_best_fit
from treepack.service.planner.tree import Tree

__all__ = ["BASELINES", "bfd", "bfd_candidate", "bfd_order", "in_order", "no_share", "naive_place"]


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


def bfd_candidate(
    tree: Tree, batch: SequenceBatch, seq_len: int, *, stop_rows: int | None = None, chains: Chains | None = None
) -> Candidate | None:
    """``bfd`` with its score; given up (None) once it cannot have fewer rows than ``stop_rows``."""
    order = tree.leaf_of[bfd_order(batch)].tolist()
    return best_fit_decreasing(tree, order, tree.end, seq_len, stop_rows=stop_rows, chains=chains)


def bfd(tree: Tree, batch: SequenceBatch, seq_len: int) -> np.ndarray:
    """[S] int64 row of each sequence under ``bfd`` (module docstring)."""
    got = bfd_candidate(tree, batch, seq_len)
    assert got is not None
    return got.row_of


def in_order(tree: Tree, batch: SequenceBatch, seq_len: int) -> np.ndarray:
    """[S] int64 row of each sequence under ``in_order``: a leaf goes into the last row if its
    marginal cost there fits, else opens a row."""
    row_of = np.full(batch.num_sequences, -1, dtype=np.int64)
    chains = Chains(tree)
    kept = np.flatnonzero(batch.kept)
    lens = batch.lens.tolist()
    held: set[int] = set()
    room = seq_len
    r = -1
    for s, p in zip(kept.tolist(), tree.parent[tree.leaf_of[kept]].tolist()):
        anc, ends = chains[p]
        e = 0
        for a, end in zip(anc, ends):
            if a in held:
                e = end
        m = lens[s] - e
        if r < 0 or m > room:
            r += 1
            held = set()
            room = seq_len
            m = lens[s]
        held.update(anc)
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


def no_share(tree: Tree, batch: SequenceBatch, seq_len: int) -> np.ndarray:
    """[S] int64 row of each sequence under ``no_share``: first-fit decreasing on full
    lengths (``tree`` is not used: nothing is shared)."""
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


BASELINES = {"bfd": bfd, "in_order": in_order, "no_share": no_share}


def naive_place(tree: Tree, batch: SequenceBatch, seq_len: int, placement: str) -> np.ndarray:
    """Loop-based reference of ``bfd``, ``in_order`` and ``no_share``: every row checked for every leaf.

    Returns:
        [S] int64 row of each sequence (-1 for dropped ones), equal to :func:`~.placement.place_leaves`'s.
    """
    check_options(PlanOptions(seq_len=seq_len, placement=placement))
    if placement == "auto":
        raise RequestError("naive_place has no reference for 'auto'", path="$.placement", rule="enum")
    lens = batch.lens.tolist()
    row_of = np.full(batch.num_sequences, -1, dtype=np.int64)
    held: list[set[int]] = []
    room: list[int] = []
    if placement == "bfd":
        # SPEC section 4 written out (not bfd_order): groups by their largest leaf,
        # descending, ties in group order (first appearance); input order inside a group.
        groups: dict[int, list[int]] = {}
        for s in np.flatnonzero(batch.kept).tolist():
            groups.setdefault(int(batch.group_codes[s]), []).append(s)
        ranked = sorted(groups.items(), key=lambda kv: (-max(lens[s] for s in kv[1]), kv[0]))
        order = [s for _, members in ranked for s in members]
    elif placement == "in_order":
        order = np.flatnonzero(batch.kept).tolist()
    else:
        kept = np.flatnonzero(batch.kept).tolist()
        order = sorted(kept, key=lambda s: -lens[s])
    for s in order:
        path = tree.path(s).tolist()
        anc = path[:-1]
        ends = [int(tree.start[a] + tree.length[a]) for a in anc]
        if placement == "bfd":
            r, m = naive_best_fit(held, room, anc, ends, lens[s])
        elif placement == "in_order":
            r, m = -1, lens[s]
            if room:
                last = len(room) - 1
                e = max([end for a, end in zip(anc, ends) if a in held[last]], default=0)
                if lens[s] - e <= room[last]:
                    r, m = last, lens[s] - e
        else:
            r, m = next(((x, lens[s]) for x in range(len(room)) if room[x] >= lens[s]), (-1, lens[s]))
        if r < 0:
            held.append(set())
            room.append(seq_len)
            r = len(room) - 1
        if placement != "no_share":
            held[r].update(anc)
        room[r] -= m
        row_of[s] = r
    return row_of
