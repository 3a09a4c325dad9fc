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

When no such neighbourhood helps, the search widens (:data:`LEVELS`). A *subtree*
neighbourhood is r with every row holding one node of r's chains, deepest node first: the
rows that share a subtree with r, which a re-packing of that subtree's leaves needs (agent
trees with deep chains, where each row holds the leaves of one branch and a light row's
leaves fit once a few branches are paired anew). A *wide* neighbourhood is r with its
*affinity cluster* (grown one row at a time, each time the row sharing the most prefix
tokens with the group so far) or with the lightest rows, up to 24 or 48 rows: small
neighbourhoods fail where the slack a re-packing needs is spread thinly over many rows, or
where a row pays for a long chain of shared turns (several trees sharing rows, GRPO groups
of 80+ completions), and a wide group gathers that slack; on a batch of up to 48 rows it
is the whole batch. Subtree and wide groups are formed for the two lightest rows. The
levels run cheap first: every kind with small node limits (:data:`FIRST_LIMIT`, then
:data:`QUICK_LIMIT`: a group that fits usually fits quickly; the wide groups of 24 rows
before those of 48, which on a batch of more than 24 rows is a larger and slower search),
then with :data:`NODE_LIMIT`, so that a small budget (the default 10 ms) already reaches
the wide groups; last, the lightest row's wide group once more with :data:`DEEP_LIMIT`
(on a batch of up to 48 rows, a re-packing of the whole batch that a budget sized by a
cost model can afford). A removed row starts again at the first level. A group that ran out of nodes is
tried again only under a larger node limit, and its search goes on where it stopped
(:class:`~.exact.RowFit`: the cheap levels cost a later level nothing it would not have
searched anyway); one refuted never again (until one of its rows changes).

Every step keeps a valid placement (all leaves placed, every row within C) and removes one
row, so the result never has more rows than its input. The search order depends on the
input only (rows by load then index, neighbours by shared tokens, load, index; the node
limit counts search nodes), so it is deterministic as long as the budget lasts. The budget
is CPU time of the planning thread (``time.thread_time``), checked while forming
neighbourhoods and every few search nodes (:data:`~.exact_search.CLOCK_EVERY`): a loaded
machine, or other plans running in other threads, do not eat it, so the same batch gets
the same plan there too; only a run that spends the whole budget may stop earlier on a
slower CPU. Setting up is linear in the batch and lazy (rows and nodes are indexed when
first looked at), about 10 ms at 267k completions.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from treepack.service.planner.exact import FIT, NO_FIT, UNKNOWN, RowFit
from treepack.service.planner.items import Chains, Item
from treepack.service.planner.rows import row_costs
from treepack.service.planner.tree import Tree

__all__ = [
    "RepairResult",
    "repair_rows",
    "MAX_ROWS",
    "WIDE_ROWS",
    "LIGHT_ROWS",
    "NODE_LIMIT",
    "QUICK_LIMIT",
    "FIRST_LIMIT",
    "DEEP_LIMIT",
    "MAX_PAUSED",
    "LEVELS",
]

MAX_ROWS = 12  # largest neighbourhood of the first level: this many rows into one fewer
LIGHT_ROWS = 8  # light rows tried per round at the first level
NODE_LIMIT = 4_000  # branch-and-bound nodes per neighbourhood at the thorough levels
QUICK_LIMIT = 500  # ... at the quick levels, tried first
FIRST_LIMIT = 100  # ... at the first levels (a search goes on from where a lower limit stopped it)
DEEP_LIMIT = 50_000  # ... at the last level: the lightest row's wide group (a batch of <= 48 rows: all of it)
MAX_PAUSED = 16  # searches a quick level left unknown, kept for a thorough level to go on with
WIDE_ROWS = 48  # largest subtree or wide neighbourhood
LEVELS = (
    ("near", MAX_ROWS, FIRST_LIMIT, LIGHT_ROWS),
    ("subtree", WIDE_ROWS, FIRST_LIMIT, 2),
    ("wide", 24, FIRST_LIMIT, 2),
    ("wide", WIDE_ROWS, FIRST_LIMIT, 2),
    ("near", MAX_ROWS, QUICK_LIMIT, LIGHT_ROWS),
    ("subtree", WIDE_ROWS, QUICK_LIMIT, 2),
    ("wide", 24, QUICK_LIMIT, 2),
    ("wide", WIDE_ROWS, QUICK_LIMIT, 2),
    ("near", MAX_ROWS, NODE_LIMIT, LIGHT_ROWS),
    ("subtree", WIDE_ROWS, NODE_LIMIT, 2),
    ("wide", 24, NODE_LIMIT, 2),
    ("wide", WIDE_ROWS, NODE_LIMIT, 2),
    ("wide", WIDE_ROWS, DEEP_LIMIT, 1),
)
"""(kind of neighbourhood, largest neighbourhood, node limit, light rows tried) of each
level: ``near`` (r with the rows sharing most of its prefixes, or the lightest rows),
``subtree`` (r with the rows holding one node of its chains), ``wide`` (r with its
affinity cluster, or the lightest rows). A level runs when the ones before it found
nothing, and a removed row starts again at the first."""


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


def _subtree_nodes(tree: Tree) -> np.ndarray:
    """[N] int64 nodes in each node's subtree: in pre-order, v's subtree is ``v .. v + span - 1``."""
    span = np.ones(tree.num_nodes, dtype=np.int64)
    for d in range(int(tree.depth.max(initial=0)), 0, -1):
        at = np.flatnonzero(tree.depth == d)
        span += np.bincount(tree.parent[at], weights=span[at], minlength=tree.num_nodes).astype(np.int64)
    return span


class _Lookup(dict):
    """int(array[i]) on first use, then cached: per-node values without converting every node."""

    def __init__(self, array: np.ndarray) -> None:
        super().__init__()
        self.array = array

    def __missing__(self, i: int) -> int:
        v = self[i] = int(self.array[i])
        return v


class _Rows:
    """Rows as sets of sequences, with their loads and the internal nodes they hold.

    Built lazily so that a large batch pays only for the rows and nodes the search looks
    at: a row's members and held nodes on first use, a node's rows from the leaves of its
    subtree (a contiguous pre-order range) on first use.
    """

    def __init__(
        self, tree: Tree, row_of: np.ndarray, num_rows: int, loads: np.ndarray | None, chains: Chains | None
    ) -> None:
        self.tree = tree
        self.chains = Chains(tree) if chains is None else chains
        self.row_of = row_of
        self.node_len = _Lookup(tree.length)
        self.node_end = _Lookup(tree.end)
        self.alive = set(range(num_rows))
        self.items: dict[int, Item] = {}
        kept = row_of >= 0
        tails = np.zeros(row_of.shape[0], dtype=np.int64)
        tails[kept] = tree.length[tree.leaf_of[kept]]
        self.tail = np.bincount(row_of[kept], weights=tails[kept], minlength=num_rows).astype(np.int64).tolist()
        if loads is None:
            loads = row_costs(tree, row_of, num_rows)
        self.load = np.asarray(loads, dtype=np.int64).tolist()
        self.seq_at = np.full(tree.num_nodes, -1, dtype=np.int64)  # [N] sequence of each leaf node
        self.seq_at[tree.leaf_of[kept]] = np.flatnonzero(kept)
        self.span = _subtree_nodes(tree)
        self._members: dict[int, list[int]] = {}
        self._held: dict[int, set[int]] = {}
        self._node_rows: dict[int, set[int]] = {}
        self._dirty: set[int] = set()  # rows rewritten since row_of

    def members(self, r: int) -> list[int]:
        got = self._members.get(r)
        if got is None:
            got = self._members[r] = np.flatnonzero(self.row_of == r).tolist()
        return got

    def held(self, r: int) -> set[int]:
        got = self._held.get(r)
        if got is None:
            got = self._held[r] = {v for s in self.members(r) for v in self.item(s).chain}
        return got

    def node_rows(self, v: int) -> set[int]:
        got = self._node_rows.get(v)
        if got is None:
            seqs = self.seq_at[v : v + int(self.span[v])]
            got = set(np.unique(self.row_of[seqs[seqs >= 0]]).tolist()) - self._dirty
            got |= {x for x in self._dirty if v in self._held[x]}
            self._node_rows[v] = got
        return got

    def item(self, s: int) -> Item:
        it = self.items.get(s)
        if it is None:
            it = self.items[s] = self.chains.item(s)
        return it

    def _reindex(self, r: int, members: list[int]) -> None:
        for v in self.held(r):
            if v in self._node_rows:
                self._node_rows[v].discard(r)
        self._members[r] = members
        held: set[int] = set()
        tail = 0
        for s in members:
            it = self.item(s)
            tail += it.tail
            held.update(it.chain)
        for v in held:
            if v in self._node_rows:
                self._node_rows[v].add(r)
        self._held[r] = held
        self._dirty.add(r)
        self.tail[r] = tail
        self.load[r] = tail + sum(self.node_len[v] for v in held)

    def shared_with(self, rows: list[int], exclude: set[int]) -> dict[int, int]:
        """Tokens of internal nodes each other row holds in common with any of ``rows``."""
        shared: dict[int, int] = {}
        for r in rows:
            for v in self.held(r):
                for x in self.node_rows(v):
                    if x not in exclude:
                        shared[x] = shared.get(x, 0) + self.node_len[v]
        return shared

    def cluster(self, r: int, size: int, deadline: float) -> list[int]:
        """Up to ``size - 1`` rows grown from r by affinity: each step adds the row sharing the
        most prefix tokens with the group so far (ties: lighter, then lower index); when no
        row shares anything with it, the lightest rows."""
        group, inside = [r], {r}
        score = self.shared_with([r], inside)
        while len(group) < size and time.thread_time() <= deadline:
            if score:
                x = min(score, key=lambda y: (-score[y], self.load[y], y))
                del score[x]
            else:
                rest = [y for y in self.alive if y not in inside]
                if not rest:
                    break
                x = min(rest, key=lambda y: (self.load[y], y))
            group.append(x)
            inside.add(x)
            for y, n in self.shared_with([x], inside).items():
                score[y] = score.get(y, 0) + n
        return group[1:]

    def _fits_fewer(self, group: list[int] | set[int], seq_len: int) -> bool:
        """Whether the group's tokens (own segments, and every node its rows hold once) could
        fit one row fewer: the volume a re-packing needs."""
        nodes: set[int] = set()
        for x in group:
            nodes |= self.held(x)
        return sum(self.tail[x] for x in group) + sum(self.node_len[v] for v in nodes) <= (len(group) - 1) * seq_len

    def subtree_groups(self, r: int, max_rows: int, seq_len: int, deadline: float):
        """r with the rows holding each node of its chains, deepest node first (module
        docstring): groups of 3 to ``max_rows`` rows whose tokens could fit one row fewer."""
        end = self.node_end
        seen: set[frozenset[int]] = set()
        for v in sorted(self.held(r), key=lambda u: (-end[u], u)):
            if time.thread_time() > deadline:  # a row's first held() walks all its leaves
                return
            group = self.node_rows(v) | {r}
            key = frozenset(group)
            if 3 <= len(group) <= max_rows and key not in seen:
                seen.add(key)
                if self._fits_fewer(group, seq_len):
                    yield sorted(group)

    def neighbourhoods(self, r: int, max_rows: int, seq_len: int, deadline: float, *, wide: bool = False):
        """Row groups containing r, most promising first (module docstring).

        From each pool (rows by shared tokens, rows by load) rows join r until the group's
        tokens could fit one row fewer, then up to two more for slack. ``wide``: instead, r
        with its affinity cluster (:meth:`cluster`) and r with the lightest rows, each
        ``max_rows`` rows at most: wide groups spread the slack over many rows, which is what
        a re-packing of long chains needs.
        """
        shared = self.shared_with([r], {r})
        by_share = sorted(shared, key=lambda x: (-shared[x], self.load[x], x))
        by_room = sorted((x for x in self.alive if x != r), key=lambda x: (self.load[x], x))
        if wide:
            for pool in (self.cluster(r, max_rows, deadline), by_room):
                group = [r] + pool[: max_rows - 1]
                if time.thread_time() > deadline:  # a row's first held() walks all its leaves
                    return
                if self._fits_fewer(group, seq_len):
                    yield sorted(group)
            return
        for pool in (by_share, by_room):
            group, nodes, tail, extra = [r], set(self.held(r)), self.tail[r], 0
            for x in pool[: max_rows - 1]:
                if time.thread_time() > deadline:
                    return
                group.append(x)
                nodes |= self.held(x)
                tail += self.tail[x]
                if tail + sum(self.node_len[v] for v in nodes) <= (len(group) - 1) * seq_len:
                    yield sorted(group)
                    extra += 1
                    if extra == 3:
                        break

    def replace(self, group: list[int], drop: int, assign: dict[int, int]) -> None:
        keep = [x for x in group if x != drop]
        new: dict[int, list[int]] = {x: [] for x in group}
        for s, b in sorted(assign.items()):
            new[keep[b]].append(s)
        for x in group:
            self._reindex(x, new[x])
        self.alive.discard(drop)

    def final_row_of(self) -> np.ndarray:
        out = self.row_of.copy()
        for x, members in self._members.items():
            out[members] = x
        new_id = np.full(max(len(self.load), 1), -1, dtype=np.int64)
        alive = sorted(self.alive)
        new_id[alive] = np.arange(len(alive))
        kept = out >= 0
        out[kept] = new_id[out[kept]]
        return out


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
    loads: np.ndarray | None = None,
    chains: Chains | None = None,
) -> RepairResult:
    """Remove rows from a placement by exact re-packing of small neighbourhoods (module docstring).

    Args:
        tree: the batch's tree.
        row_of: [S] int64 a valid placement (-1 for dropped sequences).
        num_rows: its rows.
        seq_len: C.
        bound: a proven lower bound on the rows: the search stops there.
        budget_ms: CPU-time budget of this thread, in ms; 0 disables the pass.
        max_rows: largest neighbourhood.
        node_limit: branch-and-bound nodes per neighbourhood.
        loads: [R] tokens of each row, if known (else computed).
        chains: the tree's :class:`~.items.Chains`, if already built.

    Returns:
        The :class:`RepairResult` (``row_of`` is the input itself when nothing changed).
    """
    deadline = time.thread_time() + budget_ms / 1e3
    if budget_ms <= 0 or num_rows <= bound:
        return RepairResult(row_of=row_of, num_rows=num_rows, removed=0, tried=0, out_of_time=False)
    rows = _Rows(tree, row_of, num_rows, loads, chains)
    failed: dict[frozenset[int], float] = {}  # group -> node limit it failed under (inf: refuted)
    paused: dict[frozenset[int], RowFit] = {}  # searches stopped by a node limit a later level raises
    tried = 0
    out_of_time = False
    custom = (max_rows, node_limit) != (MAX_ROWS, NODE_LIMIT)
    levels = (("near", max_rows, node_limit, LIGHT_ROWS),) if custom else LEVELS
    top_limit = max(lv[2] for lv in levels)
    level = 0
    while len(rows.alive) > bound and not out_of_time:
        improved = False
        kind, size, limit, n_light = levels[level]
        light = sorted(rows.alive, key=lambda x: (rows.load[x], x))[:n_light]
        for r in light:
            if time.thread_time() > deadline:
                out_of_time = True
                break
            groups = (
                rows.subtree_groups(r, size, seq_len, deadline)
                if kind == "subtree"
                else rows.neighbourhoods(r, size, seq_len, deadline, wide=kind == "wide")
            )
            for group in groups:
                key = frozenset(group)
                if failed.get(key, -1) >= limit:
                    continue
                if time.thread_time() > deadline:
                    out_of_time = True
                    break
                tried += 1
                fit = paused.pop(key, None)
                if fit is None:
                    items = [rows.item(s) for x in group for s in rows.members(x)]
                    fit = RowFit(items, len(group) - 1, seq_len, rows.node_len)
                status = fit.run(limit, deadline)
                if status != FIT:
                    failed[key] = float("inf") if status == NO_FIT else limit
                    if status == UNKNOWN and limit < top_limit and len(paused) < MAX_PAUSED:
                        paused[key] = fit  # a thorough level goes on from here, not from the start
                    continue
                rows.replace(group, r, fit.assign)
                failed = {f: n for f, n in failed.items() if not (f & key)}
                paused = {f: x for f, x in paused.items() if not (f & key)}
                improved = True
                break
            if improved or out_of_time:
                break
        if improved:
            level = 0
        elif level + 1 < len(levels):
            level += 1
        else:
            break
    removed = num_rows - len(rows.alive)
    if removed == 0:
        return RepairResult(row_of=row_of, num_rows=num_rows, removed=0, tried=tried, out_of_time=out_of_time)
    out = rows.final_row_of()
    return RepairResult(row_of=out, num_rows=len(rows.alive), removed=removed, tried=tried, out_of_time=out_of_time)
