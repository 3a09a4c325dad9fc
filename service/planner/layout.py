"""Row layout: from a placement to each row's segment table (SPEC section 3).

A row's content is the union of its leaves' root-to-leaf paths, laid out in DFS pre-order
(parents before children; siblings by lowest sequence index, the tree's order). Runs of
nodes that the same set of the row's sequences share (a node and its only child in the
row, with no sequence of the row ending between them) are merged into one segment, and
empty leaves are dropped. Everything is computed with numpy over (row, node) pairs; no
loop runs per token.
"""

from __future__ import annotations

import numpy as np

from treepack.proto.index import accumulate_up, csr_gather, forest_depth
from treepack.proto.plan import Segments
from treepack.service.planner.tree import Tree

__all__ = ["Segments", "layout_rows"]


def layout_rows(tree: Tree, row_of: np.ndarray, num_rows: int) -> Segments:
    """Lay out every row (SPEC section 3).

    Args:
        tree: the tree the placement used (for ``no_share``, a forest of single leaves).
        row_of: [S] int64 row of each sequence, -1 for dropped ones.
        num_rows: R.

    Returns:
        The :class:`Segments` of all rows.
    """
    n_nodes = tree.num_nodes
    seqs = np.flatnonzero(row_of >= 0)
    plen = tree.path_ptr[seqs + 1] - tree.path_ptr[seqs]
    p_node = csr_gather(tree.path_ptr, tree.path_nodes, seqs)
    p_seq = np.repeat(seqs, plen)
    p_row = row_of[p_seq]
    key = p_row * n_nodes + p_node
    uniq, inv, cnt = np.unique(key, return_inverse=True, return_counts=True)
    # The row's own source for each (row, node): its lowest sequence through the node.
    src = np.full(uniq.shape[0], np.iinfo(np.int64).max, dtype=np.int64)
    np.minimum.at(src, inv, p_seq)
    u_row = uniq // n_nodes
    u_node = uniq % n_nodes
    u_len = tree.length[u_node]
    keep = u_len > 0
    k_row, k_node, k_cnt, k_len, k_src = u_row[keep], u_node[keep], cnt[keep], u_len[keep], src[keep]
    same = np.zeros(k_row.shape[0], dtype=bool)
    if k_row.shape[0] > 1:
        same[1:] = (k_row[1:] == k_row[:-1]) & (tree.parent[k_node[1:]] == k_node[:-1]) & (k_cnt[1:] == k_cnt[:-1])
    seg_of_pair_kept = np.cumsum(~same) - 1
    g = int(seg_of_pair_kept[-1]) + 1 if seg_of_pair_kept.shape[0] else 0
    first = np.flatnonzero(~same)
    last = np.append(first[1:], k_row.shape[0]) - 1 if g else first
    seg_row = k_row[first]
    seg_len = np.add.reduceat(k_len, first) if g else np.zeros(0, dtype=np.int64)
    seg_seq = k_src[last]  # the deepest node's row source goes through every node of the run
    seg_seq_start = tree.start[k_node[first]]
    seg_sharers = k_cnt[first]

    # Map every (row, node) pair, empty leaves included, to its segment (-1 for empty).
    seg_of_pair = np.full(uniq.shape[0], -1, dtype=np.int64)
    seg_of_pair[np.flatnonzero(keep)] = seg_of_pair_kept
    first_node = k_node[first]
    par_node = tree.parent[first_node]
    has_par = par_node >= 0
    seg_parent = np.full(g, -1, dtype=np.int64)
    if has_par.any():
        pk = seg_row[has_par] * n_nodes + par_node[has_par]
        seg_parent[has_par] = seg_of_pair[np.searchsorted(uniq, pk)]
    seg_depth = forest_depth(seg_parent)

    row_ptr = np.zeros(num_rows + 1, dtype=np.int64)
    np.cumsum(np.bincount(seg_row, minlength=num_rows), out=row_ptr[1:])
    csum = np.cumsum(seg_len) - seg_len
    seg_row_start = csum - csum[row_ptr[seg_row]] if g else csum
    sub = accumulate_up(seg_len, seg_parent, seg_depth)
    row_len = np.bincount(seg_row, weights=seg_len, minlength=num_rows).astype(np.int64)

    # Each sequence's segments: its pairs' segments, consecutive duplicates (merged runs)
    # and empty leaves removed.
    p_seg = seg_of_pair[inv]
    p_new = p_seg >= 0
    if p_seg.shape[0] > 1:
        p_new[1:] &= ~((p_seg[1:] == p_seg[:-1]) & (p_seq[1:] == p_seq[:-1]))
    seq_segs = p_seg[p_new]
    seq_ptr = np.zeros(row_of.shape[0] + 1, dtype=np.int64)
    np.cumsum(np.bincount(p_seq[p_new], minlength=row_of.shape[0]), out=seq_ptr[1:])
    return Segments(
        row=seg_row,
        row_start=seg_row_start,
        length=seg_len,
        seq=seg_seq,
        seq_start=seg_seq_start,
        parent=seg_parent,
        depth=seg_depth,
        subtree_end=seg_row_start + sub,
        sharers=seg_sharers,
        row_ptr=row_ptr,
        row_len=row_len,
        seq_ptr=seq_ptr,
        seq_segs=seq_segs,
    )
