"""The depth-first search of the exact placement (:mod:`.exact`): one leaf order, one decision.

The search assigns leaves to rows in a fixed order (:func:`~.exact_order.leaf_orders`:
largest first; or tree by tree, the tree with the largest leaf first), trying first the
rows where the leaf's marginal cost is least (the rows sharing most of its prefix), then
the fullest of those (best fit). It is exact: every assignment is reachable except those
equal to another up to

- renaming rows: a leaf opens at most one empty row, the lowest-numbered one (rows are
  then numbered by their first leaf, which any solution can be relabelled to);
- permuting identical leaves (same parent, same length): their rows are non-decreasing
  (a run of identical leaves can be re-sorted without changing any row);

and it prunes a branch when the tokens still needed exceed the room left in all rows
together, the room of the *closed* rows not counted: rows that no remaining leaf fits
(:meth:`_Search._closed`: less room than the smallest own segment left, or than every
remaining leaf costs there, which for a row not holding a leaf's root is its whole cost;
a row only gains chain nodes by taking a leaf, so a closed row stays closed). The tokens
still needed are every remaining leaf's own segment plus, for every chain node v, its
length times the copies of v that the rows must still gain: v sits in at least K(v) rows
in any placement of these leaves (:func:`~.exact_order.min_copies`, the duplication bound
of :mod:`.bounds` over these leaves), and in as many as hold it now at least.

The search first looks for a fit that leaves the preferred row of at most one leaf per
branch (one *discrepancy*: a limited discrepancy search), then searches every branch: a
good ordering whose early mistake would cost a depth-first search a whole subtree finds
a fit at once, and a refutation costs at most one extra pass over the cheap part.

The search is depth-first on an explicit stack, one frame per placed leaf, so any number of
leaves (the repair pass hands it several rows of them: about 100 short leaves fit one row
of 8,192 tokens) costs heap, never Python's stack. A run stops with :class:`_Limit` at its
node limit or deadline and the next goes on from there. Each node costs
``O(m x roots + chain x rows holding a chain node)`` (trying the leaf in every row, its
cost there found from the rows holding each ancestor, the closed rows, and moving it in
and out), after an ``O(leaves x chain)`` set-up; the deadline is read every
:data:`CLOCK_EVERY` nodes (the clock costs about as much as a node), so a search with one
stops within a few nodes of it.
"""

from __future__ import annotations

import bisect
import time

from treepack.service.planner.items import Item

__all__ = ["CLOCK_EVERY", "DISCREPANCIES"]

CLOCK_EVERY = 8  # search nodes between two reads of the CPU clock (the deadline)
DISCREPANCIES = 1  # branches leaving the preferred row of more leaves than this wait for the full search


class _Limit(Exception):
    pass


class _Search:
    """State of one search over ``items`` in the given order (see module docstring)."""

    def __init__(self, items: list[Item], m: int, capacity: int, node_len, copies: dict[int, int]) -> None:
        self.items = items
        self.m, self.C, self.node_len = m, capacity, node_len
        self.limit: int = 0  # set by run()
        self.deadline: float | None = None
        self.nodes = 0
        self.stack: list[list] = []  # the depth-first search's frames (see run)
        self.pending = True  # the frame of leaf len(stack) is still to be opened
        self.full = False  # False: the pass with at most DISCREPANCIES per branch; True: every branch
        self.used = 0  # discrepancies on the current branch
        self.capped = False  # this pass skipped a branch for its discrepancies
        self.load = [0] * m
        self.count = [0] * m
        self.open_rows = 0  # rows holding a leaf: always rows 0..open_rows-1
        self.held: list[dict[int, int]] = [{} for _ in range(m)]  # node -> leaves of the row using it
        self.holders: dict[int, set[int]] = {}  # node -> rows holding it (len: how many)
        self.copies = copies  # K(v) of each chain node (min_copies over these leaves)
        self.missing = sum(node_len[v] * k for v, k in self.copies.items())  # copies no row holds yet
        self.tails = sum(it.tail for it in items)
        self.room = m * capacity
        self.row_of = [-1] * len(items)
        # [n + 1] the smallest own segment and the smallest cost among leaves i.. (0 past the
        # last): a row with less room than the first can take none of them, and one with less
        # than the second only a leaf whose root it holds (see _closed).
        n = len(items)
        self.min_tail = [0] * (n + 1)
        self.min_cost = [0] * (n + 1)
        for i in range(n - 1, -1, -1):
            t, c = items[i].tail, items[i].cost
            self.min_tail[i] = t if i == n - 1 or t < self.min_tail[i + 1] else self.min_tail[i + 1]
            self.min_cost[i] = c if i == n - 1 or c < self.min_cost[i + 1] else self.min_cost[i + 1]
        # Per root: its chains by their last leaf, latest first (the positions negated, for
        # bisect), and the least own segment of any leaf on those chains so far (a running
        # minimum). The chains with a leaf at i or later are a prefix, so the least own
        # segment below the root among leaves i.. is at least that prefix's minimum (see
        # _closed; the minimum over a chain's leaves, placed or not: a bound, exact in both
        # leaf orders, which place a chain's leaves largest first).
        last: dict[tuple[int, ...], int] = {}
        least: dict[tuple[int, ...], int] = {}
        for i, it in enumerate(items):
            if it.chain:
                last[it.chain] = i
                least[it.chain] = min(least.get(it.chain, it.tail), it.tail)
        self.roots: dict[int, tuple[list[int], list[int]]] = {}
        for chain, j in sorted(last.items(), key=lambda x: -x[1]):
            lasts, smallest = self.roots.setdefault(chain[0], ([], []))
            lasts.append(-j)
            smallest.append(min(smallest[-1], least[chain]) if smallest else least[chain])
        # [n] leaf i is identical to leaf i - 1 (same chain, same cost): its row is not below that one's
        self.same = [False] + [(a.chain, a.cost) == (b.chain, b.cost) for a, b in zip(items, items[1:])]
        self.ends = []  # per leaf: tokens of its chain up to and including each chain node
        for it in items:
            acc, e = 0, []
            for v in it.chain:
                acc += node_len[v]
                e.append(acc)
            self.ends.append(e)

    def _put(self, i: int, r: int, marg: int) -> None:
        """Put leaf i into row r, at marginal cost ``marg``.

        ``missing`` counts, per chain node v, ``len(v)`` times the copies of v the rows still
        lack (``K(v)`` less the rows holding v, when positive): a row that starts holding v
        while fewer than ``K(v)`` do removes one; one that stops holding it (:meth:`_take`),
        leaving fewer than ``K(v)``, adds one back.
        """
        it = self.items[i]
        if it.chain:
            held, holders, copies, node_len = self.held[r], self.holders, self.copies, self.node_len
            missing = self.missing
            for v in it.chain:
                h = held.get(v, 0)
                held[v] = h + 1
                if not h:
                    rows = holders.get(v)
                    if rows is None:
                        rows = holders[v] = set()
                    if len(rows) < copies[v]:
                        missing -= node_len[v]
                    rows.add(r)
            self.missing = missing
        self.load[r] += marg
        count = self.count
        count[r] += 1
        if count[r] == 1:
            self.open_rows += 1
        self.tails -= it.tail
        self.room -= marg
        self.row_of[i] = r

    def _take(self, i: int, r: int, marg: int) -> None:
        """Take leaf i out of row r again (:meth:`_put` undone)."""
        it = self.items[i]
        if it.chain:
            held, holders, copies, node_len = self.held[r], self.holders, self.copies, self.node_len
            missing = self.missing
            for v in it.chain:
                h = held[v] - 1
                if h:
                    held[v] = h
                else:
                    del held[v]
                    rows = holders[v]
                    rows.discard(r)
                    if len(rows) < copies[v]:
                        missing += node_len[v]
            self.missing = missing
        self.load[r] -= marg
        count = self.count
        count[r] -= 1
        if not count[r]:
            self.open_rows -= 1
        self.tails += it.tail
        self.room += marg
        self.row_of[i] = -1

    def _options(self, i: int) -> list[tuple[int, int, int]]:
        """Leaf i's rows, least marginal cost first, then best fit: (its marginal cost there,
        room left after it, row).

        A row holds an ancestor-closed set of nodes, so the part of the leaf's chain it holds
        is a prefix, up to the deepest chain node it holds: walking the chain deepest first,
        the rows holding each node (few, for deep nodes) get their marginal cost the first
        time they are met; every other row pays the leaf's whole cost.
        """
        it = self.items[i]
        cost, chain, ends, holders = it.cost, it.chain, self.ends[i], self.holders
        lo = self.row_of[i - 1] if self.same[i] else 0
        marginal: dict[int, int] = {}
        for j in range(len(chain) - 1, -1, -1):
            rows = holders.get(chain[j])
            if rows:
                m = cost - ends[j]
                for r in rows:
                    if r not in marginal:
                        marginal[r] = m
        C, load, used = self.C, self.load, self.open_rows
        # Rows in use are rows 0..used-1 (a leaf opens the lowest-numbered empty row, and
        # leaves leave in the reverse order they came), so the one empty row to try is
        # ``used``. Comprehensions: this is the search's innermost loop.
        rest = load[lo:used]  # a copy: the rows holding none of the chain pay the whole cost
        options = []
        for r, m in marginal.items():
            if r >= lo:
                rest[r - lo] = C + 1  # (not among those)
                if load[r] + m <= C:
                    options.append((m, C - load[r] - m, r))
        room = C - cost
        options += [(cost, left, r) for r, x in enumerate(rest, lo) if (left := room - x) >= 0]
        if used < self.m and cost <= C:
            options.append((cost, C - cost, used))
        options.sort()
        return options

    def _visit(self, i: int) -> list[tuple[int, int, int]]:
        """Count search node i (raising :class:`_Limit` past the node limit or the deadline)
        and return its options; none when the branch is pruned."""
        self.nodes += 1
        # The deadline is read every CLOCK_EVERY nodes: reading the thread's CPU clock costs
        # about as much as a node (a system call), and a node costs O(rows + chain)
        # microseconds, so the search stops within a few dozen microseconds of it. A node
        # refused here is not counted: a later run() visits it first.
        if self.nodes > self.limit or (
            self.deadline is not None and not self.nodes % CLOCK_EVERY and time.thread_time() > self.deadline
        ):
            self.nodes -= 1
            raise _Limit
        slack = self.room - self.missing - self.tails
        if slack < 0:
            return []
        if self._closed(i, slack):
            return []
        return self._options(i)

    def _closed(self, i: int, slack: int) -> bool:
        """Whether the rows that can take none of leaves i.. (*closed*) have more room than
        ``slack``: their room is lost to the rest of the search, so the tokens still needed
        cannot fit in the rest.

        A row with at least ``cheap`` room left (the least cost among those leaves) may
        take one; a row with less than their least own segment is closed. In between, a
        row may take only a leaf whose root it holds (any other costs it its whole cost),
        and such a leaf costs it its own segment at least (``roots`` tells the least own
        segment of the leaves i.. under each root). A closed row stays closed: it gains
        chain nodes only by taking a leaf. Where every chain starts at one root, a row in
        between holds that root or only leaves without a chain, and telling those apart
        would prune too rarely to pay: only the rows with less room than the least own
        segment are counted there. Cost: O(open rows) per node, and O(roots the row
        holds) per row in between.
        """
        C = self.C
        cheap = self.min_cost[i] if len(self.roots) > 1 else self.min_tail[i]
        if slack >= self.open_rows * cheap:
            return False  # (each row loses less than cheap)
        load = self.load
        over = C - cheap
        short = [x for x in load[: self.open_rows] if x > over]
        unsure = len(short) * C - sum(short)
        if unsure <= slack:
            return False
        floor, held_of, roots = self.min_tail[i], self.held, self.roots
        lost = 0
        for r in range(self.open_rows):
            x = load[r]
            if x <= over:
                continue
            left = C - x
            unsure -= left
            closed = left < floor
            if not closed:  # open if a root it holds has a leaf i.. whose own segment fits
                held = held_of[r]
                closed = True
                for v in roots if len(roots) < len(held) else held:
                    got = roots.get(v)
                    if got is not None and v in held:
                        k = bisect.bisect_right(got[0], -i)  # its chains with a leaf at i or later
                        if k and got[1][k - 1] <= left:
                            closed = False
                            break
            if closed:
                lost += left
                if lost > slack:
                    return True
            elif lost + unsure <= slack:
                return False
        return False

    def run(self, limit: int, deadline: float | None) -> bool:
        """Search over the leaves in order, on an explicit stack (one frame per placed leaf,
        so the depth of the search never touches Python's stack): first the branches with at
        most :data:`DISCREPANCIES` leaves off their first option, then, unless that pass was
        complete (skipped nothing), every branch, depth first.

        Frame i holds leaf i's options and the index of the one it is trying; leaf i sits
        in that option's row while the leaves after it are searched. A run stopped by its
        limit or deadline leaves the stack as it was, and the next run goes on from there:
        a search run to 500 nodes and then to 4,000 visits the nodes a single run to 4,000
        does, once.

        Args:
            limit: search nodes in all runs so far and this one.
            deadline: a ``time.thread_time()`` value, or None.

        Returns:
            True with ``row_of`` set when every leaf fits; False when none of the branches does.

        Raises:
            _Limit: past the node limit or the deadline.
        """
        self.limit, self.deadline = limit, deadline
        n = len(self.items)
        if n == 0:
            return True
        stack = self.stack
        while True:
            budget = None if self.full else DISCREPANCIES
            if self.pending:
                stack.append([self._visit(len(stack)), -1])
                self.pending = False
            while stack:
                frame = stack[-1]
                i = len(stack) - 1
                options, k = frame
                if k >= 0:  # the branch below option k failed: take the leaf out again
                    marg, _, r = options[k]
                    self._take(i, r, marg)
                k += 1
                if k == len(options):
                    stack.pop()
                    self.used -= k > 1  # this frame had left its first option
                    continue
                if k == 1:  # leaving the first option: one discrepancy more on this branch
                    if budget is not None and self.used >= budget:
                        self.capped = True
                        stack.pop()
                        continue
                    self.used += 1
                frame[1] = k
                marg, _, r = options[k]
                self._put(i, r, marg)
                if i + 1 == n:
                    return True
                self.pending = True
                stack.append([self._visit(i + 1), -1])
                self.pending = False
            if self.full or not self.capped:
                return False
            self.full, self.used, self.pending = True, 0, True
