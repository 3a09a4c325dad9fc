"""Exact placement of small sets of leaves: a dependency-free branch and bound, and its brute-force reference.

:func:`fit_rows` decides whether a set of leaves fits into ``m`` rows of C tokens, where a
row's cost is the size of the union of its leaves' root paths (SPEC section 4). The
repair pass (:mod:`.repair`) asks it "do the leaves of these k rows fit in k - 1?"; the
tests and the benchmarks ask it for the optimum of whole small batches
(:func:`exact_min_rows`). :func:`naive_min_rows` is the obviously correct reference: a
dynamic programme over all subsets of at most ~12 leaves.

The search assigns leaves, largest first, to rows, best fit first. It is exact: every
assignment is reachable except those equal to another up to

- renaming rows: a leaf opens at most one empty row, the lowest-numbered one (rows are
  then numbered by their first leaf, which any solution can be relabelled to);
- permuting identical leaves (same parent, same length): their rows are non-decreasing
  (a run of identical leaves can be re-sorted without changing any row);

and it prunes a branch when the tokens still needed, at least every remaining leaf's own
segment plus every ancestor that some remaining leaf needs and no row holds yet, exceed
the room left in all rows together. A node limit bounds the work; a search that reaches
it answers "unknown", never a wrong "no"; so does one past its deadline, if given.

The search is depth-first on an explicit stack, one frame per placed leaf, so any number of
leaves (the repair pass hands it several rows of them: about 100 short leaves fit one row
of 8,192 tokens) costs heap, never Python's stack. Its work is bounded whatever the input:
at most ``node_limit`` nodes, each ``O(m x chain)`` (trying the leaf in every row, and
moving it in and out), after an ``O(leaves x chain)`` set-up that only runs when there are
at most ``node_limit`` leaves (a fit takes a node per leaf: with more, the answer is
"unknown" at once); the deadline is checked at every node, so a search with one stops
within one node of it.
"""

from __future__ import annotations

import time

import numpy as np

from treepack.service.planner.items import Item, leaf_items
from treepack.service.planner.tree import Tree

__all__ = ["fit_rows", "exact_min_rows", "naive_min_rows", "FIT", "NO_FIT", "UNKNOWN"]

FIT, NO_FIT, UNKNOWN = "fit", "no_fit", "unknown"


class _Limit(Exception):
    pass


class _Search:
    """State of one :func:`fit_rows` call (see module docstring)."""

    def __init__(self, items: list[Item], m: int, capacity: int, node_len, limit: int, deadline: float | None) -> None:
        self.items = sorted(items, key=lambda it: (-it.cost, it.chain, it.seq))
        self.m, self.C, self.node_len, self.limit, self.deadline = m, capacity, node_len, limit, deadline
        self.nodes = 0
        self.load = [0] * m
        self.count = [0] * m
        self.held: list[dict[int, int]] = [{} for _ in range(m)]  # node -> leaves of the row using it
        self.rows_holding: dict[int, int] = {}
        self.need: dict[int, int] = {}
        for it in self.items:
            for v in it.chain:
                self.need[v] = self.need.get(v, 0) + 1
        self.uncovered = sum(node_len[v] for v in self.need)
        self.tails = sum(it.tail for it in self.items)
        self.room = m * capacity
        self.row_of = [-1] * len(self.items)
        self.ends = []  # per leaf: tokens of its chain up to and including each chain node
        for it in self.items:
            acc, e = 0, []
            for v in it.chain:
                acc += node_len[v]
                e.append(acc)
            self.ends.append(e)

    def _marginal(self, i: int, r: int) -> int:
        """Leaf i's cost in row r: a row holds an ancestor-closed set of nodes, so the part of
        the leaf's chain it holds is a prefix, up to the deepest chain node it holds."""
        held = self.held[r]
        chain = self.items[i].chain
        for j in range(len(chain) - 1, -1, -1):
            if chain[j] in held:
                return self.items[i].cost - self.ends[i][j]
        return self.items[i].cost

    def _move(self, i: int, r: int, marg: int, sign: int) -> None:
        """Put leaf i into row r (sign 1) or take it out again (sign -1)."""
        it = self.items[i]
        held, need, holding, node_len = self.held[r], self.need, self.rows_holding, self.node_len
        for v in it.chain:
            before = need[v] > 0 and holding.get(v, 0) == 0
            need[v] -= sign
            h = held.get(v, 0) + sign
            if h:
                held[v] = h
            else:
                del held[v]
            if h == 0 or (h == 1 and sign > 0):
                holding[v] = holding.get(v, 0) + sign
            after = need[v] > 0 and holding.get(v, 0) == 0
            if before != after:
                self.uncovered += node_len[v] if after else -node_len[v]
        self.load[r] += sign * marg
        self.count[r] += sign
        self.tails -= sign * it.tail
        self.room -= sign * marg
        self.row_of[i] = r if sign > 0 else -1

    def _options(self, i: int) -> list[tuple[int, int, int]]:
        """Leaf i's rows, best fit first: (room left after it, row, its marginal cost there)."""
        it = self.items[i]
        prev = self.items[i - 1] if i else None
        lo = self.row_of[i - 1] if prev is not None and prev.chain == it.chain and prev.cost == it.cost else 0
        options = []
        opened = False
        for r in range(lo, self.m):
            if self.count[r] == 0:
                if opened:
                    continue
                opened = True
            marg = self._marginal(i, r)
            left = self.C - self.load[r] - marg
            if left >= 0:
                options.append((left, r, marg))
        options.sort()
        return options

    def _visit(self, i: int) -> list[tuple[int, int, int]]:
        """Count search node i (raising :class:`_Limit` past the node limit or the deadline)
        and return its options; none when the branch is pruned."""
        self.nodes += 1
        if self.nodes > self.limit:
            raise _Limit
        # Checked at every node: a node costs O(rows x chain), enough to hide the clock's cost,
        # and with long chains 64 nodes could run far past a millisecond budget.
        if self.deadline is not None and time.thread_time() > self.deadline:
            raise _Limit
        if self.uncovered + self.tails > self.room:
            return []
        return self._options(i)

    def run(self) -> bool:
        """Depth-first search over the leaves in order, on an explicit stack (one frame per
        placed leaf, so the depth of the search never touches Python's stack).

        Frame i holds leaf i's options and the index of the one it is trying; leaf i sits
        in that option's row while the leaves after it are searched.

        Returns:
            True with ``row_of`` set when every leaf fits; False when none of the branches does.

        Raises:
            _Limit: past the node limit or the deadline.
        """
        n = len(self.items)
        if n == 0:
            return True
        stack: list[list] = [[self._visit(0), -1]]
        while stack:
            frame = stack[-1]
            i = len(stack) - 1
            options, k = frame
            if k >= 0:  # the branch below option k failed: take the leaf out again
                _, r, marg = options[k]
                self._move(i, r, marg, -1)
            k += 1
            if k == len(options):
                stack.pop()
                continue
            frame[1] = k
            _, r, marg = options[k]
            self._move(i, r, marg, 1)
            if i + 1 == n:
                return True
            stack.append([self._visit(i + 1), -1])
        return False


def _volume(items: list[Item], node_len) -> int:
    """Tokens any placement of ``items`` holds: every leaf's own segment and every node of
    their chains once (the search's root bound)."""
    nodes: set[int] = set()
    for it in items:
        nodes.update(it.chain)
    return sum(it.tail for it in items) + sum(node_len[v] for v in nodes)


def fit_rows(
    items: list[Item],
    num_rows: int,
    capacity: int,
    node_len,
    *,
    node_limit: int = 20_000,
    deadline: float | None = None,
) -> tuple[str, dict[int, int]]:
    """Decide whether ``items`` fit into ``num_rows`` rows of ``capacity`` tokens.

    Args:
        items: the leaves (see :func:`~.items.leaf_items`).
        num_rows: m >= 0.
        capacity: C.
        node_len: per node id, its length (indexable: a list or an array).
        node_limit: search nodes before giving up with ``UNKNOWN``; with more leaves than
            this no fit can be found (``UNKNOWN`` at once, or ``NO_FIT`` when their tokens
            exceed the rows).
        deadline: a ``time.thread_time()`` value (this thread's CPU time) after which the
            search gives up too (checked at every search node).

    Returns:
        (``FIT``, {seq: row in [0, m)}) or (``NO_FIT`` | ``UNKNOWN``, {}).
    """
    if not items:
        return FIT, {}
    if num_rows <= 0:
        return NO_FIT, {}
    if len(items) > node_limit:
        # A fit visits one node per leaf, so none can be found: answer without the set-up
        # (a sort and a walk of every chain), which would dwarf a small budget. Only the
        # root's volume refutation is kept.
        return (NO_FIT if _volume(items, node_len) > num_rows * capacity else UNKNOWN), {}
    search = _Search(items, num_rows, capacity, node_len, node_limit, deadline)
    if search.uncovered + search.tails > search.room:
        return NO_FIT, {}
    try:
        found = search.run()
    except _Limit:
        return UNKNOWN, {}
    if not found:
        return NO_FIT, {}
    return FIT, {it.seq: r for it, r in zip(search.items, search.row_of)}


def exact_min_rows(tree: Tree, seq_len: int, lower: int, upper: int, *, node_limit: int = 200_000) -> tuple[int, bool]:
    """The fewest rows for every kept leaf, searched between two known bounds.

    Args:
        tree: the batch's tree.
        seq_len: C.
        lower: a proven lower bound (e.g. :func:`~.bounds.lower_bound_rows`).
        upper: the rows of a known placement.
        node_limit: per decision.

    Returns:
        (rows, proven): the fewest rows found; ``proven`` when every smaller count was
        refuted (not merely left unknown).
    """
    items = leaf_items(tree, np.flatnonzero(tree.leaf_of >= 0))
    node_len = tree.length.tolist()
    proven = True
    for m in range(lower, upper):
        status, _ = fit_rows(items, m, seq_len, node_len, node_limit=node_limit)
        if status == FIT:
            return m, proven
        proven = proven and status == NO_FIT
    return upper, proven


def naive_min_rows(tree: Tree, seq_len: int) -> int:
    """Brute force over all subsets of the kept leaves (at most ~12): the optimum rows.

    ``cost[mask]`` is the union of the leaves' paths in ``mask``; ``best[mask]`` the fewest
    rows for ``mask``, trying every fitting row that holds its lowest leaf.
    """
    seqs = np.flatnonzero(tree.leaf_of >= 0).tolist()
    n = len(seqs)
    assert n <= 14, "naive_min_rows is exponential"
    member = np.zeros(tree.num_nodes, dtype=np.int64)
    for bit, s in enumerate(seqs):
        member[tree.path(s)] |= 1 << bit
    masks = np.arange(1 << n, dtype=np.int64)
    cost = np.zeros(1 << n, dtype=np.int64)
    for v in range(tree.num_nodes):
        cost += tree.length[v] * ((masks & member[v]) != 0)
    fits = (cost <= seq_len).tolist()
    best = [0] * (1 << n)
    for mask in range(1, 1 << n):
        low = mask & -mask
        rest = mask ^ low
        b = n + 1
        sub = rest
        while True:
            row = sub | low
            if fits[row] and best[mask ^ row] + 1 < b:
                b = best[mask ^ row] + 1
            if sub == 0:
                break
            sub = (sub - 1) & rest
        best[mask] = b
    return best[(1 << n) - 1]
