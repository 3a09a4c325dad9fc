"""Block masks under sliding windows and chunks: exactly the blocks holding a visible pair.

``block_mask`` classifies blocks from per-token integers (``subtree_end``, ``position_ids``
and the key floor ``lo`` of :func:`key_floor`); FlexAttention's ``create_block_mask``
(``naive_block_mask``) evaluates every (query, key) pair. The two must list the same
partial blocks and the same full blocks on windowed, chunked and tree rows.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from treepack.service.planner import plan_batch
from treepack.trainer import materialize
from treepack.trainer.kernels.masks import block_mask, dense_mask, key_floor, naive_block_mask, naive_dense_mask

from helpers.trainer_cases import mixed_batch, plan_of, random_batch


def _batch(case):
    plan = plan_of(case)
    return materialize(plan, case["sequences"], trainable=case["trainable"], groups=case["groups"], advise=False)


def _block_sets(bm):
    """(partial, full) as dense [K, nq, nk] bool from a BlockMask's kv lists."""
    K, _, nq, nk = bm.kv_indices.shape
    rows = torch.arange(nk)[None, None, None, :]

    def dense(num, idx):
        listed = rows < num[..., None]  # [K, 1, nq, nk]: the first num entries are the blocks
        out = torch.zeros(K, nq, nk + 1, dtype=torch.bool)
        out.scatter_(2, torch.where(listed, idx.long(), nk)[:, 0], True)
        return out[..., :nk]

    return dense(bm.kv_num_blocks, bm.kv_indices), dense(bm.full_kv_num_blocks, bm.full_kv_indices)


def _token_mask(bm, K, L, block):
    """What FlexAttention computes from a BlockMask: full blocks, or partial blocks where mask_mod holds."""
    partial, full = _block_sets(bm)
    b = torch.arange(K)[:, None, None]
    mm = bm.mask_mod(b, 0, torch.arange(L)[None, :, None], torch.arange(L)[None, None, :])
    up = lambda m: m.repeat_interleave(block, 1).repeat_interleave(block, 2)[:, :L, :L]  # noqa: E731
    return up(full) | (up(partial) & mm)


windows = st.sampled_from([None, 1, 2, 3, 5, 8, 17])
chunks = st.sampled_from([None, 1, 2, 4, 7, 16])


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 2**31 - 1), st.sampled_from([1, 2, 4, 8, 16]), windows, chunks)
def test_block_mask_equals_every_pair(seed, block, window, chunk):
    """Partial and full blocks equal create_block_mask's on random trees, windows, chunks and block sizes."""
    batch = _batch(random_batch(seed))
    kw = dict(block_size=block, sliding_window=window, chunk_size=chunk)
    fast = block_mask(batch.subtree_end, batch.position_ids, **kw)
    ref = naive_block_mask(batch.subtree_end, batch.position_ids, **kw)
    fp, ff = _block_sets(fast)
    rp, rf = _block_sets(ref)
    assert torch.equal(fp, rp) and torch.equal(ff, rf)
    dense = dense_mask(batch.subtree_end, batch.position_ids, window, chunk)[:, 0]
    assert torch.equal(_token_mask(fast, batch.num_rows, batch.seq_len, block), dense)


def test_the_mixed_batch_prunes_and_fills_under_windows_and_chunks():
    """Hand-made rows (several trees, join tokens, padding): every block size, window and chunk exact,
    and the window leaves far fewer blocks than the tree alone, some of them full (not vacuous)."""
    batch = _batch(mixed_batch())
    pruned = full_seen = 0
    for block in (1, 2, 4, 8):
        tree = _block_sets(block_mask(batch.subtree_end, block_size=block))
        tree_n = int((tree[0] | tree[1]).sum())
        for window, chunk in ((2, None), (4, None), (None, 4), (None, 8), (6, 8)):
            kw = dict(block_size=block, sliding_window=window, chunk_size=chunk)
            fp, ff = _block_sets(block_mask(batch.subtree_end, batch.position_ids, **kw))
            rp, rf = _block_sets(naive_block_mask(batch.subtree_end, batch.position_ids, **kw))
            assert torch.equal(fp, rp) and torch.equal(ff, rf), (block, window, chunk)
            pruned += int((fp | ff).sum()) < tree_n
            full_seen += int(ff.sum()) > 0
    assert pruned >= 15 and full_seen >= 5


def test_one_sequence_window_touches_the_band_only():
    """One 128-token sequence, blocks of 8, window 8: the diagonal and the block before it (31 of 136)."""
    seq = [np.arange(128) % 50]
    flags = [np.r_[np.zeros(10, bool), np.ones(118, bool)]]
    plan = plan_batch(seq, trainable=flags, seq_len=128)
    batch = materialize(plan, seq, trainable=flags, advise=False)
    fp, ff = _block_sets(batch.block_mask(block_size=8, sliding_window=8))
    assert int(fp.sum()) == 31 and int(ff.sum()) == 0
    fp, ff = _block_sets(batch.block_mask(block_size=8, sliding_window=16))
    assert int(fp.sum()) == 16 + 14 and int(ff.sum()) == 15  # diagonal and two back partial, the one between full
    fp, ff = _block_sets(batch.block_mask(block_size=8, chunk_size=32))
    assert int((fp | ff).sum()) == 4 * 10 and int(fp.sum()) == 16  # 4 chunks of 4 blocks: 10 pairs each


def _naive_floor(se, pos, window, chunk):
    """The first visible key of each query by scanning its chain (loops)."""
    K, L = se.shape
    out = torch.zeros(K, L, dtype=torch.int64)
    for b in range(K):
        for i in range(L):
            keys = [
                j
                for j in range(i + 1)
                if i < se[b, j]
                and (window is None or pos[b, i] - pos[b, j] < window)
                and (chunk is None or pos[b, i] // chunk == pos[b, j] // chunk)
            ]
            out[b, i] = min(keys)
    return out


@pytest.mark.parametrize("window, chunk", [(3, None), (None, 4), (5, 3)])
def test_key_floor_is_the_first_visible_key_and_a_threshold(window, chunk):
    """lo_i is the first visible key, and the tree mask cut at lo_i is the window/chunk mask."""
    batch = _batch(mixed_batch())
    se, pos = batch.subtree_end, batch.position_ids
    lo = key_floor(se, pos, window, chunk)
    assert lo is not None and torch.equal(lo, _naive_floor(se, pos, window, chunk))
    L = batch.seq_len
    j = torch.arange(L)
    cut = dense_mask(se)[:, 0] & (j[None, None, :] >= lo[:, :, None])
    assert torch.equal(cut, naive_dense_mask(batch.plan, batch.rows, pos, window, chunk_size=chunk)[:, 0])
    # Negative control: the floor one token later drops a visible key somewhere.
    late = dense_mask(se)[:, 0] & (j[None, None, :] >= lo[:, :, None] + 1)
    assert not torch.equal(late, cut)


def test_rows_without_the_layout_fall_back_to_the_tree_blocks():
    """Positions that break the chain layout: no floor, so no pruning and nothing full, still exact."""
    batch = _batch(mixed_batch())
    se = batch.subtree_end
    pos = batch.position_ids.flip(1)  # chains no longer hold 0..p in row order
    assert key_floor(se, pos, 4, None) is None
    fast = block_mask(se, pos, block_size=4, sliding_window=4)
    fp, ff = _block_sets(fast)
    tp, tf = _block_sets(block_mask(se, block_size=4))
    assert not ff.any() and torch.equal(fp, tp | tf)
    assert torch.equal(_token_mask(fast, batch.num_rows, batch.seq_len, 4), dense_mask(se, pos, 4)[:, 0])


def test_a_wrong_floor_would_miss_blocks():
    """Negative control for the block test: the tree's blocks cut by a floor one block too late lose
    blocks that hold visible pairs (so the comparison above can fail)."""
    from treepack.trainer.kernels.blocks import _touched

    batch = _batch(mixed_batch())
    se, pos = batch.subtree_end, batch.position_ids
    lo = key_floor(se, pos, 4, None)
    K, L = se.shape
    nb = -(-L // 4)
    se_max = torch.nn.functional.pad(se, (0, nb * 4 - L)).view(K, nb, 4).amax(-1)
    good = _touched(se_max, lo, nb, 4, L)
    bad = _touched(se_max, lo + 4, nb, 4, L)
    rp, rf = _block_sets(naive_block_mask(se, pos, block_size=4, sliding_window=4))
    assert torch.equal(good, rp | rf) and (rp & ~bad).any()
