"""The batched CPU varlen kernel equals the loop reference (outputs, LSE, gradients) from one
table of random inputs, and through the ``flash`` backend on tree rows."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from treepack.trainer import materialize, naive_varlen_attention, tree_attention
from treepack.trainer.kernels.varlen import length_buckets, varlen_attention

from helpers.tolerance import assert_close
from helpers.trees import tree_plan

CASES = [
    # (seed, heads, kv heads, causal, window, softcap, lse)
    (0, 2, 2, True, (-1, -1), 0.0, False),
    (1, 4, 2, True, (-1, -1), 0.0, False),
    (2, 4, 1, True, (3, 0), 0.0, False),
    (3, 2, 2, True, (-1, -1), 5.0, False),
    (4, 2, 1, True, (-1, -1), 0.0, True),
    (5, 2, 2, False, (-1, 2), 0.0, True),
    (6, 2, 2, False, (-1, -1), 0.0, False),
]


def _inputs(seed: int, H: int, Hkv: int):
    g = torch.Generator().manual_seed(seed)
    rng = np.random.default_rng(seed)
    n = 9
    nk = rng.integers(1, 70, n)
    nq = np.minimum(nk, rng.integers(1, 40, n))
    nq[0] = nk[0]  # a root segment: queries = keys
    cq = np.concatenate([[0], np.cumsum(nq)])
    ck = np.concatenate([[0], np.cumsum(nk)])
    D = 8
    q = torch.randn(int(cq[-1]), H, D, generator=g, dtype=torch.float64, requires_grad=True)
    k = torch.randn(int(ck[-1]), Hkv, D, generator=g, dtype=torch.float64, requires_grad=True)
    v = torch.randn(int(ck[-1]), Hkv, D, generator=g, dtype=torch.float64, requires_grad=True)
    args = (torch.tensor(cq, dtype=torch.int32), torch.tensor(ck, dtype=torch.int32), int(nq.max()), int(nk.max()))
    return q, k, v, args


@pytest.mark.parametrize("seed,H,Hkv,causal,window,softcap,lse", CASES)
def test_varlen_equals_naive(seed, H, Hkv, causal, window, softcap, lse):
    q, k, v, args = _inputs(seed, H, Hkv)
    kw = dict(causal=causal, window_size=window, softcap=softcap, return_attn_probs=lse, softmax_scale=0.3)
    results = []
    for fn in (naive_varlen_attention, varlen_attention):
        out = fn(q, k, v, *args, **kw)
        o, l = (out[0], out[1]) if lse else (out, None)
        loss = (o * torch.linspace(-1, 1, o.numel(), dtype=o.dtype).view_as(o)).sum() + (0 if l is None else l.sum())
        grads = torch.autograd.grad(loss, (q, k, v))
        results.append((o, l, grads))
    (o0, l0, g0), (o1, l1, g1) = results
    assert_close("out", o0, o1, atol=0, ratio=1e-6)
    if lse:
        assert_close("lse", l0, l1, atol=0, ratio=1e-6)
    assert_close("grads", g0, g1, atol=0, ratio=1e-6)


def test_buckets_cover_every_sequence_once_with_bounded_padding():
    rng = np.random.default_rng(0)
    nk = rng.integers(1, 5000, 300)
    nq = np.minimum(nk, rng.integers(1, 3000, 300))
    buckets = length_buckets(nq, nk)
    seen = np.sort(np.concatenate([m for m, _, _ in buckets]))
    assert (seen == np.arange(300)).all() and len(buckets) < 300
    for m, Q, K in buckets:
        assert Q == nq[m].max() and K == nk[m].max()
        assert (K <= np.maximum(1.25 * nk[m], nk[m] + 1)).all() and (Q <= np.maximum(1.25 * nq[m], nq[m] + 1)).all()


def test_flash_backend_with_varlen_kernel_equals_naive_on_tree_rows():
    seqs, _, plan = tree_plan(3)
    batch = materialize(plan, seqs, allow_empty_loss=True)
    g = torch.Generator().manual_seed(0)
    K, L = batch.num_rows, batch.seq_len
    q = torch.randn(K, 4, L, 8, generator=g, requires_grad=True)
    k = torch.randn(K, 2, L, 8, generator=g, requires_grad=True)
    v = torch.randn(K, 2, L, 8, generator=g, requires_grad=True)
    outs = []
    for fn in (naive_varlen_attention, varlen_attention):
        out = tree_attention(q, k, v, batch, backend="flash", varlen_fn=fn)
        outs.append((out, torch.autograd.grad(out.pow(2).sum(), (q, k, v))))
    assert_close("tree rows", outs[0][0], outs[1][0], atol=1e-5)
    assert_close("tree row grads", outs[0][1], outs[1][1], atol=1e-4)
