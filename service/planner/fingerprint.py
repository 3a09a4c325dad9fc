"""A planned batch's fingerprint: its :class:`~treepack.proto.shape.BatchShape` (no tokens).

The shape needs the planner's tree (node boundaries and sharers), so it is taken here; the
shape type, its run hash and the tokens made back from it are the contract's
(:mod:`treepack.proto.shape`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from treepack.proto.batch import SequenceBatch
from treepack.proto.index import csr_gather
from treepack.proto.shape import BatchShape, run_hash
from treepack.service.planner.api import PlanResult
from treepack.service.planner.tree import Tree, build_tree

__all__ = ["shape_of", "shape_job"]


def shape_of(batch: SequenceBatch, tree: Tree, *, seq_len: int, tags: Sequence[str | None] | None = None) -> BatchShape:
    """The shape of a planned batch (dropped sequences are left out).

    Args:
        batch: the batch as planned.
        tree: its tree (``PlanResult.tree``; a ``no_share`` plan's tree is the real one too).
            A shape always describes the default-mode tree: a tree built with
            ``share_trainable`` is rebuilt without it (trainable tokens are not recorded).
        seq_len: the capacity it was planned for.
        tags: per sequence of the request, a task tag or None.

    Returns:
        The :class:`BatchShape`.
    """
    if tree.share_trainable:
        tree = build_tree(batch, tree.min_shared_len)
    kept = np.flatnonzero(batch.kept)
    sh = batch.shareable_lens()
    n_nodes = tree.num_nodes
    is_leaf = np.zeros(n_nodes, dtype=bool)
    is_leaf[tree.leaf_of[kept]] = True
    # One hash per internal node (read from its source) and per leaf's shareable part.
    node_hash = np.zeros(n_nodes, dtype=np.uint64)
    starts, ends, srcs = tree.start.tolist(), tree.end.tolist(), tree.source.tolist()
    for v in range(n_nodes):
        s, a = srcs[v], starts[v]
        b = min(ends[v], int(sh[s])) if is_leaf[v] else ends[v]
        if b > a:
            key = None if batch.keys is None or batch.keys[s] is None else batch.keys[s][a:b]
            node_hash[v] = run_hash(batch.tokens[s][a:b], key)
    plen = tree.path_ptr[kept + 1] - tree.path_ptr[kept]
    entry = csr_gather(tree.path_ptr, tree.path_nodes, kept)
    entry_seq = np.repeat(kept, plen)
    leaf = is_leaf[entry] & (tree.leaf_of[entry_seq] == entry)
    length = tree.length[entry]
    share = np.where(leaf, np.clip(sh[entry_seq] - tree.start[entry], 0, length), length)
    tail = length - share
    # Each path entry yields its shareable run (if any) then, for a leaf, its tail (if any).
    n_runs = (share > 0).astype(np.int64) + (tail > 0)
    first = np.cumsum(n_runs) - n_runs
    total = int(n_runs.sum())
    r_hash = np.zeros(total, dtype=np.uint64)
    r_len = np.zeros(total, dtype=np.int64)
    has_share = share > 0
    r_hash[first[has_share]] = node_hash[entry[has_share]]
    r_len[first[has_share]] = share[has_share]
    has_tail = tail > 0
    r_len[first[has_tail] + has_share[has_tail]] = tail[has_tail]
    seq_runs = np.bincount(np.searchsorted(kept, entry_seq), weights=n_runs, minlength=kept.shape[0]).astype(np.int64)
    seq_ptr = np.zeros(kept.shape[0] + 1, dtype=np.int64)
    np.cumsum(seq_runs, out=seq_ptr[1:])
    labels = [batch.group_labels[c] for c in batch.group_codes[kept].tolist()]
    return BatchShape(
        seq_len=int(seq_len),
        min_shared_len=tree.min_shared_len,
        seq_ptr=seq_ptr,
        run_hash=r_hash,
        run_len=r_len,
        first_trainable=batch.first_trainable[kept].astype(np.int64),
        groups=tuple(labels),
        tags=None if tags is None else tuple(tags[i] for i in kept.tolist()),
    )


def shape_job(result: PlanResult, tags: Sequence[str | None] | None = None) -> Callable[[], BatchShape] | None:
    """A deferred :func:`shape_of` of a planned batch, for the history's writer thread;
    None when every sequence was dropped (nothing to record)."""
    batch, tree, seq_len = result.batch, result.tree, result.plan.seq_len
    if not batch.kept.any():
        return None
    return lambda: shape_of(batch, tree, seq_len=seq_len, tags=tags)
