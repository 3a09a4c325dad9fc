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
    p_seq, uniq, inv, cnt, src = _row_node_pairs(tree, row_of)
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
    seg_parent = _segment_parents(tree, uniq, seg_of_pair, seg_row, k_node[first])
    seg_depth = forest_depth(seg_parent)

    row_ptr = np.zeros(num_rows + 1, dtype=np.int64)
    np.cumsum(np.bincount(seg_row, minlength=num_rows), out=row_ptr[1:])
    csum = np.cumsum(seg_len) - seg_len
    seg_row_start = csum - csum[row_ptr[seg_row]] if g else csum
    sub = accumulate_up(seg_len, seg_parent, seg_depth)
    row_len = np.bincount(seg_row, weights=seg_len, minlength=num_rows).astype(np.int64)
    seq_ptr, seq_segs = _sequence_segments(seg_of_pair[inv], p_seq, row_of.shape[0])
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


def _row_node_pairs(
    tree: Tree, row_of: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The (row, node) pairs the placed sequences' paths make, each once.

    Args:
        tree: the tree.
        row_of: [S] int64 row of each sequence, -1 for dropped ones.

    Returns:
        ``(p_seq, uniq, inv, cnt, src)``: [P] the sequence of each path entry (placed
        sequences in order, each root to leaf); [U] the pairs as ``row * N + node``, sorted
        (so by row, then in pre-order); [P] each path entry's pair; [U] sequences through
        each pair; [U] the row's own source of each pair (its lowest sequence through the node).
    """
    seqs = np.flatnonzero(row_of >= 0)
    plen = tree.path_ptr[seqs + 1] - tree.path_ptr[seqs]
    p_node = csr_gather(tree.path_ptr, tree.path_nodes, seqs)
    p_seq = np.repeat(seqs, plen)
    key = row_of[p_seq] * tree.num_nodes + p_node
    # A pair's first path entry (np.unique's index: a stable sort) has its lowest sequence:
    # p_seq never decreases along the paths. (np.minimum.at did the same several times slower.)
    uniq, first, inv, cnt = np.unique(key, return_index=True, return_inverse=True, return_counts=True)
    return p_seq, uniq, inv, cnt, p_seq[first]


def _segment_parents(
    tree: Tree, uniq: np.ndarray, seg_of_pair: np.ndarray, seg_row: np.ndarray, first_node: np.ndarray
) -> np.ndarray:
    """[G] int64 parent segment of each segment: the segment of its first node's parent in its row, -1 for roots.

    Args:
        tree: the tree.
        uniq: [U] the sorted (row, node) pairs as ``row * N + node``.
        seg_of_pair: [U] segment of each pair, -1 for empty leaves.
        seg_row: [G] row of each segment.
        first_node: [G] the first (shallowest) node of each segment's run.
    """
    par_node = tree.parent[first_node]
    has_par = par_node >= 0
    seg_parent = np.full(first_node.shape[0], -1, dtype=np.int64)
    if has_par.any():
        pk = seg_row[has_par] * tree.num_nodes + par_node[has_par]
        seg_parent[has_par] = seg_of_pair[np.searchsorted(uniq, pk)]
    return seg_parent


def _sequence_segments(p_seg: np.ndarray, p_seq: np.ndarray, num_seqs: int) -> tuple[np.ndarray, np.ndarray]:
    """Each sequence's segments: its path entries' segments, with consecutive duplicates
    (merged runs) and empty leaves removed.

    Args:
        p_seg: [P] segment of each path entry, -1 for an empty leaf.
        p_seq: [P] sequence of each path entry.
        num_seqs: S.

    Returns:
        ``(seq_ptr, seq_segs)``: [S+1] CSR offsets and the segments, root to leaf.
    """
    p_new = p_seg >= 0
    if p_seg.shape[0] > 1:
        p_new[1:] &= ~((p_seg[1:] == p_seg[:-1]) & (p_seq[1:] == p_seq[:-1]))
    seq_segs = p_seg[p_new]
    seq_ptr = np.zeros(num_seqs + 1, dtype=np.int64)
    np.cumsum(np.bincount(p_seq[p_new], minlength=num_seqs), out=seq_ptr[1:])
    return seq_ptr, seq_segs
