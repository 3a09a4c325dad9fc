"""What the exact search (:mod:`.exact`, :mod:`.exact_search`) knows of a decision before it starts: its leaf orders
and the fewest rows each chain node must sit in.

**Leaf orders.** A depth-first search settles a decision fast when its first branches are
good, and an early mistake costs it the whole subtree below. Two orders fail on different
batches, so :class:`~.exact.RowFit` runs both where they differ:

- *largest first* (cost, then chain): the classic order of bin packing, which packs the
  hard leaves while the rows still have room, and refutes fastest;
- *tree by tree*, largest leaf first in each, the trees in the order of their largest
  leaf: where rows rarely mix trees (a curriculum's or a distillation batch's prompts of
  thousands of tokens), a decision is a bin packing per tree, and this order packs one
  tree's leaves together instead of interleaving the trees' decisions, while still
  placing the largest leaves early. (Ordering the trees by their total size instead put
  a tree of many small leaves before one holding a leaf of most of a row; on the
  planner's benchmark sets the largest-leaf order settles more decisions, and a third
  order beside these two cost more than it settled: ``BENCHMARKS.md``, *The last rows*.)

Identical leaves (same chain, same cost) stay adjacent in both, which the search's
symmetry rule needs.

**Copies.** :func:`min_copies` is the duplication bound of :mod:`.bounds` over the leaves of
one decision: a row holding any leaf below chain node v holds v's root path, ``end(v)``
tokens, and has at most ``C - end(v)`` left for what lies below v (the leaves' own
segments and the chain nodes under v), so at least ``ceil(below(v) / (C - end(v)))`` rows
hold v; and every row holding a child of v holds v. The search counts the copies of v that
the rows still lack as tokens still needed: a placement of these leaves holds v in
``K(v)`` rows at least, and rows never lose a node as leaves are added.
"""

from __future__ import annotations

from treepack.service.planner.items import Item

__all__ = ["leaf_orders", "min_copies", "naive_min_copies_items"]


def leaf_orders(items: list[Item]) -> list[list[Item]]:
    """The orders the exact search runs (module docstring).

    Args:
        items: the leaves of one decision.

    Returns:
        [largest first] or, where the leaves span two or more trees, [largest first, tree
        by tree]. A tree is a chain's root node; leaves without a chain count as one tree.
    """
    first = sorted(items, key=lambda it: (-it.cost, it.chain, it.seq))
    largest: dict[int, int] = {}  # tree -> the cost of its largest leaf
    for it in items:
        root = it.chain[0] if it.chain else -1
        largest[root] = max(largest.get(root, 0), it.cost)
    if len(largest) < 2:
        return [first]

    def by_tree(it: Item) -> tuple:
        root = it.chain[0] if it.chain else -1
        return (-largest[root], root, -it.cost, it.chain, it.seq)

    return [first, sorted(items, key=by_tree)]


def min_copies(items: list[Item], capacity: int, node_len) -> dict[int, int]:
    """{chain node v: K(v)}: the fewest rows that hold v in any placement of ``items`` into
    rows of ``capacity`` tokens (module docstring).

    Args:
        items: the leaves of one decision.
        capacity: C.
        node_len: per node id, its length (indexable).

    Returns:
        K(v) >= 1 for every node on a chain of ``items``; O(leaves x chain) work.
    """
    below: dict[int, int] = {}  # tokens strictly below v: own segments and chain nodes under v
    end: dict[int, int] = {}
    at: dict[int, tuple[tuple[int, ...], int]] = {}  # node -> (a chain holding it, its index there)
    for it in items:
        acc = 0
        for j, v in enumerate(it.chain):
            acc += node_len[v]
            below[v] = below.get(v, 0) + it.tail
            if v not in at:
                at[v] = (it.chain, j)
                end[v] = acc
    for v, (chain, j) in at.items():
        for a in chain[:j]:
            below[a] += node_len[v]
    copies = {v: -(-below[v] // max(capacity - end[v], 1)) if below[v] > 0 else 1 for v in at}
    for v in sorted(at, key=lambda x: -at[x][1]):  # deepest first: a child before its parent
        chain, j = at[v]
        if j and copies[v] > copies[chain[j - 1]]:
            copies[chain[j - 1]] = copies[v]
    return copies


def naive_min_copies_items(items: list[Item], capacity: int, node_len) -> dict[int, int]:
    """:func:`min_copies` one node at a time, from its definition (the reference).

    For each chain node v: the leaves below v are those whose chain holds it; ``below(v)``
    is their own segments plus every distinct chain node under v; K(v) is the largest
    ``ceil(below(u) / (C - end(u)))`` over v and the chain nodes under it (at least 1).
    """
    nodes = {v for it in items for v in it.chain}
    out = {}
    for v in nodes:
        best = 1
        for u in nodes:
            under = [it for it in items if u in it.chain]
            if v not in under[0].chain[: under[0].chain.index(u) + 1]:
                continue  # u is not v or below v
            chain = under[0].chain
            end_u = sum(node_len[x] for x in chain[: chain.index(u) + 1])
            deeper = {x for it in under for x in it.chain[it.chain.index(u) + 1 :]}
            total = sum(it.tail for it in under) + sum(node_len[x] for x in deeper)
            if total > 0:
                best = max(best, -(-total // max(capacity - end_u, 1)))
        out[v] = best
    return out
