"""The reference tree builder: :func:`naive_build_tree`, SPEC section 2 rules 2 and 4 read literally.

It works token by token on Python lists and shares nothing with the fast builder of
:mod:`~.tree` but the output type: the shareable prefix and the sharing rule are written
out here, so the tests that compare the two (from one table over random inputs) compare two
independent readings of the SPEC. Slow on purpose; loops only, with explicit stacks, so a
deep tree costs time, never Python stack.
"""

from __future__ import annotations

from treepack.proto.batch import SequenceBatch
from treepack.service.planner.tree import Tree, TreeEmitter, check_thresholds

__all__ = ["naive_build_tree"]

# A tree child as the rule yields it: (its sequences S, its start, the run it keeps, the
# common run of S from start). A singleton S is a leaf; otherwise keep >= the threshold.
_Item = tuple[list[int], int, int, int]


class _Rules:
    """The batch as Python lists, and rules 2 and 4 over sets of its sequences."""

    def __init__(self, batch: SequenceBatch, msl: int, saving: int, share_trainable: bool) -> None:
        n = batch.num_sequences
        self.msl, self.saving, self.share_trainable = msl, saving, share_trainable
        self.trains = [batch.trainable_of(s).tolist() for s in range(n)]
        self.lens = batch.lens.tolist()
        self.toks = [t.tolist() for t in batch.tokens]
        self.keys = [None] * n if batch.keys is None else [None if k is None else k.tolist() for k in batch.keys]
        self.sh = [self.shareable(s) for s in range(n)]

    def shareable(self, s: int) -> int:
        """Rule 2, from the flags (not the fast path's helper): up to the first scored
        position, which is the one before the first trainable token."""
        if self.share_trainable or True not in self.trains[s]:
            return self.lens[s]
        return max(self.trains[s].index(True) - 1, 0)

    def shared(self, run: int, count: int) -> bool:
        """Rule 4 (and sharing by saving), written out here rather than calling ``shares_run``."""
        return run >= self.msl or (self.saving > 0 and run > 0 and (count - 1) * run >= self.saving)

    def rec(self, s: int, p: int) -> tuple[int, int]:
        """The record of sequence s at position p: (token, key)."""
        key = self.keys[s]
        return self.toks[s][p], (0 if key is None else key[p])

    def split(self, S: list[int], at: int) -> list[list[int]]:
        """Partition S by the record at ``at``; sequences with no shareable record there are singletons."""
        parts: dict[tuple, list[int]] = {}
        alone: list[list[int]] = []
        for s in S:
            if at < self.sh[s]:
                parts.setdefault(self.rec(s, at), []).append(s)
            else:
                alone.append([s])
        out = list(parts.values()) + alone
        out.sort(key=min)
        return out

    def common_run(self, S: list[int], start: int) -> int:
        """How many records from ``start`` every sequence of S has, equal, in its shareable prefix."""
        run = 0
        limit = min(self.sh[s] for s in S) - start
        while run < limit and all(self.rec(s, start + run) == self.rec(S[0], start + run) for s in S):
            run += 1
        return run

    def kept_run(self, S: list[int], start: int, run: int) -> int:
        """The common run, less its last position in the generalized mode when that position
        is scored for a sequence going on past it."""
        end = start + run
        if self.share_trainable and run and any(end < self.lens[s] and self.trains[s][end] for s in S):
            return run - 1
        return run

    def expand(self, S: list[int], start: int) -> list[_Item]:
        """The tree children S yields under a parent ending at ``start``, by lowest sequence.

        ``node(S, start)``: a singleton is a leaf from ``start``; a common run that may be
        shared is a node; otherwise S splits by the record after the run and each part is
        retried from the same ``start`` (a work list, not a recursion: the parts shrink).
        """
        out: list[_Item] = []
        todo = [S]
        while todo:
            S = todo.pop()
            if len(S) == 1:
                out.append((S, start, 0, 0))
                continue
            run = self.common_run(S, start)
            keep = self.kept_run(S, start, run)
            if self.shared(keep, len(S)):
                out.append((S, start, keep, run))
            else:
                todo.extend(self.split(S, start + run))
        out.sort(key=lambda it: min(it[0]))
        return out

    def children(self, item: _Item) -> list[_Item]:
        """The tree children of an internal node: its sequences split after the common run,
        each part expanded from the end of the kept run."""
        S, start, keep, run = item
        return sorted(
            (it for part in self.split(S, start + run) for it in self.expand(part, start + keep)),
            key=lambda it: min(it[0]),
        )


def naive_build_tree(
    batch: SequenceBatch, min_shared_len: int = 64, *, share_trainable: bool = False, min_shared_saving: int = 0
) -> Tree:
    """Reference builder: SPEC section 2 rules 2 and 4, literally, on Python lists.

    ``node(S, start)``: find the common run of S from ``start`` (within everyone's
    shareable prefix); if it is at least ``min_shared_len`` long, it becomes an internal
    node and S splits by the following token; otherwise S splits by the following token
    and each part is retried from ``start``. A sequence left alone is a leaf from
    ``start``. In the generalized mode the run is everyone's common prefix, less its last
    position when that position is scored for a sequence going on past the divergence.
    The nodes are emitted in pre-order from an explicit stack of (children left, parent).

    Args:
        batch: the validated batch.
        min_shared_len: no internal node shorter than this is created (rule 4).
        share_trainable: the generalized mode (see :func:`~.tree.build_tree`).
        min_shared_saving: 0 (off), or share a shorter run when it saves at least this
            many tokens.

    Returns:
        The :class:`~.tree.Tree`, identical to :func:`~.tree.build_tree`'s.
    """
    msl, saving = check_thresholds(min_shared_len, min_shared_saving)
    rules = _Rules(batch, msl, saving, share_trainable)
    em = TreeEmitter(batch.num_sequences)
    kept = [s for s in range(batch.num_sequences) if batch.kept[s]]
    frames = [(iter(rules.expand(kept, 0)), -1)] if kept else []
    while frames:
        items, parent = frames[-1]
        item = next(items, None)
        if item is None:
            frames.pop()
            continue
        S, start, keep, _ = item
        if len(S) == 1:
            em.leaf(parent, S[0], start, rules.lens[S[0]])
            continue
        me = em.node(parent, start, start + keep, min(S), len(S))
        frames.append((iter(rules.children(item)), me))
    return em.finish(msl, share_trainable, saving)
