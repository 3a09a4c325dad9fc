"""A proven lower bound on the rows any placement needs (SPEC section 4).

:func:`lower_bound_rows` returns ``max(L1, L2, L3, L4)``:

- **L1 = ceil(T / C)**, T the tree's token count: every tree token lies in some row.
- **L2, the duplication bound.** A row that holds any token of the subtree below node v
  holds v's whole root path too (rows are ancestor-closed), i.e. ``end(v)`` tokens, so it
  has at most ``C - end(v)`` tokens for v's descendants. Those descendants hold
  ``D(v) = S(v) - len(v)`` tokens (S = subtree size), each in at least one row, hence v sits
  in at least ``k(v) = ceil(D(v) / (C - end(v)))`` rows; and in at least as many rows as
  any of its children, so ``K(v) = max(k(v), max over children K(c), 1)``. Distinct rows
  hold distinct copies, so the rows together hold at least ``sum over v of len(v) * K(v)``
  tokens, and ``L2 = ceil(that / C)``. L2 >= L1 since K >= 1.
- **L3, the big-leaf bound** (:func:`big_leaf_rows`), for leaves that cannot share a row:
  the classic "items over half a bin need a bin each", and its generalisation to "items
  over 1/(q+1) of a bin, at most q per bin", measured below every branch point.

  Fix a threshold t and call a leaf *big* when its sequence length ``e(l) >= t``. Let
  ``G(v)`` be a lower bound on the number of rows that hold a big leaf of v's subtree. A
  big leaf gives ``G = 1``. Take an internal node u (or the virtual root above all trees,
  with ``end = 0``) and big leaves ``l_1..l_q`` from q *distinct* children of u in one row.
  Their paths below u are disjoint and each has ``e(l_i) - end(u) >= t - end(u)`` tokens,
  so the row holds at least ``end(u) + q * (t - end(u))`` tokens; with at most C of them,
  ``q <= Q(u) = floor((C - end(u)) / (t - end(u)))`` when ``t > end(u)`` (unbounded
  otherwise). Let ``X_c`` be the rows holding a big leaf of child c's subtree,
  ``|X_c| >= G(c)``; a row lies in at most ``Q(u)`` of the ``X_c``, so
  ``|union X_c| >= sum |X_c| / Q(u)``, and ``|union X_c| >= max |X_c|``. Hence

      G(u) = max(max_c G(c), ceil(sum_c G(c) / Q(u))).

  ``L3 = max over t of G(virtual root)``. With ``Q = 1`` this is "one row per leaf over
  half of what is left below u"; ``Q = 2`` is the thirds rule, and so on. Any t gives a
  valid bound, so only a few are tried: just above ``C / (q+1)`` at the root, just
  above ``end(u) + (C - end(u)) / (q+1)`` for the branch points u with the most children,
  and the shortest leaf's length, which makes every leaf big: at most ``Q(u)`` leaves of
  distinct children of u in a row, the count bound (1,024 unshared 80-token sequences in
  rows of 8,192 need ``ceil(1024 / 102) = 11`` rows, where the tokens say 10).

- **L4, Martello and Toth's L2 below a branch point** (:func:`leaf_children_rows`). The
  leaves that are children of one node u (or root leaves, below the virtual root) are
  indivisible items: a row holding some of them holds u's root path (``end(u)`` tokens)
  and each leaf's own segment, which no other of them shares, so their lengths add up to
  at most ``C_u = C - end(u)`` per row. Restricted to them, any placement is a classical
  bin packing with bins of ``C_u``, and Martello and Toth's bound applies: for any
  ``0 <= k <= C_u / 2``, items over ``C_u - k`` (J1) and items in ``(C_u/2, C_u - k]``
  (J2) need a row each, and items in ``[k, C_u/2]`` (J3) fit only in the room J2 leaves
  plus new rows: ``|J1| + |J2| + max(0, ceil((sum J3 - (|J2| C_u - sum J2)) / C_u))``.
  It is only computed where u has more leaf children than the other bounds' rows.

All are computed in O(nodes) numpy passes (L3: one pass for all thresholds at once; L4:
one sort per qualifying node). :func:`naive_min_copies` and :func:`naive_big_leaf_rows` are
the loop-based references, a node at a time, that the tests hold the fast ones to.
"""

from __future__ import annotations

import numpy as np

from treepack.proto.index import accumulate_up, ragged_arange
from treepack.service.planner.tree import Tree

__all__ = [
    "lower_bound_rows",
    "subtree_sizes",
    "min_copies",
    "naive_min_copies",
    "big_leaf_rows",
    "naive_big_leaf_rows",
    "big_leaf_thresholds",
    "leaf_children_rows",
    "bin_packing_l2",
]

ROOT_SPLITS = 6  # root thresholds just above C/2, C/3, ..., C/(ROOT_SPLITS+1)
NODE_SPLITS = 2  # per chosen branch point: just above half and a third of the room below it
NODES = 8  # branch points (most children first) that get their own thresholds


def subtree_sizes(tree: Tree) -> np.ndarray:
    """[N] int64 tokens in each node's subtree (the node included)."""
    return accumulate_up(tree.length.astype(np.int64), tree.parent, tree.depth)


def min_copies(tree: Tree, seq_len: int, size: np.ndarray | None = None) -> np.ndarray:
    """[N] int64 K(v): a proven minimum number of rows holding node v (module docstring)."""
    if size is None:
        size = subtree_sizes(tree)
    end = tree.end
    desc = size - tree.length
    room = np.maximum(seq_len - end, 1)
    k = np.where(desc > 0, -(-desc // room), 1)
    return accumulate_up(np.maximum(k, 1), tree.parent, tree.depth, np.maximum)


def naive_min_copies(tree: Tree, seq_len: int) -> np.ndarray:
    """:func:`min_copies`, one node at a time, deepest first (the reference).

    Returns:
        [N] int64 ``K(v) = max(ceil(D(v) / (C - end(v))), K(children), 1)`` (module docstring).
    """
    parent, length, end = tree.parent.tolist(), tree.length.tolist(), tree.end.tolist()
    below = [0] * tree.num_nodes  # D(v): tokens strictly below v
    copies = [1] * tree.num_nodes
    for v in sorted(range(tree.num_nodes), key=lambda x: -int(tree.depth[x])):
        room = max(seq_len - end[v], 1)
        copies[v] = max(copies[v], -(-below[v] // room))
        if parent[v] >= 0:
            below[parent[v]] += length[v] + below[v]
            copies[parent[v]] = max(copies[parent[v]], copies[v])
    return np.asarray(copies, dtype=np.int64)


def big_leaf_thresholds(tree: Tree, seq_len: int) -> np.ndarray:
    """[T] int64 the thresholds t that :func:`lower_bound_rows` tries for L3 (module docstring)."""
    C = int(seq_len)
    ts = [C // (q + 1) + 1 for q in range(1, ROOT_SPLITS + 1)]
    leaves = tree.leaf_of[tree.leaf_of >= 0]
    if leaves.size:
        ts.append(max(int(tree.end[leaves].min()), 1))  # every leaf big: the count bound
    inner = np.flatnonzero(tree.sharers >= 2)
    if inner.size:
        kids = np.bincount(tree.parent[tree.parent >= 0], minlength=tree.num_nodes)[inner]
        top = inner[np.argsort(-kids, kind="stable")[:NODES]]
        for e in np.unique(tree.end[top]).tolist():
            ts += [e + (C - e) // (q + 1) + 1 for q in range(1, NODE_SPLITS + 1) if e < C]
    return np.unique(np.asarray(ts, dtype=np.int64))


def big_leaf_rows(tree: Tree, seq_len: int, thresholds: np.ndarray) -> np.ndarray:
    """[T] int64 L3's ``G(virtual root)`` for each threshold t (module docstring).

    Args:
        tree: the batch's tree.
        seq_len: row capacity C.
        thresholds: [T] int64 thresholds t >= 1.

    Returns:
        [T] int64 proven minimum rows for each t.
    """
    t = np.asarray(thresholds, dtype=np.int64)[None, :]
    C = int(seq_len)
    leaves = tree.leaf_of[tree.leaf_of >= 0]
    big = leaves[tree.end[leaves] >= t.min(initial=C + 1)]
    if big.size == 0:
        return np.zeros(t.shape[1], dtype=np.int64)
    # Only the paths of leaves over the smallest threshold count: everything else is 0.
    seqs = tree.source[big]
    counts = tree.path_ptr[seqs + 1] - tree.path_ptr[seqs]
    on_path = np.zeros(tree.num_nodes, dtype=bool)  # a mask, not np.unique: no sort of the paths
    on_path[tree.path_nodes[np.repeat(tree.path_ptr[seqs], counts) + ragged_arange(counts)]] = True
    nodes = np.flatnonzero(on_path)
    local = np.full(tree.num_nodes, -1, dtype=np.int64)
    local[nodes] = np.arange(nodes.shape[0])
    end = tree.end[nodes]
    depth = tree.depth[nodes]
    parent = local[np.maximum(tree.parent[nodes], 0)]
    g = np.zeros((nodes.shape[0], t.shape[1]), dtype=np.int64)
    g[local[big]] = tree.end[big][:, None] >= t

    def fold(children: np.ndarray, e_u: np.ndarray, starts: np.ndarray) -> np.ndarray:
        s = np.add.reduceat(g[children], starts, axis=0)
        m = np.maximum.reduceat(g[children], starts, axis=0)
        gap = t - e_u[:, None]
        q = np.where(gap > 0, (C - e_u[:, None]) // np.maximum(gap, 1), 0)
        q = np.where(gap > 0, np.maximum(q, 1), np.iinfo(np.int64).max)
        return np.maximum(m, -(-s // q))

    # Pre-order: a level's nodes, in index order, come grouped by parent.
    for d in range(int(depth.max(initial=0)), 0, -1):
        at = np.flatnonzero(depth == d)
        par = parent[at]
        starts = np.flatnonzero(np.r_[True, par[1:] != par[:-1]])
        g[par[starts]] = fold(at, end[par[starts]], starts)
    roots = np.flatnonzero(depth == 0)
    return fold(roots, np.zeros(1, dtype=np.int64), np.zeros(1, dtype=np.int64))[0]


def naive_big_leaf_rows(tree: Tree, seq_len: int, thresholds: np.ndarray) -> np.ndarray:
    """:func:`big_leaf_rows`, one threshold and one node at a time, deepest first (the reference)."""
    C = int(seq_len)
    end, parent = tree.end.tolist(), tree.parent.tolist()
    leaves = set(tree.leaf_of[tree.leaf_of >= 0].tolist())
    order = sorted(range(tree.num_nodes), key=lambda x: -int(tree.depth[x]))
    out = []
    for t in np.asarray(thresholds, dtype=np.int64).tolist():

        def fold(kids: list[int], e: int) -> int:
            """G of a node ending at e whose children have these G (module docstring)."""
            if not kids:
                return 0
            if t <= e:  # every big leaf below shares this node's whole room: no limit per row
                return max(kids)
            per_row = max((C - e) // (t - e), 1)
            return max(max(kids), -(-sum(kids) // per_row))

        kids: list[list[int]] = [[] for _ in range(tree.num_nodes)]
        roots: list[int] = []
        for v in order:
            g = int(end[v] >= t) if v in leaves else fold(kids[v], end[v])
            (kids[parent[v]] if parent[v] >= 0 else roots).append(g)
        out.append(fold(roots, 0))
    return np.asarray(out, dtype=np.int64)


def bin_packing_l2(sizes: np.ndarray, capacity: int) -> int:
    """Martello and Toth's L2 lower bound on the bins of ``capacity`` that ``sizes`` need.

    Args:
        sizes: [m] int64 item sizes, each <= capacity.
        capacity: bin size.

    Returns:
        ``max over k`` of the bound in the module docstring (L4); 0 for no items.
    """
    if sizes.size == 0:
        return 0
    if capacity <= 0:  # a branch point at C: only empty leaves below it, one row holds them all
        return 1
    s = np.sort(sizes)
    pre = np.r_[0, np.cumsum(s)]
    half = capacity // 2  # items <= half: s <= C/2 (integers)
    ks = np.unique(np.r_[0, s[s <= half]])
    n_big = s.size - np.searchsorted(s, half, side="right")  # J1 + J2: items > C/2
    cut = np.searchsorted(s, capacity - ks, side="right")  # items <= C - k
    j12_lo = np.searchsorted(s, half, side="right")  # first item > C/2
    j2_n = np.maximum(cut - j12_lo, 0)
    j2_sum = pre[np.maximum(cut, j12_lo)] - pre[j12_lo]
    j3_lo = np.searchsorted(s, ks, side="left")
    j3_sum = pre[j12_lo] - pre[j3_lo]
    extra = np.maximum(0, -(-(j3_sum - (j2_n * capacity - j2_sum)) // capacity))
    return int((n_big + extra).max())


def leaf_children_rows(tree: Tree, seq_len: int, above: int = 0) -> int:
    """L4 of the module docstring, over the nodes with more than ``above`` leaf children."""
    leaves = tree.leaf_of[tree.leaf_of >= 0]
    if leaves.size == 0:
        return 0
    par = tree.parent[leaves]
    slot = par + 1  # 0: the virtual root
    counts = np.bincount(slot, minlength=tree.num_nodes + 1)
    best = 0
    end = tree.end
    for u1 in np.flatnonzero(counts > max(above, 1)).tolist():
        mine = leaves[slot == u1]
        base = int(end[u1 - 1]) if u1 else 0
        best = max(best, bin_packing_l2(end[mine] - base, int(seq_len) - base))
    return best


def lower_bound_rows(tree: Tree, seq_len: int) -> int:
    """max(L1, L2, L3, L4) of the module docstring; 0 for an empty tree."""
    if tree.num_nodes == 0:
        return 0
    copies = min_copies(tree, seq_len)
    total = int((tree.length * copies).sum())
    l3 = int(big_leaf_rows(tree, seq_len, big_leaf_thresholds(tree, seq_len)).max(initial=0))
    best = max(int(-(-total // seq_len)), l3)
    return max(best, leaf_children_rows(tree, seq_len, above=best))
