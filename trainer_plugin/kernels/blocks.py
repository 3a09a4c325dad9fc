"""The tree mask as a FlexAttention ``BlockMask``: only the blocks holding a visible pair (SPEC 8).

Mask contract (:mod:`~treepack.trainer.kernels.masks`): query i may attend key j iff
``j <= i and i < subtree_end[j]``, with a sliding window w also
``position_ids[i] - position_ids[j] < w`` and with a chunk size c also
``position_ids[i] // c == position_ids[j] // c``.

- :func:`block_mask`: the ``BlockMask`` from per-token integers (``subtree_end``,
  ``position_ids`` and the window's or chunk's key floor :func:`key_floor`), never from a
  dense L x L mask nor a per-pair evaluation: exactly the blocks with a visible pair are
  listed, and exactly those whose every pair is visible are marked full, windows and chunks
  included (the arguments are in the docstrings).
- :func:`naive_block_mask`: the reference, FlexAttention's ``create_block_mask`` evaluating
  :func:`tree_mask_mod` on every (query, key) pair.
"""

from __future__ import annotations

from typing import Any

import torch

from treepack.proto.errors import RequestError

__all__ = ["block_mask", "naive_block_mask", "key_floor", "tree_mask_mod", "check_chunk"]


def check_chunk(chunk_size: int | None) -> None:
    """Refuse a chunk size that is not a positive int (None: no chunking)."""
    if chunk_size is not None and (isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1):
        raise RequestError(f"chunk_size must be a positive int, got {chunk_size!r}", path="$.chunk_size", rule="range")


def tree_mask_mod(
    subtree_end: torch.Tensor,
    position_ids: torch.Tensor | None = None,
    sliding_window: int | None = None,
    chunk_size: int | None = None,
) -> Any:
    """FlexAttention ``mask_mod`` of the contract, reading ``subtree_end`` (and positions).

    Args:
        subtree_end: [K, Lp] int64, Lp >= L; entries past L must be 0 (nothing visible).
        position_ids: [K, Lp] int64, needed with a sliding window or a chunk size.
        sliding_window: optional window w.
        chunk_size: optional chunk size c (same chunk of positions only).
    """
    w = None if sliding_window is None else int(sliding_window)
    c = None if chunk_size is None else int(chunk_size)

    def mask_mod(b, h, q_idx, kv_idx):
        ok = (kv_idx <= q_idx) & (q_idx < subtree_end[b, kv_idx])
        if w is not None:
            ok = ok & ((position_ids[b, q_idx] - position_ids[b, kv_idx]) < w)
        if c is not None:
            ok = ok & ((position_ids[b, q_idx] // c) == (position_ids[b, kv_idx] // c))
        return ok

    return mask_mod


def _padded(x: torch.Tensor, length: int, fill: int) -> torch.Tensor:
    out = torch.full((x.shape[0], length), fill, dtype=x.dtype, device=x.device)
    out[:, : x.shape[1]] = x
    return out


def _block_lists(m: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[K, nq, nk] bool -> (num [K, 1, nq] int32, indices [K, 1, nq, nk] int32, true blocks first in order)."""
    num = m.sum(-1, dtype=torch.int32)
    idx = torch.argsort((~m).to(torch.int8), dim=-1, stable=True).to(torch.int32)
    return num[:, None], idx[:, None]


def key_floor(
    subtree_end: torch.Tensor,
    position_ids: torch.Tensor,
    sliding_window: int | None = None,
    chunk_size: int | None = None,
) -> torch.Tensor | None:
    """[K, L] int64 the first row index each query may see under a window or a chunk.

    On a tree row a query i's keys are its ancestor chain, which holds its sequence's
    positions 0 .. position_ids[i] in increasing row order (a parent segment precedes its
    children, and a child starts one position after its parent ends). A window w or a chunk
    size c cuts that chain at one position ``p_i`` (``position_ids[i] - w + 1``, or the
    chunk's first position, the later of both), so the keys the query may see are exactly
    its chain's tokens at row index ``>= lo_i``, where ``lo_i`` is the chain's token at
    position ``p_i``: the last token at or before i holding position ``p_i`` (any earlier
    token at that position lies in a subtree that closed before i's branch began). One
    sort of (position, index) per row and one binary search per token find it.

    Args:
        subtree_end: [K, L] int64 the rows' subtree ends (padding ``i + 1``).
        position_ids: [K, L] int64 positions (padding 0).
        sliding_window, chunk_size: as :func:`dense_mask`; both None gives None.

    Returns:
        [K, L] int64 ``lo``, or None when there is neither a window nor a chunk, or when the
        rows do not have the layout above (every chain holding positions 0 .. p, checked:
        ``lo_i`` found on i's chain and every chain of ``position_ids[i] + 1`` tokens).
    """
    if sliding_window is None and chunk_size is None:
        return None
    K, L = position_ids.shape
    pos = position_ids.long()
    want = torch.zeros_like(pos)
    if sliding_window is not None:
        want = torch.maximum(want, pos - int(sliding_window) + 1)
    if chunk_size is not None:
        want = torch.maximum(want, pos - pos % int(chunk_size))
    idx = torch.arange(L, device=pos.device).expand(K, L)
    sorted_key, order = torch.sort(pos * L + idx, dim=1)
    at = torch.searchsorted(sorted_key, want * L + idx, right=True) - 1
    lo = order.gather(1, at.clamp(min=0))
    found = (at >= 0) & (pos.gather(1, lo) == want) & (lo <= idx) & (subtree_end.gather(1, lo) > idx)
    # Tokens whose subtree closed at or before i: |chain(i)| = i + 1 - #{j : subtree_end[j] <= i}.
    closed = torch.zeros(K, L + 1, dtype=torch.int64, device=pos.device)
    closed.scatter_add_(1, subtree_end.long().clamp(0, L), torch.ones_like(pos))
    chain = idx + 1 - closed.cumsum(1)[:, :L]
    if not bool((found & (chain == pos + 1)).all()):
        return None
    return lo


def _touched(se_max: torch.Tensor, lo: torch.Tensor | None, nb: int, block_size: int, L: int) -> torch.Tensor:
    """[K, nb, nb] bool: the (query block, key block) pairs holding at least one visible pair.

    Without ``lo`` (the tree alone): the union of the intervals ``[j, subtree_end[j])`` over
    a key block [k0, k1) is ``[k0, max subtree_end)``, as the j cover the block without
    gaps; a query block [q0, q1) meets it iff ``k0 < q1`` and ``max subtree_end > q0``.

    With ``lo`` (:func:`key_floor`): a key block strictly before the query block is
    visible to query i iff i's chain has a token in it (``i < max subtree_end``: every
    j <= k1 - 1 < i with ``subtree_end[j] > i`` is on the chain) and that token is at or
    after ``lo_i``; since ``lo_i`` is itself on the chain, that holds iff
    ``lo_i <= k1 - 1``. So the pair is touched iff the smallest ``lo_i`` over the queries
    ``q0 .. min(q1, max subtree_end) - 1`` is ``<= k1 - 1``: a prefix minimum of ``lo``
    inside each query block, read once per block pair. A diagonal block always holds the
    query itself.
    """
    dev = se_max.device
    K = se_max.shape[0]
    start = torch.arange(nb, device=dev) * block_size
    end = torch.clamp(start + block_size, max=L)
    q0, q1 = start[None, :, None], end[None, :, None]
    k0 = start[None, None, :]
    tree = (k0 < q1) & (se_max[:, None, :] > q0)
    if lo is None:
        return tree
    Lp = nb * block_size
    prefix_min = _padded(lo, Lp, Lp).view(K, nb, block_size).cummin(-1).values  # [K, nq, bs]
    last = torch.minimum(q1, se_max[:, None, :]) - 1 - q0  # [K, nq, nk] offset of the last query reached
    reach = prefix_min.gather(2, last.clamp(0, block_size - 1))
    below = (k0 + block_size <= q0) & (reach <= k0 + block_size - 1)
    return tree & (below | (k0 == q0))


def block_mask(
    subtree_end: torch.Tensor,
    position_ids: torch.Tensor | None = None,
    *,
    block_size: int = 128,
    sliding_window: int | None = None,
    chunk_size: int | None = None,
) -> Any:
    """FlexAttention ``BlockMask`` of the tree mask, O(L log L + (L / block)^2) work per row.

    Only blocks holding a visible pair are listed (:func:`_touched`); a block is full (no
    ``mask_mod`` needed) iff every pair in it is visible: ``k1 - 1 <= q0`` (causal),
    ``min subtree_end >= q1`` (every key an ancestor of every query) and, under a window or
    a chunk, ``max lo <= k0`` (every key at or after every query's floor, :func:`key_floor`);
    neither block may reach past L. Both sets are exact: the same as FlexAttention's
    ``create_block_mask`` evaluating every pair (:func:`naive_block_mask`), from per-token
    integers only. Rows without a plan's layout under a window or a chunk (see
    :func:`key_floor`) keep every block the tree touches and mark none full.

    Args:
        subtree_end: [K, L] int64 the rows' subtree ends.
        position_ids: [K, L] int64, needed with a sliding window or a chunk size.
        block_size: FlexAttention's sparse block size (both axes).
        sliding_window: optional window w.
        chunk_size: optional chunk size c (Llama4 chunked attention).

    Returns:
        ``torch.nn.attention.flex_attention.BlockMask`` for [K, 1, L, L].
    """
    check_chunk(chunk_size)
    from torch.nn.attention.flex_attention import BlockMask

    K, L = subtree_end.shape
    nb = -(-L // block_size)
    Lp = nb * block_size
    dev = subtree_end.device
    positional = sliding_window is not None or chunk_size is not None
    assert position_ids is not None or not positional, "a sliding window or a chunk size needs position_ids"
    lo = key_floor(subtree_end, position_ids, sliding_window, chunk_size) if position_ids is not None else None
    se = _padded(subtree_end, Lp, 0)
    blocks_max = se.view(K, nb, block_size).amax(-1)
    blocks_min = _padded(subtree_end, Lp, Lp + 1).view(K, nb, block_size).amin(-1)
    start = torch.arange(nb, device=dev) * block_size
    end = torch.clamp(start + block_size, max=L)
    touched = _touched(blocks_max, lo, nb, block_size, L)
    full = (end[None, None, :] - 1 <= start[None, :, None]) & (blocks_min[:, None, :] >= end[None, :, None])
    # A block reaching past L is never full: out-of-range pairs then go through mask_mod
    # (which sees subtree_end 0 there) instead of relying on the kernel's bounds checks.
    whole = start + block_size <= L
    full &= whole[None, :, None] & whole[None, None, :]
    if positional:
        if lo is None:
            full = torch.zeros_like(full)
        else:
            lo_max = _padded(lo, Lp, Lp).view(K, nb, block_size).amax(-1)
            full &= lo_max[:, :, None] <= start[None, None, :]
    full &= touched
    partial = touched & ~full
    kv_num, kv_idx = _block_lists(partial)
    full_num, full_idx = _block_lists(full)
    pos = _padded(position_ids, Lp, 0) if positional and position_ids is not None else None
    return BlockMask.from_kv_blocks(
        kv_num,
        kv_idx,
        full_num,
        full_idx,
        BLOCK_SIZE=block_size,
        mask_mod=tree_mask_mod(se, pos, sliding_window, chunk_size),
        seq_lengths=(L, L),
    )


def naive_block_mask(
    subtree_end: torch.Tensor,
    position_ids: torch.Tensor | None = None,
    *,
    block_size: int = 128,
    sliding_window: int | None = None,
    chunk_size: int | None = None,
) -> Any:
    """Reference for :func:`block_mask` (same arguments): FlexAttention's own
    ``create_block_mask``, which evaluates ``mask_mod`` on every (query, key) pair."""
    from torch.nn.attention.flex_attention import create_block_mask

    K, L = subtree_end.shape
    nb = -(-L // block_size)
    se = _padded(subtree_end, nb * block_size, 0)
    pos = _padded(position_ids, nb * block_size, 0) if position_ids is not None else None
    mod = tree_mask_mod(se, pos, sliding_window, chunk_size)
    return create_block_mask(mod, K, None, L, L, device=subtree_end.device, BLOCK_SIZE=block_size)
