"""Leaves and subtrees as packing items: each one's chain of internal ancestors, built once.

Every placement packs *items*: a leaf (one sequence) or, for ``auto``, a whole subtree. An
item rooted at node v costs ``end(v)`` tokens alone (for a subtree, plus its descendants);
in a row that already holds part of its root path it costs less, and that part is always a
prefix of its *chain*, the internal ancestors of v, root first (SPEC section 4; see
:mod:`.rows` for the query that uses it). Siblings share their chain, so :class:`Chains`
builds one per parent, on first use (a candidate that is abandoned early does not build the
chains it never reached), and the candidates of one ``auto`` run and its repair pass share
one :class:`Chains`.

:class:`Item` is the same leaf as the exact search (:mod:`.exact`) and the repair pass
(:mod:`.repair`) see it: its chain as a tuple, its cost and its own segment's length.
"""

from __future__ import annotations

from dataclasses import dataclass

from treepack.service.planner.tree import Tree

__all__ = ["Chains", "Item", "leaf_items"]


@dataclass(frozen=True, slots=True)
class Item:
    """A leaf as the exact search sees it.

    Attributes:
        seq: the sequence it ends.
        chain: its internal ancestors, root first.
        cost: its full cost (sequence length).
        tail: its own segment's length (cost minus the chain's tokens).
    """

    seq: int
    chain: tuple[int, ...]
    cost: int
    tail: int


class Chains(dict):
    """Chains of items, one per parent, built on first use (module docstring).

    ``chains[p]`` is (the internal ancestors of p's children, root first, ending with p;
    their end positions): two lists, not to be modified. ``chains[-1]`` is empty (a root
    has no ancestors). :meth:`of` looks a node's chain up by its parent.

    Args:
        tree: the batch's tree.
    """

    __slots__ = ("tree", "parent", "end", "_source", "_depth", "_ptr", "_nodes", "_end")

    def __init__(self, tree: Tree) -> None:
        super().__init__({-1: ([], [])})
        self.tree = tree
        self.parent: list[int] = tree.parent.tolist()
        self.end = tree.end  # [N] (a property: computed once here)
        self._source: list[int] = tree.source.tolist()
        self._depth: list[int] = tree.depth.tolist()
        self._ptr: list[int] = tree.path_ptr.tolist()
        self._nodes: list[int] = tree.path_nodes.tolist()
        self._end: list[int] = self.end.tolist()

    def __missing__(self, p: int) -> tuple[list[int], list[int]]:
        at = self._ptr[self._source[p]]
        a = self._nodes[at : at + self._depth[p] + 1]
        end = self._end
        got = self[p] = (a, [end[x] for x in a])
        return got

    def of(self, v: int) -> tuple[list[int], list[int]]:
        """(ancestors of node v, root first; their end positions)."""
        return self[self.parent[v]]

    def item(self, s: int) -> Item:
        """The :class:`Item` of kept sequence s."""
        tree = self.tree
        leaf = int(tree.leaf_of[s])
        return Item(s, tuple(self.of(leaf)[0]), int(self.end[leaf]), int(tree.length[leaf]))


def leaf_items(tree: Tree, seqs) -> list[Item]:
    """The :class:`Item` of each kept sequence in ``seqs``."""
    chains = Chains(tree)
    return [chains.item(int(s)) for s in seqs]
