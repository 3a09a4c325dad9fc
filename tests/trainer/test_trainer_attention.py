"""Tree attention: the three backends and the three mask forms agree with their references."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from treepack.trainer import materialize, naive_varlen_attention, tree_attention
from treepack.trainer.kernels.masks import (
    naive_dense_mask,
    naive_varlen_meta,
    varlen_meta,
)

from helpers.tolerance import assert_close, assert_not_close
from helpers.trainer_cases import mixed_batch, plan_of, random_batch


def _batch(case, **kw):
    plan = plan_of(case, **kw)
    return materialize(plan, case["sequences"], trainable=case["trainable"], groups=case["groups"], advise=False)


def _qkv(batch, heads=4, kv_heads=2, dim=8, grad=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    K, L = batch.num_rows, batch.seq_len
    q = torch.randn(K, heads, L, dim, generator=g, requires_grad=grad)
    k = torch.randn(K, kv_heads, L, dim, generator=g, requires_grad=grad)
    v = torch.randn(K, kv_heads, L, dim, generator=g, requires_grad=grad)
    return q, k, v


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 2**31 - 1))
def test_varlen_meta_equals_naive(seed):
    batch = _batch(random_batch(seed))
    a, b = varlen_meta(batch.plan, batch.rows), naive_varlen_meta(batch.plan, batch.rows)
    for f in ("q_index", "k_index", "cu_seqlens_q", "cu_seqlens_k", "pad_index"):
        assert torch.equal(getattr(a, f), getattr(b, f)), f
    assert (a.max_seqlen_q, a.max_seqlen_k) == (b.max_seqlen_q, b.max_seqlen_k)
    assert a.cu_seqlens_q.dtype == torch.int32 and int(a.cu_seqlens_q[0]) == 0
    # Keys of each segment are positions 0 .. seq_start + len - 1 of its sequence.
    pos = batch.position_ids.reshape(-1)
    ck = a.cu_seqlens_k.tolist()
    for g in range(len(ck) - 1):
        assert torch.equal(pos[a.k_index[ck[g] : ck[g + 1]]], torch.arange(ck[g + 1] - ck[g]))


@settings(max_examples=20, deadline=None)
@given(st.integers(0, 2**31 - 1), st.sampled_from([None, 4]), st.sampled_from([None, 2.0]))
def test_backends_agree_forward(seed, window, softcap):
    batch = _batch(random_batch(seed))
    q, k, v = _qkv(batch, seed=seed % 1000)
    kw = dict(sliding_window=window, softcap=softcap)
    ref = tree_attention(q, k, v, batch, backend="sdpa", **kw)
    assert not torch.isnan(ref).any()
    flash = tree_attention(q, k, v, batch, backend="flash", varlen_fn=naive_varlen_attention, **kw)
    flex = tree_attention(q, k, v, batch, backend="flex", compile=False, **kw)
    assert_close("flash", ref, flash, atol=1e-5)
    assert_close("flex", ref, flex, atol=1e-5)


def test_dense_reference_matches_naive_mask_and_fails_without_tree():
    batch = _batch(mixed_batch())
    assert torch.equal(batch.dense_mask(), naive_dense_mask(batch.plan, batch.rows))
    assert torch.equal(batch.dense_mask(3), naive_dense_mask(batch.plan, batch.rows, batch.position_ids, 3))
    q, k, v = _qkv(batch)
    tree = tree_attention(q, k, v, batch)
    # Negative control: a plain causal mask over the packed rows is not the same computation.
    causal = torch.nn.functional.scaled_dot_product_attention(
        q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), is_causal=True
    )
    assert_not_close("plain causal mask", tree, causal, atol=1e-2)


def test_flash_gather_gradients_equal_sdpa():
    """The varlen-gather path (pure-torch kernel) gives the same gradients as dense SDPA."""
    batch = _batch(mixed_batch())
    grads = []
    for backend in ("sdpa", "flash"):
        q, k, v = _qkv(batch, grad=True, seed=3)
        out = tree_attention(q, k, v, batch, backend=backend, varlen_fn=naive_varlen_attention, sliding_window=5)
        (out * torch.linspace(-1, 1, out.shape[-1])).sum().backward()
        grads.append([t.grad.clone() for t in (q, k, v)])
    assert_close("grad q, k, v", grads[0], grads[1], atol=1e-5)


def test_flex_compiled_forward_on_cpu():
    """The compiled FlexAttention kernel (inductor's CPU backend) runs the BlockMask."""
    batch = _batch(mixed_batch())
    q, k, v = _qkv(batch)
    ref = tree_attention(q, k, v, batch)
    out = tree_attention(q, k, v, batch, backend="flex", compile=True)
    assert_close("compiled flex", ref, out, atol=1e-5)


def test_naive_varlen_bottom_right_alignment():
    """seqlen_q < seqlen_k: the last query sees every key, the first sees nk - nq + 1."""
    torch.manual_seed(0)
    q = torch.randn(2, 1, 4)
    k = torch.randn(5, 1, 4)
    v = torch.randn(5, 1, 4)
    out = naive_varlen_attention(
        q, k, v, torch.tensor([0, 2], dtype=torch.int32), torch.tensor([0, 5], dtype=torch.int32), 2, 5, causal=True
    )
    s = (q[:, 0] @ k[:, 0].T) * 0.5
    mask = torch.tensor([[1, 1, 1, 1, 0], [1, 1, 1, 1, 1]], dtype=torch.bool)
    want = torch.softmax(s.masked_fill(~mask, float("-inf")), -1) @ v[:, 0]
    assert_close("bottom-right varlen", want, out[:, 0], atol=1e-6, ratio=1e-5)


def test_bad_shapes_and_backend():
    batch = _batch(mixed_batch())
    q, k, v = _qkv(batch)
    with pytest.raises(ValueError, match="backend must be one of"):
        tree_attention(q, k, v, batch, backend="xformers")
    with pytest.raises(ValueError, match="query must have shape"):
        tree_attention(q[:, :, :10], k, v, batch)
    with pytest.raises(ValueError, match="not a multiple"):
        tree_attention(q[:, :3], k, v, batch)
