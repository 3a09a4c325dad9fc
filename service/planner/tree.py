"""The global radix tree of a batch (SPEC section 2, default mode).

All kept sequences of a request go into one tree, whatever their group. A node is a
segment: a run of positions ``[start, start + length)`` that an identical set of sequences
shares (an internal node, >= 2 sharers) or the unshared tail of one sequence (its leaf,
possibly empty). Every sequence is a root-to-leaf path whose nodes cover ``[0, len)``
contiguously, so a node's tokens can be read from any sharer (``source``, the lowest
index).

Node order is DFS pre-order; siblings are ordered by the lowest sequence index in their
subtree (input order). The row layout inherits this order.

Two builders with one output:

- :func:`build_tree` inserts each sequence's shareable prefix into a compacted trie whose
  edges are byte strings compared with one ``memcmp`` each (``bytes.startswith`` on a
  zero-copy view), then applies the minimum-shared-length rule in one pass over the trie.
  Work is O(total shareable tokens) in memcmp plus O(sum of path depths) in Python.
- :func:`~.naive_tree.naive_build_tree` (its own module, the reference) applies the SPEC's
  rule 4 literally, token by token.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from treepack.proto.batch import SequenceBatch
from treepack.proto.index import ancestor_chains, forest_depth

__all__ = ["Tree", "TreeEmitter", "build_tree", "check_thresholds", "flat_tree", "shares_run"]


@dataclass(frozen=True, slots=True, kw_only=True)
class Tree:
    """The global prefix tree, nodes in DFS pre-order.

    Attributes:
        parent: [N] int64 parent node, -1 for roots.
        start: [N] int64 first position (in its sequences) the node covers.
        length: [N] int64 number of positions (0 only for an empty leaf).
        source: [N] int64 lowest sequence index through the node (its tokens' source).
        sharers: [N] int64 number of sequences through the node (1 for leaves).
        depth: [N] int64 tree depth, roots 0.
        leaf_of: [S] int64 leaf node of each sequence, -1 for dropped sequences.
        path_ptr: [S+1] int64 CSR offsets into ``path_nodes``.
        path_nodes: [P] int64 each sequence's nodes, root to leaf.
        min_shared_len: the rule-4 threshold the tree was built with.
        share_trainable: built in the generalized mode (SPEC section 2).
        min_shared_saving: the sharing-by-saving threshold it was built with (0: off; see
            :func:`shares_run`).
    """

    parent: np.ndarray
    start: np.ndarray
    length: np.ndarray
    source: np.ndarray
    sharers: np.ndarray
    depth: np.ndarray
    leaf_of: np.ndarray
    path_ptr: np.ndarray
    path_nodes: np.ndarray
    min_shared_len: int
    share_trainable: bool = False
    min_shared_saving: int = 0

    @property
    def num_nodes(self) -> int:
        return int(self.parent.shape[0])

    @property
    def num_tokens(self) -> int:
        """Tokens in the tree: each shared run counted once."""
        return int(self.length.sum())

    @property
    def end(self) -> np.ndarray:
        """[N] int64 one past the last position of each node."""
        return self.start + self.length

    def path(self, s: int) -> np.ndarray:
        """Nodes of sequence s, root to leaf."""
        return self.path_nodes[self.path_ptr[s] : self.path_ptr[s + 1]]


def check_thresholds(min_shared_len: int, min_shared_saving: int) -> tuple[int, int]:
    """The builders' thresholds as ints, asserted in range.

    Args:
        min_shared_len: rule 4's threshold, >= 1.
        min_shared_saving: the sharing-by-saving threshold, >= 0 (0: off).

    Returns:
        ``(min_shared_len, min_shared_saving)``.
    """
    # Checked by check_options on every planning path; the tree builders are also called
    # directly (tests, what-if), where a bad value is the caller's bug.
    for value, least in ((min_shared_len, 1), (min_shared_saving, 0)):
        assert isinstance(value, (int, np.integer)) and not isinstance(value, bool) and value >= least, value
    return int(min_shared_len), int(min_shared_saving)


class TreeEmitter:
    """Collects nodes in pre-order and turns them into a :class:`Tree` (for every builder)."""

    __slots__ = ("parent", "start", "length", "source", "sharers", "leaf_of")

    def __init__(self, num_sequences: int) -> None:
        self.parent: list[int] = []
        self.start: list[int] = []
        self.length: list[int] = []
        self.source: list[int] = []
        self.sharers: list[int] = []
        self.leaf_of = [-1] * num_sequences

    def node(self, parent: int, start: int, end: int, source: int, sharers: int) -> int:
        self.parent.append(parent)
        self.start.append(start)
        self.length.append(end - start)
        self.source.append(source)
        self.sharers.append(sharers)
        return len(self.parent) - 1

    def leaf(self, parent: int, s: int, start: int, end: int) -> None:
        self.leaf_of[s] = self.node(parent, start, end, s, 1)

    def leaves(self, parent: int, seqs: list[int], start: int, lengths: list[int]) -> None:
        """:meth:`leaf` for each of ``seqs`` (in that order), all below ``parent`` from ``start``."""
        first = len(self.parent)
        k = len(seqs)
        self.parent.extend([parent] * k)
        self.start.extend([start] * k)
        self.length.extend([lengths[s] - start for s in seqs])
        self.source.extend(seqs)
        self.sharers.extend([1] * k)
        leaf_of = self.leaf_of
        for i, s in enumerate(seqs, first):
            leaf_of[s] = i

    def finish(self, min_shared_len: int, share_trainable: bool = False, min_shared_saving: int = 0) -> Tree:
        parent = np.asarray(self.parent, dtype=np.int64)
        depth = forest_depth(parent)
        leaf_of = np.asarray(self.leaf_of, dtype=np.int64)
        path_ptr, path_nodes = ancestor_chains(parent, depth, leaf_of)  # dropped: leaf -1, no path
        return Tree(
            parent=parent,
            start=np.asarray(self.start, dtype=np.int64),
            length=np.asarray(self.length, dtype=np.int64),
            source=np.asarray(self.source, dtype=np.int64),
            sharers=np.asarray(self.sharers, dtype=np.int64),
            depth=depth,
            leaf_of=leaf_of,
            path_ptr=path_ptr,
            path_nodes=path_nodes,
            min_shared_len=min_shared_len,
            share_trainable=share_trainable,
            min_shared_saving=min_shared_saving,
        )


class _TrieNode:
    """A compacted-trie node: the edge into it is ``label`` (bytes) = positions [start, end)."""

    __slots__ = ("label", "start", "end", "children", "terminals", "count", "minseq")

    def __init__(self, label: bytes, start: int, end: int, minseq: int, terminal: bool = False) -> None:
        self.label = label
        self.start = start
        self.end = end
        self.children: dict[int, _TrieNode] = {}
        self.terminals: list[int] = [minseq] if terminal else []
        self.count = 1
        self.minseq = minseq


class _KeyedIds:
    """Child keys of a keyed sequence, read lazily: ``ids[p]`` packs (key, token) of record p."""

    __slots__ = ("tokens", "keys")

    def __init__(self, tokens: memoryview, keys: memoryview) -> None:
        self.tokens, self.keys = tokens, keys

    def __getitem__(self, p: int) -> int:
        return (self.keys[p] << 32) | self.tokens[p]


def _record_views(batch: SequenceBatch, s: int, sh: int) -> tuple[memoryview, memoryview | _KeyedIds, int]:
    """(byte view of the records, record -> child key by ``[p]``, bytes per record).

    Without keys a record is the uint32 token: the views are the token array's own buffer
    (no slice, no copy; the caller stops at ``sh``). With keys it is (token, key), 12
    bytes, copied for the shareable prefix, and the child key packs both into one int.
    Keys are read lazily, only where a child is looked up, never converted for the whole
    prefix.
    """
    tok = batch.tokens[s]
    if batch.keys is None:
        ids = tok.data
        return ids.cast("B"), ids, 4
    key = batch.keys[s]
    rec = np.empty(sh, dtype=[("t", "<u4"), ("k", "<u8")])
    rec["t"] = tok[:sh]
    rec["k"] = 0 if key is None else key[:sh]
    return rec.data.cast("B"), _KeyedIds(rec["t"].copy().data, rec["k"].copy().data), 12


def shares_run(run: int, sharers: int, min_shared_len: int, min_shared_saving: int) -> bool:
    """Rule 4, and the sharing-by-saving option: may ``sharers`` sequences share ``run`` tokens?

    A run of at least ``min_shared_len`` is shared (SPEC rule 4). With
    ``min_shared_saving`` > 0 a shorter run is shared too when what sharing it saves,
    ``(sharers - 1) * run`` tokens, is at least ``min_shared_saving``: the trainer-side cost
    of one more segment, in tokens (BENCHMARKS.md measures it).
    """
    if run >= min_shared_len:
        return True
    return min_shared_saving > 0 and run > 0 and (sharers - 1) * run >= min_shared_saving


def build_tree(
    batch: SequenceBatch, min_shared_len: int = 64, *, share_trainable: bool = False, min_shared_saving: int = 0
) -> Tree:
    """Build the global radix tree of ``batch`` (fast path).

    Args:
        batch: the validated batch.
        min_shared_len: no internal node shorter than this is created (rule 4).
        share_trainable: the generalized mode: trainable tokens and scored positions may be
            shared; only the last position before a divergence whose next token is scored
            (for any sequence going on past it) is not.
        min_shared_saving: 0 (off), or share a shorter run when it saves at least this
            many tokens (:func:`shares_run`).

    Returns:
        The :class:`Tree`, identical to :func:`~.naive_tree.naive_build_tree`'s.
    """
    msl, saving = check_thresholds(min_shared_len, min_shared_saving)
    floor = 1 if saving else msl  # the shortest run that may be shared at all
    n = batch.num_sequences
    sh_all = batch.lens.copy() if share_trainable else batch.shareable_lens()
    kept = batch.kept
    root = _TrieNode(b"", 0, 0, -1)
    root.count = 0
    # Only a prefix of >= floor tokens can ever be shared: any internal node ends at
    # depth >= its length >= floor.
    _insert_prefixes(root, batch, np.flatnonzero(kept & (sh_all >= floor)).tolist(), sh_all.tolist())
    if share_trainable:
        _cut_scored_branches(root, batch)
    em = TreeEmitter(n)
    # Sequences that can share nothing hang off the forest as root leaves, merged with the
    # trie's top-level subtrees in order of lowest sequence index.
    loners = np.flatnonzero(kept & (sh_all < floor)).tolist()
    _emit_children(em, root, loners, batch.lens, msl, saving)
    return em.finish(msl, share_trainable, saving)


def _insert_prefixes(root: _TrieNode, batch: SequenceBatch, seqs: list[int], shareable: list[int]) -> None:
    """Insert the shareable prefix of each sequence in ``seqs`` (in order) into the trie.

    Each edge is compared with one ``memcmp`` (``bytes.startswith`` on a zero-copy view of
    the sequence, :func:`_record_views`); an edge the prefix leaves inside is split there.
    A prefix equal to the one inserted just before it (a group's completions after their
    prompt) takes that one's path at once, after one ``memcmp`` against a copy of it; the
    copy is made only when the next prefix has the same length.

    Args:
        root: the trie's root (its ``count`` counts the inserted prefixes).
        batch: the batch.
        seqs: the sequences to insert, in increasing order (``minseq`` relies on it).
        shareable: [S] per sequence, the length of the prefix to insert.
    """
    last: bytes | None = None  # the previous prefix's records, when this one may repeat it
    path: list[_TrieNode] = []  # the nodes the previous prefix went through, root to its end
    for at, s in enumerate(seqs):
        sh = shareable[s]
        buf, ids, w = _record_views(batch, s, sh)
        stop = sh * w
        if last is not None and len(last) == stop and last.startswith(buf[:stop]):
            for v in path:
                v.count += 1
            path[-1].terminals.append(s)
            continue
        path = [root]
        node = root
        node.count += 1
        pos = 0
        while True:
            if pos == sh:
                node.terminals.append(s)
                break
            first = ids[pos]
            child = node.children.get(first)
            if child is None:
                child = node.children[first] = _TrieNode(bytes(buf[pos * w : stop]), pos, sh, s, True)
                path.append(child)
                break
            e = child.end - child.start
            if sh - pos >= e and child.label.startswith(buf[pos * w : (pos + e) * w]):
                child.count += 1
                node = child
                path.append(node)
                pos += e
                continue
            # Diverges inside the edge (or the sequence ends inside it): split it.
            m = min(e, sh - pos)
            a = np.frombuffer(child.label, dtype=np.uint8, count=m * w)
            b = np.frombuffer(buf, dtype=np.uint8, count=m * w, offset=pos * w)
            diff = a != b
            k = int(np.argmax(diff)) // w if diff.any() else m
            mid = _TrieNode(child.label[: k * w], child.start, child.start + k, child.minseq)
            mid.count = child.count + 1
            child.label = child.label[k * w :]
            child.start += k
            mid.children[_first_key(child, w)] = child
            node.children[first] = mid
            path.append(mid)
            if pos + k == sh:
                mid.terminals.append(s)
            else:
                tail = mid.children[ids[pos + k]] = _TrieNode(bytes(buf[(pos + k) * w : stop]), pos + k, sh, s, True)
                path.append(tail)
            break
        last = bytes(buf[:stop]) if at + 1 < len(seqs) and shareable[seqs[at + 1]] == sh else None


def _cut_scored_branches(root: _TrieNode, batch: SequenceBatch) -> None:
    """Generalized mode: give back the last position of each branch node it may not share.

    Where sequences diverge at position q (or some end at q while others go on), position
    q - 1 predicts different next tokens; if it is scored for any sequence going on (its
    token q is trainable) the sharers do not agree on what it predicts, so the node ends
    one position earlier and that position opens each child (shared inside the child,
    whose sequences all agree on token q) and each ending sequence's leaf.
    """
    pre: list[_TrieNode] = []
    stack = [root]
    while stack:
        v = stack.pop()
        pre.append(v)
        stack.extend(v.children.values())
    below: dict[int, list[int]] = {}
    for v in reversed(pre):
        going_on: list[int] = []
        for c in v.children.values():
            going_on.extend(below.pop(id(c)))
        if v is not root and going_on and any(_trainable_at(batch, s, v.end) for s in going_on):
            v.end -= 1
        going_on.extend(v.terminals)
        below[id(v)] = going_on


def _trainable_at(batch: SequenceBatch, s: int, q: int) -> bool:
    if batch.trainable is None:
        assert batch.prompt_lens is not None  # one of trainable / prompt_lens is always set
        return q >= int(batch.prompt_lens[s])
    return bool(batch.trainable[s][q])


def _first_key(node: _TrieNode, w: int) -> int:
    if w == 4:
        return int.from_bytes(node.label[:4], "little")
    t = int.from_bytes(node.label[:4], "little")
    k = int.from_bytes(node.label[4:12], "little")
    return (k << 32) | t


def _emit_children(
    em: TreeEmitter, root: _TrieNode, loners: list[int], lens: np.ndarray, msl: int, saving: int
) -> None:
    """Emit the trie as tree nodes in pre-order, applying rule 4.

    Iterative DFS over frames of (remaining children, tree parent); a node's children are
    found by :func:`_final_children` and sorted by lowest sequence index.
    """
    lengths: list[int] = lens.tolist()
    if not root.children:  # nothing shared: every sequence a root leaf, in order
        em.leaves(-1, sorted(root.terminals + loners), 0, lengths)
        return
    frames = [(iter(_final_children(_ordered_items(root, loners), 0, msl, saving)), -1)]
    while frames:
        items, par = frames[-1]
        item = next(items, None)
        if item is None:
            frames.pop()
            continue
        _, kind, x, st = item
        if kind == 0:
            em.leaf(par, x, st, lengths[x])
            continue
        tn: _TrieNode = x
        me = em.node(par, st, tn.end, tn.minseq, tn.count)
        if tn.children:
            frames.append((iter(_final_children(_ordered_items(tn, []), tn.end, msl, saving)), me))
        else:  # only sequences end here (a GRPO prompt's completions): its leaves, in order
            em.leaves(me, tn.terminals, tn.end, lengths)


def _final_children(items: list[tuple[int, Any]], start: int, msl: int, saving: int) -> list[tuple[int, int, Any, int]]:
    """The tree children under a node ending at ``start``, as (min seq, kind, x, start).

    A trie node whose run from ``start`` may not be shared (:func:`shares_run`: shorter than
    ``msl`` and, with the saving option, saving too little) creates no node (rule 4):
    its own children take its place, from the same ``start``, so the short run stays in
    each descendant's segment. A trie node with one sequence is that sequence's leaf.
    """
    out: list[tuple[int, int, Any, int]] = []
    todo = list(reversed(items))
    while todo:
        kind, x = todo.pop()
        if kind == 0:
            out.append((x, 0, x, start))
            continue
        tn: _TrieNode = x
        if tn.count == 1:
            out.append((tn.terminals[0], 0, tn.terminals[0], start))
        elif shares_run(tn.end - start, tn.count, msl, saving):
            out.append((tn.minseq, 1, tn, start))
        else:
            todo.extend(reversed(_ordered_items(tn, [])))
    out.sort(key=lambda t: t[0])
    return out


def _ordered_items(tn: _TrieNode, extra: list[int]) -> list[tuple[int, Any]]:
    """Children of a trie node and sequences ending there (plus ``extra``), by lowest sequence index."""
    kids = list(tn.children.values())
    terms = sorted(tn.terminals + extra) if extra else tn.terminals
    if not terms:
        return [(1, c) for c in kids]
    if not kids:
        return [(0, s) for s in terms]
    out: list[tuple[int, Any]] = []
    i = j = 0
    while i < len(kids) or j < len(terms):
        if j == len(terms) or (i < len(kids) and kids[i].minseq < terms[j]):
            out.append((1, kids[i]))
            i += 1
        else:
            out.append((0, terms[j]))
            j += 1
    return out


def flat_tree(batch: SequenceBatch) -> Tree:
    """The tree without sharing: every kept sequence a root leaf (for ``no_share``)."""
    em = TreeEmitter(batch.num_sequences)
    for s in np.flatnonzero(batch.kept).tolist():
        em.leaf(-1, s, 0, int(batch.lens[s]))
    return em.finish(0)
