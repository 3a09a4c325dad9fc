"""Attention sinks (GPT-OSS) and chunked attention (Llama4) on tree rows: the kernel oracle.

Packed q, k, v are random leaves on the rows of a tree plan (depth >= 3, several trees per
row, padding, segments crossing a 64-position chunk boundary); every sequence alone reads
its tokens' q, k, v through ``locate`` (shared tokens are the same leaves, as in a model)
and runs a loop reference (:func:`_alone`: causal softmax over its own positions, the sink
as an extra logit, the chunk of its own positions). Outputs (fp32, <= 1e-5) on every
backend, gradients (<= 1e-4 relative) on SDPA and the varlen path (PyTorch has no CPU
backward for flex). Negative controls: dropping the sink, dropping the chunk, or chunking
by row index instead of sequence position is caught.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from treepack.proto.errors import RequestError
from treepack.trainer import materialize, naive_varlen_attention, tree_attention
from treepack.trainer.kernels.masks import dense_mask, naive_dense_mask, naive_varlen_meta, varlen_meta

from helpers.tolerance import assert_close, assert_not_close
from helpers.trainer_cases import plan_of, random_batch
from helpers.trees import tree_plan

H, HKV, D = 4, 2, 8
SCALE = D**-0.5


@pytest.fixture(scope="module")
def case():
    seqs, trainable, plan = tree_plan(40, seq_len=256, trees=3, depth=4, max_len=200)
    assert (plan.segments.row_len < plan.seq_len).any(), "no padding in the plan"
    return seqs, materialize(plan, seqs, trainable=trainable, allow_empty_loss=True)  # attention only, no loss


def _leaves(batch, seed=0):
    g = torch.Generator().manual_seed(seed)
    K, L = batch.num_rows, batch.seq_len
    q = torch.randn(K, H, L, D, generator=g).requires_grad_()
    k = torch.randn(K, HKV, L, D, generator=g).requires_grad_()
    v = torch.randn(K, HKV, L, D, generator=g).requires_grad_()
    sinks = (torch.randn(H, generator=g) * 2).requires_grad_()
    return q, k, v, sinks


def _alone(q, k, v, sinks, chunk, window):
    """One sequence alone: q [H, n, D], k/v [Hkv, n, D] -> [H, n, D]; positions are 0..n-1."""
    n = q.shape[1]
    k, v = k.repeat_interleave(H // HKV, 0), v.repeat_interleave(H // HKV, 0)
    s = torch.einsum("hqd,hkd->hqk", q, k) * SCALE
    i, j = torch.arange(n)[:, None], torch.arange(n)[None, :]
    ok = j <= i
    if chunk is not None:
        ok &= i // chunk == j // chunk
    if window is not None:
        ok &= i - j < window
    s = s.masked_fill(~ok, -math.inf)
    if sinks is not None:
        s = torch.cat([s, sinks.view(H, 1, 1).expand(H, n, 1)], dim=-1)
    p = torch.softmax(s, dim=-1)[..., :n]
    return p @ v


def _weights(seqs, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(len(s), H, D, generator=g) for s in seqs]


def _packed_loss(out, batch, w):
    """Sum over sequences of their weighted outputs read from the rows (shared ones once per sharer)."""
    total = 0.0
    for s, ws in enumerate(w):
        row, idx = batch.locate(s)
        total = total + (out[row][:, torch.as_tensor(idx)].transpose(0, 1) * ws).sum()
    return total


def _reference(q, k, v, sinks, batch, chunk, window):
    outs = []
    for s in range(batch.plan.num_sequences):
        row, idx = batch.locate(s)
        i = torch.as_tensor(idx)
        outs.append(_alone(q[row][:, i], k[row][:, i], v[row][:, i], sinks, chunk, window).transpose(0, 1))
    return outs


def _per_sequence(out, batch):
    return [
        out[r][:, torch.as_tensor(i)].transpose(0, 1)
        for r, i in (batch.locate(s) for s in range(batch.plan.num_sequences))
    ]


VARIANTS = [
    ("sinks", dict(sinks=True)),
    ("chunk16", dict(chunk=16)),
    ("chunk64", dict(chunk=64)),
    ("sinks+chunk16", dict(sinks=True, chunk=16)),
    ("sinks+window7", dict(sinks=True, window=7)),
]


@pytest.mark.parametrize("backend", ["sdpa", "flex", "flash"])
@pytest.mark.parametrize("name,variant", VARIANTS, ids=[n for n, _ in VARIANTS])
def test_packed_equals_alone(case, backend, name, variant):
    seqs, batch = case
    q, k, v, sinks = _leaves(batch)
    sk = sinks if variant.get("sinks") else None
    chunk, window = variant.get("chunk"), variant.get("window")
    ref = _reference(q, k, v, sk, batch, chunk, window)
    kw = dict(backend=backend, sinks=sk, chunk_size=chunk, sliding_window=window, varlen_fn=naive_varlen_attention)
    grad = backend != "flex"
    if grad:
        out = tree_attention(q, k, v, batch, **kw)
    else:
        kw["sinks"] = None if sk is None else sk.detach()
        out = tree_attention(q.detach(), k.detach(), v.detach(), batch, **kw)
    assert_close(
        f"{backend} {name} outputs",
        [r.detach() for r in ref],
        [o.detach() for o in _per_sequence(out, batch)],
        atol=1e-5,
    )
    if not grad:
        return
    w = _weights(seqs)
    leaves = [q, k, v] + ([sinks] if sk is not None else [])
    want = torch.autograd.grad(sum((r * ws).sum() for r, ws in zip(ref, w)), leaves)
    got = torch.autograd.grad(_packed_loss(out, batch, w), leaves)
    assert_close(f"{backend} {name} grads", list(want), list(got), ratio=1e-4, nonzero_ref=True)


def test_negative_controls(case):
    """Ignoring the sink or the chunk, or chunking row indices, is far from the reference."""
    _, batch = case
    q, k, v, sinks = _leaves(batch)
    with torch.no_grad():
        ref_sink = _reference(q, k, v, sinks, batch, None, None)
        ref_chunk = _reference(q, k, v, None, batch, 16, None)
        no_sink = _per_sequence(tree_attention(q, k, v, batch), batch)
        no_chunk = _per_sequence(
            tree_attention(q, k, v, batch, backend="flash", varlen_fn=naive_varlen_attention), batch
        )
        rows = torch.arange(batch.seq_len).expand_as(batch.position_ids)
        by_row = dense_mask(batch.subtree_end, rows, chunk_size=16)
        s = torch.matmul(q, k.repeat_interleave(H // HKV, 1).transpose(-1, -2)) * SCALE
        row_chunked = torch.softmax(s.masked_fill(~by_row, -math.inf), -1) @ v.repeat_interleave(H // HKV, 1)
    assert_not_close("sink dropped", ref_sink, no_sink, atol=1e-2)
    assert_not_close("chunk dropped", ref_chunk, no_chunk, atol=1e-2)
    assert_not_close("chunks of row indices", ref_chunk, _per_sequence(row_chunked, batch), atol=1e-2)


@settings(max_examples=12, deadline=None)
@given(st.integers(0, 2**31 - 1), st.sampled_from([1, 3, 8]))
def test_chunked_masks_equal_naive(seed, chunk):
    """Dense chunked mask == the loop reference; chunked varlen pieces == the naive cut, and the
    varlen pieces realise exactly the dense mask (each query sees exactly its piece's keys)."""
    case = random_batch(seed)
    plan = plan_of(case)
    # Random batches may share nothing: the advice warnings are about the workload, not the masks.
    batch = materialize(plan, case["sequences"], trainable=case["trainable"], groups=case["groups"], advise=False)
    dense = batch.dense_mask(chunk_size=chunk)
    assert torch.equal(dense, naive_dense_mask(plan, batch.rows, batch.position_ids, chunk_size=chunk))
    a, b = varlen_meta(plan, batch.rows, chunk_size=chunk), naive_varlen_meta(plan, batch.rows, chunk_size=chunk)
    for f in ("q_index", "k_index", "cu_seqlens_q", "cu_seqlens_k", "pad_index"):
        assert torch.equal(getattr(a, f), getattr(b, f)), f
    assert (a.max_seqlen_q, a.max_seqlen_k) == (b.max_seqlen_q, b.max_seqlen_k)
    K, L = batch.num_rows, batch.seq_len
    seen = torch.zeros(K * L, K * L, dtype=torch.bool)
    cq, ck = a.cu_seqlens_q.tolist(), a.cu_seqlens_k.tolist()
    for p in range(len(cq) - 1):
        qs, ks = a.q_index[cq[p] : cq[p + 1]], a.k_index[ck[p] : ck[p + 1]]
        nq, nk = qs.shape[0], ks.shape[0]
        for i in range(nq):
            seen[qs[i], ks[: nk - nq + i + 1]] = True
    seen[a.pad_index, a.pad_index] = True
    want = torch.block_diag(*dense[:, 0]) if K else seen
    assert torch.equal(seen, want)


def test_sink_argument_errors(case):
    _, batch = case
    q, k, v, _ = _leaves(batch)
    with pytest.raises(RequestError, match=r"sinks must be one logit per query head \[4\]"):
        tree_attention(q, k, v, batch, sinks=torch.zeros(2))
    with pytest.raises(RequestError, match="soft-capping are not exact on backend='flash'"):
        tree_attention(
            q, k, v, batch, backend="flash", sinks=torch.zeros(H), softcap=5.0, varlen_fn=naive_varlen_attention
        )
    with pytest.raises(RequestError, match="chunk_size must be a positive int"):
        batch.dense_mask(chunk_size=0)


def test_backends_agree_everywhere_with_padding(case):
    """Sinks and chunk together: the three backends agree on every row position, padding
    included (a pad token attends only itself, plus the sink)."""
    _, batch = case
    q, k, v, sinks = (x.detach() for x in _leaves(batch, seed=3))
    kw = dict(sinks=sinks, chunk_size=16, varlen_fn=naive_varlen_attention)
    ref = tree_attention(q, k, v, batch, backend="sdpa", **kw)
    pad = batch.subtree_end == torch.arange(1, batch.seq_len + 1)
    assert bool((pad & (batch.position_ids == 0)).any())
    for backend in ("flex", "flash"):
        assert_close(f"{backend} vs sdpa", ref, tree_attention(q, k, v, batch, backend=backend, **kw), atol=1e-5)
