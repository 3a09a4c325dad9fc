"""Gated DeltaNet kernels and tree execution (treepack.trainer.kernels.gdn, gdn_ref).

- fast == naive: the chunked torch kernel against the token-by-token recurrence, and the
  tree runner / tree conv against their segment-by-segment references, from one table.
- the stock math: our kernel against HF Qwen3-Next's own torch fallback.
- the oracle at op level: tree execution equals running every sequence alone (outputs
  and gradients), and a plain linear scan of the row does not (negative control).
- isolation: a loss on one leaf gives exactly zero gradient to siblings and other trees.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from treepack.proto.errors import RequestError
from treepack.trainer.kernels.gdn import (
    naive_tree_causal_conv1d,
    naive_tree_gated_delta_rule,
    tree_causal_conv1d,
    tree_gated_delta_rule,
)
from treepack.trainer.kernels.gdn_ref import naive_recurrent_gated_delta_rule, torch_chunk_gated_delta_rule
from treepack.trainer.kernels.tree_scan import tree_schedule

from helpers.trees import tree_plan

F64 = torch.float64


def _inputs(T, Hk, Hv, K, V, *, dtype=F64, seed=0, grad=False):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(1, T, Hk, K, generator=gen, dtype=dtype)
    k = torch.randn(1, T, Hk, K, generator=gen, dtype=dtype)
    v = torch.randn(1, T, Hv, V, generator=gen, dtype=dtype)
    g = -torch.rand(1, T, Hv, generator=gen, dtype=dtype) * 0.5
    beta = torch.rand(1, T, Hv, generator=gen, dtype=dtype)
    xs = [q, k, v, g, beta]
    return [x.requires_grad_(grad) for x in xs]


KERNEL_CASES = [
    # (lengths, Hk, Hv, K, V, initial state, l2norm)
    ([1], 1, 1, 4, 4, False, False),
    ([64], 2, 2, 8, 8, True, True),
    ([65, 1, 63], 2, 4, 8, 6, True, True),
    ([3, 130, 7, 64, 128], 1, 3, 5, 7, True, False),
    ([200], 2, 2, 16, 8, False, True),
]


@pytest.mark.parametrize("lens,Hk,Hv,K,V,h0,l2", KERNEL_CASES)
def test_chunk_kernel_equals_recurrence(lens, Hk, Hv, K, V, h0, l2):
    cu = torch.tensor(np.concatenate([[0], np.cumsum(lens)]), dtype=torch.int32)
    xs = _inputs(int(cu[-1]), Hk, Hv, K, V, grad=True)
    init = torch.randn(len(lens), Hv, K, V, dtype=F64, requires_grad=True) if h0 else None
    kw = dict(initial_state=init, output_final_state=True, use_qk_l2norm_in_kernel=l2, cu_seqlens=cu, scale=0.3)
    o1, f1 = torch_chunk_gated_delta_rule(*xs, **kw)
    o2, f2 = naive_recurrent_gated_delta_rule(*xs, **kw)
    torch.testing.assert_close(o1, o2, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(f1, f2, rtol=1e-10, atol=1e-10)
    w1, w2 = torch.randn_like(o1), torch.randn_like(f1)
    leaves = xs + ([init] if h0 else [])
    g1 = torch.autograd.grad((o1 * w1).sum() + (f1 * w2).sum(), leaves)
    g2 = torch.autograd.grad((o2 * w1).sum() + (f2 * w2).sum(), leaves)
    for a, b in zip(g1, g2):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-9)


def test_chunk_kernel_equals_hf_qwen3_next_fallback():
    from transformers.models.qwen3_next import modeling_qwen3_next as m

    q, k, v, g, beta = _inputs(150, 2, 4, 8, 8, dtype=torch.float32)
    h0 = torch.randn(1, 4, 8, 8)
    ours, f_ours = torch_chunk_gated_delta_rule(
        q, k, v, g, beta, initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=True
    )
    hf, f_hf = m.torch_chunk_gated_delta_rule(
        q, k, v, g=g, beta=beta, initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=True
    )
    torch.testing.assert_close(ours, hf, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(f_ours, f_hf, rtol=1e-5, atol=1e-5)


def test_kernel_rejects_bad_shapes():
    q, k, v, g, beta = _inputs(10, 2, 4, 8, 8)
    with pytest.raises(RequestError, match=r"v must be \[B, T, Hv, V\]"):
        torch_chunk_gated_delta_rule(q, k, v[:, :, :3], g, beta)
    with pytest.raises(RequestError, match="cu_seqlens must rise from 0 to T=10"):
        torch_chunk_gated_delta_rule(q, k, v, g, beta, cu_seqlens=torch.tensor([0, 4, 9]))
    with pytest.raises(RequestError, match="initial_state"):
        torch_chunk_gated_delta_rule(q, k, v, g, beta, initial_state=torch.zeros(2, 4, 8, 8))


PLANS = [(0, 2, 4), (100, 4, 6), (200, 2, 4)]  # (seed, min_shared_len, conv width W)


@pytest.fixture(scope="module", params=PLANS, ids=lambda p: f"seed{p[0]}-msl{p[1]}-W{p[2]}")
def planned(request):
    seed, msl, W = request.param
    seqs, _, plan = tree_plan(seed, min_shared_len=msl, conv_width=W)
    return seqs, plan, tree_schedule(plan)


def _flat_inputs(plan, Hk=2, Hv=4, K=8, V=6, seed=1, grad=True):
    N = plan.num_rows * plan.seq_len
    gen = torch.Generator().manual_seed(seed)
    xs = [
        torch.randn(N, Hk, K, generator=gen, dtype=F64),
        torch.randn(N, Hk, K, generator=gen, dtype=F64),
        torch.randn(N, Hv, V, generator=gen, dtype=F64),
        -torch.rand(N, Hv, generator=gen, dtype=F64) * 0.3,
        torch.rand(N, Hv, generator=gen, dtype=F64),
    ]
    return [x.requires_grad_(grad) for x in xs]


def test_tree_ops_equal_naive(planned):
    _, plan, sched = planned
    W = sched.conv_width
    N, D = plan.num_rows * plan.seq_len, 6
    x = torch.randn(N, D, dtype=F64)
    w, b = torch.randn(D, W, dtype=F64), torch.randn(D, dtype=F64)
    fast = tree_causal_conv1d(x, w, b, sched, "silu")
    assert not fast.isnan().any()
    torch.testing.assert_close(fast, naive_tree_causal_conv1d(x, w, b, plan, "silu"), rtol=1e-12, atol=1e-12)
    xs = _flat_inputs(plan, grad=False)
    o = tree_gated_delta_rule(*xs, sched, use_qk_l2norm_in_kernel=True)
    assert not o.isnan().any(), "a position was never written"
    torch.testing.assert_close(
        o, naive_tree_gated_delta_rule(*xs, plan, use_qk_l2norm_in_kernel=True), rtol=1e-10, atol=1e-10
    )


def _per_sequence(plan):
    ptr, flat = plan.token_index()
    return [torch.from_numpy(flat[ptr[s] : ptr[s + 1]]) for s in range(plan.num_sequences)]


def _unpacked_layer(xs, conv_in, w, plan):
    """Every sequence alone: plain causal conv from zeros, delta rule from a zero state."""
    outs = []
    W = w.shape[1]
    for t in _per_sequence(plan):
        xi = torch.nn.functional.pad(conv_in[t].T[None], (W - 1, 0))
        c = torch.nn.functional.silu(torch.nn.functional.conv1d(xi, w[:, None, :], groups=w.shape[0]))[0].T
        q, k, v, g, beta = (x[t][None] for x in xs)
        o, _ = torch_chunk_gated_delta_rule(q, k + c[:, None, :], v, g, beta, use_qk_l2norm_in_kernel=True)
        outs.append(o[0])
    return outs


def _tree_layer(xs, conv_in, w, sched):
    c = tree_causal_conv1d(conv_in, w, None, sched, "silu")
    q, k, v, g, beta = xs
    return tree_gated_delta_rule(q, k + c[:, None, :], v, g, beta, sched, use_qk_l2norm_in_kernel=True)


def test_tree_equals_unpacked_and_linear_scan_does_not(planned):
    """The op-level oracle: conv feeding the delta rule, tree rows vs each sequence alone."""
    _, plan, sched = planned
    xs = _flat_inputs(plan)
    N, K = xs[0].shape[0], xs[0].shape[2]
    conv_in = torch.randn(N, K, dtype=F64, requires_grad=True)
    w = torch.randn(K, sched.conv_width, dtype=F64, requires_grad=True)
    tree_out = _tree_layer(xs, conv_in, w, sched)
    ref = _unpacked_layer(xs, conv_in, w, plan)
    idx = _per_sequence(plan)
    for t, o in zip(idx, ref):
        torch.testing.assert_close(tree_out[t], o, rtol=1e-10, atol=1e-10)
    # Gradients of one loss over every sequence's outputs (shared positions sum sharers).
    weights = [torch.randn(o.shape, dtype=F64, generator=torch.Generator().manual_seed(i)) for i, o in enumerate(ref)]
    loss_tree = sum((tree_out[t] * wt).sum() for t, wt in zip(idx, weights))
    loss_ref = sum((o * wt).sum() for o, wt in zip(ref, weights))
    leaves = xs + [conv_in, w]
    for a, b in zip(torch.autograd.grad(loss_tree, leaves), torch.autograd.grad(loss_ref, leaves)):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-9)

    # Negative control: the same layer as one plain linear scan per row (every row one
    # sequence, conv over the raw row) gives a different answer on the same inputs.
    C = plan.seq_len
    q, k, v, g, beta = (x.detach() for x in xs)
    xi = torch.nn.functional.pad(
        conv_in.detach().reshape(plan.num_rows, C, K).transpose(1, 2), (sched.conv_width - 1, 0)
    )
    c = (
        torch.nn.functional.silu(torch.nn.functional.conv1d(xi, w.detach()[:, None, :], groups=K))
        .transpose(1, 2)
        .reshape(N, K)
    )
    cu = torch.arange(plan.num_rows + 1, dtype=torch.int32) * C
    scan, _ = torch_chunk_gated_delta_rule(
        q[None], (k + c[:, None, :])[None], v[None], g[None], beta[None], use_qk_l2norm_in_kernel=True, cu_seqlens=cu
    )
    worst = max(float((scan[0][t] - o.detach()).abs().max()) for t, o in zip(idx, ref))
    assert worst > 1e-2, f"a linear scan of the row matched the unpacked run (max diff {worst})"


def test_leaf_loss_gives_zero_gradient_to_siblings_and_other_trees(planned):
    _, plan, sched = planned
    seg = plan.segments
    xs = _flat_inputs(plan)
    N, K = xs[0].shape[0], xs[0].shape[2]
    conv_in = torch.randn(N, K, dtype=F64, requires_grad=True)
    w = torch.randn(K, sched.conv_width, dtype=F64)
    out = _tree_layer(xs, conv_in, w, sched)
    # A leaf with a sibling: its chain is all that may receive gradient.
    leaves = [s for s in range(seg.num_segments) if seg.parent[s] >= 0 and not (seg.parent == s).any()]
    leaf = next(s for s in leaves if ((seg.parent == seg.parent[s]).sum() >= 2))
    chain, p = [], leaf
    while p >= 0:
        chain.append(p)
        p = int(seg.parent[p])
    seg_of = torch.from_numpy(plan.segment_ids().reshape(-1))
    pos = seg_of == leaf
    out[pos].square().sum().backward()
    on_chain = torch.zeros(N, dtype=torch.bool)
    for s in chain:
        on_chain |= seg_of == s
    for name, x in zip(["q", "k", "v", "g", "beta", "conv_in"], xs + [conv_in]):
        grad = x.grad.reshape(N, -1)
        assert torch.count_nonzero(grad[~on_chain]) == 0, f"{name}: gradient leaked off the leaf's chain"
        assert torch.count_nonzero(grad[pos]) > 0, f"{name}: no gradient on the leaf itself (vacuous)"
    root = chain[-1]
    assert torch.count_nonzero(conv_in.grad[seg_of == root]) > 0, "no gradient reached the root (vacuous)"
    # The no-leak check above is not vacuous: real tokens lie off the chain, the leaf's
    # siblings (and their subtrees) among them.
    off = ~on_chain & (seg_of >= 0)
    siblings = [s for s in range(seg.num_segments) if seg.parent[s] == seg.parent[leaf] and s != leaf]
    assert int(off.sum()) > 0 and any(bool((seg_of == s).any()) for s in siblings), (
        "no real token off the leaf's chain (vacuous)"
    )


def test_schedule_for_a_subset_of_rows(planned):
    """A rank's rows (in its own order, with an empty filler row) run like the full batch."""
    _, plan, sched = planned
    C = plan.seq_len
    rows = np.array([plan.num_rows - 1, -1, 0])
    sub = tree_schedule(plan, rows=rows)
    xs = _flat_inputs(plan, grad=False)
    full = tree_gated_delta_rule(*xs, sched, use_qk_l2norm_in_kernel=True).reshape(plan.num_rows, C, -1)

    def pick(x):
        x = x.reshape(plan.num_rows, C, *x.shape[1:])
        return torch.stack([x[r] if r >= 0 else torch.zeros_like(x[0]) for r in rows]).reshape(-1, *x.shape[2:])

    part = tree_gated_delta_rule(*(pick(x) for x in xs), sub, use_qk_l2norm_in_kernel=True).reshape(len(rows), C, -1)
    torch.testing.assert_close(part[0], full[-1], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(part[2], full[0], rtol=1e-12, atol=1e-12)
    assert torch.count_nonzero(part[1]) == 0


def test_tree_ops_reject_bad_input(planned):
    _, plan, sched = planned
    N = plan.num_rows * plan.seq_len
    with pytest.raises(RequestError, match="plan's conv_width"):
        tree_causal_conv1d(torch.zeros(N, 4), torch.zeros(4, sched.conv_width + 1), None, sched)
    with pytest.raises(RequestError, match="x must be"):
        tree_causal_conv1d(torch.zeros(N - 1, 4), torch.zeros(4, sched.conv_width), None, sched)
    with pytest.raises(RequestError, match="activation"):
        tree_causal_conv1d(torch.zeros(N, 4), torch.zeros(4, sched.conv_width), None, sched, "gelu")
    xs = _flat_inputs(plan, grad=False)
    with pytest.raises(RequestError, match="q must be"):
        tree_gated_delta_rule(xs[0][:-1], *xs[1:], sched)
    with pytest.raises(RequestError, match="rows must be distinct"):
        tree_schedule(plan, rows=[0, 0])
