"""Sparse top-k indexer attention on tree rows (DeepSeek-V3.2 DSA / GLM-5 style; SPEC 7).

DeepSeek Sparse Attention picks, for every query, the ``k`` keys with the highest
*lightning indexer* score and attends only to those. On a tree row three things must hold
for the packed run to equal each sequence's own run:

1. the indexer scores only keys the query may see (the mask contract: key j is visible
   to query i iff ``j <= i < subtree_end[j]``: i's own segment up to i and its ancestor
   chain), so a key of a sibling branch or another tree is never picked;
2. ties are broken the same way as alone: among equal scores the key with the *lower
   position in its sequence* wins (``position_ids``). Exact ties are common: the score
   is a weighted sum of ReLUs, exactly 0 whenever every head's dot product is negative;
3. picks that are not visible (a query that sees fewer than ``k`` keys) are dropped, not
   attended.

:func:`tree_topk` does 1-3 vectorized; :func:`naive_tree_topk` loops over queries and sorts
explicit ``(-score, position)`` pairs. :func:`sparse_attention` attends over the picked keys
by gathering them; :func:`naive_sparse_attention` is a dense masked softmax over the row.
"""

from __future__ import annotations

import torch

from treepack.proto.errors import InputTypeError, RequestError

__all__ = [
    "tree_visibility",
    "indexer_scores",
    "tree_topk",
    "shard_tree_topk",
    "naive_tree_topk",
    "sparse_attention",
    "naive_sparse_attention",
]


def tree_visibility(subtree_end: torch.Tensor) -> torch.Tensor:
    """[B, T, T] bool: ``vis[b, i, j] = j <= i < subtree_end[b, j]`` (the mask contract).

    Args:
        subtree_end: [B, T] int one past the end of each key's segment subtree.
    """
    T = subtree_end.shape[-1]
    i = torch.arange(T, device=subtree_end.device)
    return (i[None, None, :] <= i[None, :, None]) & (i[None, :, None] < subtree_end[:, None, :])


def indexer_scores(q: torch.Tensor, k: torch.Tensor, weights: torch.Tensor, softmax_scale: float) -> torch.Tensor:
    """The lightning indexer: ``score[b, s, t] = sum_h w[b, s, h] * relu(scale * q[b, s, h] . k[b, t])``.

    Args:
        q: [B, S, H, D] indexer queries (RoPE applied). k: [B, T, D] indexer keys (one head).
        weights: [B, S, H] per-head weights. softmax_scale: the dot-product scale.

    Returns:
        [B, S, T] float32 scores (unmasked).
    """
    s = torch.relu(torch.matmul(q.float(), k.float().transpose(-1, -2).unsqueeze(1)) * softmax_scale)  # [B, S, H, T]
    return torch.matmul(weights.float().unsqueeze(-2), s).squeeze(-2)


def _check_topk(scores: torch.Tensor, subtree_end: torch.Tensor, position_ids: torch.Tensor, k: int) -> None:
    for name, t in (("scores", scores), ("subtree_end", subtree_end), ("position_ids", position_ids)):
        if not isinstance(t, torch.Tensor):
            raise InputTypeError(f"expected a torch.Tensor, got {type(t).__name__}", path=f"$.{name}", rule="type")
    if scores.dim() != 3 or scores.shape[1] != scores.shape[2]:
        raise RequestError(
            f"scores must be [B, T, T] (queries are the row's own tokens), got {tuple(scores.shape)}",
            path="$.scores",
            rule="shape",
        )
    B, T = scores.shape[0], scores.shape[2]
    for name, t in (("subtree_end", subtree_end), ("position_ids", position_ids)):
        if t.shape != (B, T):
            raise RequestError(
                f"{name} must be [B, T] = {(B, T)}, got {tuple(t.shape)}", path=f"$.{name}", rule="shape"
            )
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise RequestError(f"k must be a positive int, got {k!r}", path="$.k", rule="range")


def tree_topk(
    scores: torch.Tensor,
    subtree_end: torch.Tensor,
    position_ids: torch.Tensor,
    k: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k visible keys per query, ties to the lower in-sequence position.

    Keys are first put in position order (stable), then stably sorted by score, so equal
    scores keep position order; invisible keys score -inf and sort last.

    Args:
        scores: [B, T, T] indexer scores (query, key) of a packed row.
        subtree_end: [B, T] the row's subtree ends (mask contract).
        position_ids: [B, T] each token's position in its own sequence.
        k: keys to pick (``index_topk``); at most T are returned.

    Returns:
        (idx [B, T, min(k, T)] int64 row index of each pick, best first;
         valid [B, T, min(k, T)] bool, False for picks that are not visible: drop them).
    """
    _check_topk(scores, subtree_end, position_ids, k)
    return _topk(scores, subtree_end, position_ids, k, 0)


def shard_tree_topk(
    scores: torch.Tensor,
    subtree_end: torch.Tensor,
    position_ids: torch.Tensor,
    k: int,
    *,
    query_start: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`tree_topk` for the queries of one context-parallel shard, over the whole row's keys.

    Each query's picks depend on its own scores and the keys' visibility only, so the rows
    equal :func:`tree_topk`'s rows ``query_start .. query_start + S - 1`` of the whole row.

    Args:
        scores: [B, S, T] indexer scores of queries ``query_start ..`` (positions at or past
            T are padding: nothing is visible to them) against the row's T keys.
        subtree_end, position_ids: [B, T] of the whole row. k: as :func:`tree_topk`.
        query_start: the row position of the first query.

    Returns:
        (idx [B, S, min(k, T)], valid [B, S, min(k, T)]) as :func:`tree_topk`.
    """
    if scores.dim() != 3:
        raise RequestError(f"scores must be [B, S, T], got {tuple(scores.shape)}", path="$.scores", rule="shape")
    T = scores.shape[2]
    square = scores.new_empty(1, 1, 1).expand(scores.shape[0], T, T)  # only its shape is checked
    _check_topk(square, subtree_end, position_ids, k)
    return _topk(scores, subtree_end, position_ids, k, int(query_start))


def _topk(
    scores: torch.Tensor, subtree_end: torch.Tensor, position_ids: torch.Tensor, k: int, query_start: int
) -> tuple[torch.Tensor, torch.Tensor]:
    S, T = scores.shape[1:]
    kk = min(k, T)
    j = torch.arange(T, device=subtree_end.device)
    i = torch.arange(query_start, query_start + S, device=subtree_end.device)
    vis = (j[None, None, :] <= i[None, :, None]) & (
        i[None, :, None] < subtree_end[:, None, :]
    )  # tree_visibility's rows i
    masked = scores.float().masked_fill(~vis, float("-inf"))
    by_pos = torch.argsort(position_ids, dim=-1, stable=True)  # [B, T]
    s_sorted = masked.gather(-1, by_pos[:, None, :].expand_as(masked))
    order = torch.sort(s_sorted, dim=-1, descending=True, stable=True).indices[..., :kk]
    idx = by_pos[:, None, :].expand(-1, S, -1).gather(-1, order)
    return idx, vis.gather(-1, idx)


def naive_tree_topk(
    scores: torch.Tensor,
    subtree_end: torch.Tensor,
    position_ids: torch.Tensor,
    k: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference for :func:`tree_topk`: per query, sort its visible keys by ``(-score, position)``.

    Slots past the visible count are padded with the query's own index and ``valid=False``.
    """
    _check_topk(scores, subtree_end, position_ids, k)
    B, T = scores.shape[0], scores.shape[-1]
    kk = min(k, T)
    idx = torch.empty(B, T, kk, dtype=torch.int64)
    valid = torch.zeros(B, T, kk, dtype=torch.bool)
    se, pos, sc = subtree_end.tolist(), position_ids.tolist(), scores.float().tolist()
    for b in range(B):
        for i in range(T):
            keys = [j for j in range(i + 1) if i < se[b][j]]
            keys.sort(key=lambda j: (-sc[b][i][j], pos[b][j]))
            keys = keys[:kk]
            idx[b, i] = torch.tensor(keys + [i] * (kk - len(keys)))
            valid[b, i, : len(keys)] = True
    return idx, valid


def _check_attn(q, k, v, idx, valid) -> None:
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise RequestError("q, k, v must be [B, H, T, D]", path="$.q", rule="shape")
    B, H, S, _ = q.shape
    if k.shape[0] != B or k.shape[1] == 0 or H % k.shape[1] or v.shape[:3] != k.shape[:3]:
        raise RequestError(
            f"k/v must be [B, Hk, T, D] with H={H} a multiple of Hk, got {tuple(k.shape)}, {tuple(v.shape)}",
            path="$.k",
            rule="shape",
        )
    if idx.shape[:2] != (B, S) or valid.shape != idx.shape:
        raise RequestError(
            f"idx/valid must be [B, S, k] with (B, S) = {(B, S)}, got {tuple(idx.shape)}, {tuple(valid.shape)}",
            path="$.idx",
            rule="shape",
        )


def sparse_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    idx: torch.Tensor,
    valid: torch.Tensor,
    scaling: float,
    *,
    block: int = 256,
) -> torch.Tensor:
    """Attention of each query over its picked keys only (gathered, never a [T, T] mask).

    Args:
        q: [B, H, S, D]. k: [B, Hk, T, D]. v: [B, Hk, T, Dv] (H a multiple of Hk).
        idx: [B, S, n] picked key indices. valid: [B, S, n] which picks count.
        scaling: logit scale.
        block: queries per gather (bounds memory to B * block * n * Hk * D).

    Returns:
        [B, S, H, Dv] in q's dtype (softmax in at least float32, as HF's eager attention).
    """
    _check_attn(q, k, v, idx, valid)
    B, H, S, _ = q.shape
    Hk = k.shape[1]
    kt, vt = k.transpose(1, 2), v.transpose(1, 2)  # [B, T, Hk, D]
    bidx = torch.arange(B, device=q.device)[:, None, None]
    outs = []
    for a in range(0, S, block):
        i, m = idx[:, a : a + block], valid[:, a : a + block]
        kg = kt[bidx, i].repeat_interleave(H // Hk, dim=3)  # [B, s, n, H, D]
        vg = vt[bidx, i].repeat_interleave(H // Hk, dim=3)
        qa = q[:, :, a : a + block]  # [B, H, s, D]
        logits = torch.einsum("bhsd,bsnhd->bhsn", qa, kg) * scaling
        logits = logits.masked_fill(~m[:, None], float("-inf"))
        p = torch.softmax(logits, dim=-1, dtype=torch.promote_types(q.dtype, torch.float32)).to(q.dtype)
        outs.append(torch.einsum("bhsn,bsnhd->bshd", p, vg))
    return torch.cat(outs, dim=1)


def naive_sparse_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    idx: torch.Tensor,
    valid: torch.Tensor,
    scaling: float,
) -> torch.Tensor:
    """Reference for :func:`sparse_attention`: dense softmax over the row, masked to the valid picks."""
    _check_attn(q, k, v, idx, valid)
    B, H, S, _ = q.shape
    T, Hk = k.shape[2], k.shape[1]
    keep = torch.zeros(B, S, T + 1, dtype=torch.bool, device=q.device)
    keep.scatter_(-1, torch.where(valid, idx, T), True)  # invalid picks land in a dropped column
    keep = keep[..., :T]
    kf, vf = k.repeat_interleave(H // Hk, dim=1), v.repeat_interleave(H // Hk, dim=1)
    logits = (q @ kf.transpose(-1, -2)) * scaling
    logits = logits.masked_fill(~keep[:, None], float("-inf"))
    p = torch.softmax(logits, dim=-1, dtype=torch.promote_types(q.dtype, torch.float32)).to(q.dtype)
    return (p @ vf).transpose(1, 2)
