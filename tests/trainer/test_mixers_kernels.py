"""Mixer kernels: chunked / vectorized references == token-by-token naive ones == HF's slow paths.

One table of random inputs per kernel family, fp64 for ref == naive (and their gradients),
fp32 against HF's own torch fallbacks (which compute in fp32). Then the tree mechanism:
:func:`tree_conv` and :func:`tree_scan` against the segment-by-segment walks on a deep tree
plan, for conv widths up to the plan's.
"""

from __future__ import annotations

import pytest
import torch

from treepack.proto.errors import RequestError
from treepack.trainer.kernels.gdn import naive_tree_causal_conv1d
from treepack.trainer.kernels.mamba2 import naive_ssd_scan, torch_ssd_chunk_scan, tree_ssd_scan
from treepack.trainer.kernels.short_conv import naive_causal_conv1d, torch_causal_conv1d
from treepack.trainer.kernels.tree_scan import naive_tree_scan, tree_conv, tree_schedule

from helpers.trees import tree_plan

F64 = torch.float64


def _ssd_inputs(b, L, H=4, P=3, G=2, N=5, dtype=F64, seed=0, grad=False):
    g = torch.Generator().manual_seed(seed)
    t = lambda *s: torch.randn(*s, generator=g, dtype=dtype)  # noqa: E731
    xs = dict(
        x=t(b, L, H, P),
        dt=t(b, L, H),
        A=-torch.rand(H, generator=g, dtype=dtype) - 0.1,
        B=t(b, L, G, N),
        C=t(b, L, G, N),
    )
    kw = dict(D=t(H), dt_bias=t(H), z=t(b, L, H, P))
    if grad:
        for v in list(xs.values()) + list(kw.values()):
            v.requires_grad_(True)
    return xs, kw


SSD_CASES = [  # (batch, length, chunk, varlen boundaries or None, with initial states)
    (2, 37, 8, None, False),
    (2, 37, 16, None, True),
    (1, 50, 8, [0, 5, 5, 20, 21, 50], True),
    (1, 9, 64, [0, 1, 2, 9], False),
]


@pytest.mark.parametrize("b,L,chunk,cu,h0", SSD_CASES)
def test_ssd_chunked_equals_naive_with_gradients(b, L, chunk, cu, h0):
    xs, kw = _ssd_inputs(b, L, grad=True)
    n = b if cu is None else len(cu) - 1
    kw.update(dt_softplus=True, dt_limit=(0.01, 5.0), return_varlen_states=True)
    if cu is not None:
        kw["cu_seqlens"] = torch.tensor(cu)
    if h0:
        kw["initial_states"] = torch.randn(n, 4, 3, 5, dtype=F64, requires_grad=True)
    y1, s1 = torch_ssd_chunk_scan(*xs.values(), chunk, **kw)
    y2, s2 = naive_ssd_scan(*xs.values(), chunk, **kw)
    torch.testing.assert_close(y1, y2, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(s1, s2, rtol=1e-10, atol=1e-10)
    leaves = [v for v in list(xs.values()) + list(kw.values()) if isinstance(v, torch.Tensor) and v.requires_grad]
    w = torch.randn_like(y1)
    g1 = torch.autograd.grad((y1 * w).sum() + s1.sum(), leaves)
    g2 = torch.autograd.grad((y2 * w).sum() + s2.sum(), leaves)
    for a, c in zip(g1, g2):
        torch.testing.assert_close(a, c, rtol=1e-9, atol=1e-9)


def test_ssd_seq_idx_equals_cu_seqlens():
    xs, kw = _ssd_inputs(1, 30)
    cu = torch.tensor([0, 4, 17, 30])
    seq_idx = torch.repeat_interleave(torch.arange(3), cu[1:] - cu[:-1])[None]
    a = torch_ssd_chunk_scan(*xs.values(), 8, **kw, cu_seqlens=cu, return_varlen_states=True)
    c = torch_ssd_chunk_scan(*xs.values(), 8, **kw, seq_idx=seq_idx, return_varlen_states=True)
    for u, v in zip(a, c):
        torch.testing.assert_close(u, v, rtol=0, atol=0)


@pytest.mark.parametrize("chunk", [8, 16])
def test_ssd_equals_hf_torch_path(chunk):
    from transformers.models.bamba.modeling_bamba import mamba2_chunk_scan

    xs, kw = _ssd_inputs(2, 41, dtype=torch.float32)
    del kw["z"]  # HF's torch path ignores z (its layers gate in the norm)
    h0 = torch.randn(2, 4, 3, 5)
    y, fin = torch_ssd_chunk_scan(
        *xs.values(), chunk, **kw, initial_states=h0, dt_softplus=True, return_final_states=True
    )
    y_hf, fin_hf = mamba2_chunk_scan(
        *xs.values(), chunk_size=chunk, **kw, initial_states=h0, dt_softplus=True, return_final_states=True
    )
    torch.testing.assert_close(y, y_hf, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(fin, fin_hf, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("W", [2, 3, 4])
def test_causal_conv_equals_naive_and_hf(W):
    from transformers.models.bamba.modeling_bamba import causal_conv1d_fn

    g = torch.Generator().manual_seed(W)
    x, w, b = (
        torch.randn(2, 6, 30, generator=g, dtype=F64),
        torch.randn(6, W, generator=g, dtype=F64),
        torch.randn(6, generator=g, dtype=F64),
    )
    seq_idx = torch.tensor([[0] * 1 + [1] * 12 + [2] * 17, [0] * 30])
    for act in (None, "silu"):
        torch.testing.assert_close(
            torch_causal_conv1d(x, w, b, seq_idx=seq_idx, activation=act),
            naive_causal_conv1d(x, w, b, seq_idx=seq_idx, activation=act),
            rtol=1e-12,
            atol=1e-12,
        )
        torch.testing.assert_close(
            torch_causal_conv1d(x, w, b, activation=act),
            causal_conv1d_fn(x, w, b, activation=act),
            rtol=1e-12,
            atol=1e-12,
        )
    h0 = torch.randn(2, 6, W - 1, dtype=F64)
    y1, f1 = torch_causal_conv1d(x, w, b, initial_states=h0, return_final_states=True)
    y2, f2 = naive_causal_conv1d(x, w, b, initial_states=h0, return_final_states=True)
    torch.testing.assert_close(y1, y2, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(f1, x[:, :, -(W - 1) :], rtol=0, atol=0)
    with pytest.raises(RequestError, match="activation"):
        torch_causal_conv1d(x, w, b, activation="gelu")


@pytest.fixture(scope="module")
def planned():
    seqs, _, plan = tree_plan(3, min_shared_len=2, conv_width=4, trees=3, depth=3, max_len=160, seq_len=192)
    return plan, tree_schedule(plan)


@pytest.mark.parametrize("W", [1, 2, 4])
def test_tree_conv_equals_chain_walk_for_narrower_layers(planned, W):
    plan, sched = planned
    N, D = plan.num_rows * plan.seq_len, 5
    g = torch.Generator().manual_seed(W)
    x, w, b = (
        torch.randn(N, D, generator=g, dtype=F64),
        torch.randn(D, W, generator=g, dtype=F64),
        torch.randn(D, generator=g, dtype=F64),
    )
    fast = tree_conv(x, w, b, sched, "silu")
    assert not fast.isnan().any()
    torch.testing.assert_close(fast, naive_tree_causal_conv1d(x, w, b, plan, "silu"), rtol=1e-12, atol=1e-12)
    with pytest.raises(RequestError, match="plan's conv_width"):
        tree_conv(x, torch.zeros(D, 5, dtype=F64), None, sched)


def test_tree_ssd_equals_segment_walk_with_gradients(planned):
    plan, sched = planned
    N, H, P, G, S = plan.num_rows * plan.seq_len, 4, 3, 2, 5
    xs, kw = _ssd_inputs(1, N, H, P, G, S, grad=True)
    x, dt, B, C = (xs[k][0] for k in ("x", "dt", "B", "C"))
    A, D, bias = xs["A"], kw["D"], kw["dt_bias"]
    fast = tree_ssd_scan(x, dt, A, B, C, sched, chunk_size=16, D=D, dt_bias=bias, dt_softplus=True)
    assert not fast.isnan().any()

    def run(seg_inputs, h0):
        y, fin = naive_ssd_scan(
            *(t[None] for t in seg_inputs[:1]),
            seg_inputs[1][None],
            A,
            *(t[None] for t in seg_inputs[2:]),
            16,
            D=D,
            dt_bias=bias,
            dt_softplus=True,
            initial_states=h0,
            return_final_states=True,
        )
        return y[0], fin

    slow = naive_tree_scan(run, (x, dt, B, C), plan, (H, P))
    torch.testing.assert_close(fast, slow, rtol=1e-10, atol=1e-10)
    w = torch.randn_like(fast)
    leaves = [xs["x"], xs["dt"], xs["B"], xs["C"], A, D, bias]
    for a, c in zip(torch.autograd.grad((fast * w).sum(), leaves), torch.autograd.grad((slow * w).sum(), leaves)):
        torch.testing.assert_close(a, c, rtol=1e-9, atol=1e-9)


def test_conv_window_is_each_tokens_chain_window(planned):
    """The schedule's [N, W] windows (for whole-batch gather convs) give the chain walk's conv."""
    plan, sched = planned
    N, D, W = plan.num_rows * plan.seq_len, 3, sched.conv_width
    x, w = torch.randn(N, D, dtype=F64), torch.randn(D, W, dtype=F64)
    xe = torch.cat([x, x.new_zeros(1, D)])
    win = sched.conv_window
    gathered = sum(xe[win[:, j]] * w[:, j] for j in range(W))
    torch.testing.assert_close(gathered, naive_tree_causal_conv1d(x, w, None, plan), rtol=1e-12, atol=1e-12)
