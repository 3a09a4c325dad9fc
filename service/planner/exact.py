"""Exact placement of small sets of leaves: a dependency-free branch and bound.

:func:`fit_rows` decides whether a set of leaves fits into ``m`` rows of C tokens, where a
row's cost is the size of the union of its leaves' root paths (SPEC section 4). The
repair pass (:mod:`.repair`) asks it "do the leaves of these k rows fit in k - 1?"; the
tests and the benchmarks ask it for the optimum of whole small batches
(:func:`~.optimum.exact_min_rows`, beside its brute-force reference).

Before any search, a decision whose tokens at the root (every own segment and K(v) copies
of each chain node, :func:`~.exact_order.min_copies`) exceed its rows is refuted without
sorting its leaves: most of the neighbourhoods the repair pass forms end there. The rest
is a depth-first branch and bound over one leaf order (:mod:`.exact_search`: its order of
rows, its symmetry rules and pruning). Where the leaves span several trees,
:class:`RowFit` runs both leaf orders (:func:`~.exact_order.leaf_orders`) side by side, a
few dozen nodes each in turn (:data:`SLICE`): the first to settle the decision settles it.

A node limit bounds the work; a search that reaches it answers "unknown", never a wrong
"no"; so does one past its deadline, if given. :class:`RowFit` keeps a search stopped by
its limit and goes on from there under a larger one (the repair pass raises its limits
level by level). Its work is bounded whatever the input: at most ``node_limit`` nodes,
after a set-up that only runs when there are at most ``node_limit`` leaves (a fit takes a
node per leaf: with more, the answer is "unknown" at once).
"""

from __future__ import annotations

import time

from treepack.service.planner.exact_order import leaf_orders, min_copies
from treepack.service.planner.exact_search import _Limit, _Search
from treepack.service.planner.items import Item

__all__ = [
    "RowFit",
    "fit_rows",
    "FIT",
    "NO_FIT",
    "UNKNOWN",
    "SLICE",
]

FIT, NO_FIT, UNKNOWN = "fit", "no_fit", "unknown"
SLICE = 64  # search nodes each leaf order runs in its turn, where RowFit runs two


def _volume(items: list[Item], node_len) -> int:
    """Tokens any placement of ``items`` holds: every leaf's own segment and every node of
    their chains once (the search's root bound)."""
    nodes: set[int] = set()
    for it in items:
        nodes.update(it.chain)
    return sum(it.tail for it in items) + sum(node_len[v] for v in nodes)


class RowFit:
    """One decision "do ``items`` fit into ``num_rows`` rows of ``capacity`` tokens?", run
    in steps of growing node limits (:meth:`run`), each going on where the last stopped.

    Where the leaves span several trees, both leaf orders (:func:`~.exact_order.leaf_orders`)
    are searched, :data:`SLICE` nodes each in turn, once the limit allows each a full branch
    (twice the leaves); the node limit counts the nodes of both.

    Args:
        items: the leaves (see :func:`~.items.leaf_items`).
        num_rows: m >= 0.
        capacity: C.
        node_len: per node id, its length (indexable: a list or an array).
    """

    __slots__ = (
        "items",
        "num_rows",
        "capacity",
        "node_len",
        "status",
        "assign",
        "nodes",
        "_searches",
        "_orders",
        "_copies",
    )

    def __init__(self, items: list[Item], num_rows: int, capacity: int, node_len) -> None:
        self.items, self.num_rows, self.capacity, self.node_len = items, num_rows, capacity, node_len
        self.status = UNKNOWN
        self.assign: dict[int, int] = {}  # {seq: row in [0, m)} once FIT
        self.nodes = 0  # search nodes visited in all runs, both orders
        self._searches: list[_Search] = []
        self._orders: list[list[Item]] = []  # leaf orders not searched yet
        self._copies: dict[int, int] = {}  # K(v) of each chain node, shared by the orders' searches
        if not items:
            self.status = FIT
        elif num_rows <= 0:
            self.status = NO_FIT

    def _start(self) -> None:
        """Set up the first order's search; NO_FIT at once when its root bound refutes it."""
        copies = min_copies(self.items, self.capacity, self.node_len)
        need = sum(it.tail for it in self.items) + sum(self.node_len[v] * k for v, k in copies.items())
        if need > self.num_rows * self.capacity:
            self.status = NO_FIT  # (before the orders are sorted: most groups the repair pass tries end here)
            return
        self._copies = copies
        first, *self._orders = leaf_orders(self.items)
        self._searches = [_Search(first, self.num_rows, self.capacity, self.node_len, copies)]

    def run(self, node_limit: int, deadline: float | None = None) -> str:
        """Search up to ``node_limit`` nodes in all (a FIT or NO_FIT answer is final).

        Args:
            node_limit: search nodes in all runs before giving up with ``UNKNOWN``; with more
                leaves than this no fit can be found (``UNKNOWN`` at once, or ``NO_FIT`` when
                their tokens exceed the rows).
            deadline: a ``time.thread_time()`` value (this thread's CPU time) after which this
                run gives up too (read every :data:`CLOCK_EVERY` search nodes).

        Returns:
            ``FIT`` (``assign`` set), ``NO_FIT`` or ``UNKNOWN``.
        """
        if self.status != UNKNOWN:
            return self.status
        n = len(self.items)
        if not self._searches:
            if n > node_limit:
                # A fit visits one node per leaf, so none can be found: answer without the
                # set-up (a sort and a walk of every chain), which would dwarf a small budget.
                # Only the root's volume refutation is kept.
                if _volume(self.items, self.node_len) > self.num_rows * self.capacity:
                    self.status = NO_FIT
                return self.status
            self._start()
            if self.status != UNKNOWN:
                return self.status
        if self._orders and node_limit >= 2 * n:
            m, C = self.num_rows, self.capacity
            self._searches += [_Search(o, m, C, self.node_len, self._copies) for o in self._orders]
            self._orders = []
        searches = self._searches
        while True:  # each turn visits a node at least, or returns
            for search in searches:
                room = node_limit - self.nodes
                if room <= 0:
                    return UNKNOWN
                step = room if len(searches) == 1 else min(room, SLICE)
                try:
                    found = search.run(search.nodes + step, deadline)
                except _Limit:
                    self.nodes = sum(x.nodes for x in searches)
                    if deadline is not None and time.thread_time() > deadline:
                        return UNKNOWN
                    continue
                self.nodes = sum(x.nodes for x in searches)
                self._searches = []  # settled: the searches' state is no longer needed
                if found:
                    self.status = FIT
                    self.assign = {it.seq: r for it, r in zip(search.items, search.row_of)}
                else:
                    self.status = NO_FIT
                return self.status


def fit_rows(
    items: list[Item],
    num_rows: int,
    capacity: int,
    node_len,
    *,
    node_limit: int = 20_000,
    deadline: float | None = None,
) -> tuple[str, dict[int, int]]:
    """Decide whether ``items`` fit into ``num_rows`` rows of ``capacity`` tokens (one
    :class:`RowFit` run: see there for the arguments).

    Returns:
        (``FIT``, {seq: row in [0, m)}) or (``NO_FIT`` | ``UNKNOWN``, {}).
    """
    fit = RowFit(items, num_rows, capacity, node_len)
    status = fit.run(node_limit, deadline)
    return status, fit.assign
