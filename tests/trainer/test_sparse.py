"""Sparse top-k indexer attention on tree rows (treepack.trainer.kernels.sparse).

fast == naive for the tree top-k and the gathered attention; the op-level oracle (each
sequence's picks and outputs from the packed row equal those of the sequence alone, with
many exact score ties); picks never leave the ancestor chain; bad input.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from treepack.proto.errors import RequestError
from treepack.service.planner import naive_tree_mask
from treepack.trainer.kernels.sparse import (
    indexer_scores,
    naive_sparse_attention,
    naive_tree_topk,
    shard_tree_topk,
    sparse_attention,
    tree_topk,
    tree_visibility,
)

from helpers.trees import tree_plan


@pytest.fixture(scope="module")
def planned():
    seqs, _, plan = tree_plan(7, seq_len=160, min_shared_len=2, max_len=150, trees=3, depth=3)
    se = torch.from_numpy(plan.subtree_end())
    pos = torch.from_numpy(plan.position_ids())
    return plan, se, pos


def _tied_scores(shape, seed):
    """Scores from a few values (0 dominant), so ties straddle every top-k boundary."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 4, shape, generator=g).float() * (torch.rand(shape, generator=g) < 0.4)


def test_visibility_is_the_ancestor_relation(planned):
    plan, se, _ = planned
    vis = tree_visibility(se)
    for r in range(plan.num_rows):
        L = int(plan.row_len[r])
        assert torch.equal(vis[r, :L, :L], torch.from_numpy(naive_tree_mask(plan, r)))


@pytest.mark.parametrize("k", [1, 3, 8, 40])
def test_tree_topk_equals_naive(planned, k):
    plan, se, pos = planned
    rows = slice(0, 2)
    scores = _tied_scores((2, plan.seq_len, plan.seq_len), seed=k)
    a = tree_topk(scores, se[rows], pos[rows], k)
    b = naive_tree_topk(scores, se[rows], pos[rows], k)
    assert torch.equal(a[1], b[1])
    assert torch.equal(torch.where(a[1], a[0], -1), torch.where(b[1], b[0], -1))
    assert a[1].any() and (k == 1 or (~a[1]).any()), "both dropped and kept picks must occur (vacuity guard)"


@pytest.mark.parametrize("cp", [2, 3])
def test_shard_topk_is_the_rows_of_tree_topk(planned, cp):
    """A context-parallel shard's queries pick what the whole row's top-k picks for them (ties included)."""
    plan, se, pos = planned
    C, k = plan.seq_len, 8
    scores = _tied_scores((2, C, C), seed=cp)
    whole = tree_topk(scores, se[:2], pos[:2], k)
    Ls = -(-C // cp)
    for r in range(cp):
        a = r * Ls
        part = torch.cat(
            [scores[:, a : a + Ls], scores.new_zeros(2, max(0, a + Ls - C), C)], dim=1
        )  # CP padding past C
        idx, valid = shard_tree_topk(part, se[:2], pos[:2], k, query_start=a)
        n = min(Ls, C - a)
        assert torch.equal(idx[:, :n], whole[0][:, a : a + n]) and torch.equal(valid[:, :n], whole[1][:, a : a + n])
        assert not valid[:, n:].any()  # padding queries see nothing
    with pytest.raises(RequestError, match="subtree_end"):
        shard_tree_topk(scores[:, :4], se[:2, :5], pos[:2], k, query_start=0)


def test_picks_stay_on_the_chain(planned):
    plan, se, pos = planned
    scores = torch.randn(plan.num_rows, plan.seq_len, plan.seq_len)
    idx, valid = tree_topk(scores, se, pos, 16)
    for r in range(plan.num_rows):
        L = int(plan.row_len[r])
        m = torch.from_numpy(naive_tree_mask(plan, r))
        q = torch.arange(L)[:, None].expand(-1, idx.shape[-1])
        ok = valid[r, :L]
        assert bool(m[q[ok], idx[r, :L][ok]].all()), f"row {r}: a pick left the query's ancestor chain"
        # Every visible key is picked when the query sees at most k keys.
        assert torch.equal(ok.sum(-1), m.sum(-1).clamp(max=16))


def test_packed_picks_and_outputs_equal_unpacked(planned):
    """Op-level oracle: per sequence, the same keys (by position) and the same outputs."""
    plan, se, pos = planned
    R, C, H, D, Dv, k = plan.num_rows, plan.seq_len, 4, 8, 6, 12
    g = torch.Generator().manual_seed(3)
    iq = torch.randn(R, C, 2, D, generator=g, dtype=torch.float64)
    ik = torch.randn(R, C, D, generator=g, dtype=torch.float64)
    w = torch.randn(R, C, 2, generator=g, dtype=torch.float64)
    q = torch.randn(R, H, C, D, generator=g, dtype=torch.float64)
    kk = torch.randn(R, 1, C, D, generator=g, dtype=torch.float64)
    v = torch.randn(R, 1, C, Dv, generator=g, dtype=torch.float64)
    scores = indexer_scores(iq, ik, w, 0.5)
    assert (scores == 0).float().mean() > 0.1, "ReLU ties at 0 must be frequent (vacuity guard)"
    idx, valid = tree_topk(scores, se, pos, k)
    out = sparse_attention(q, kk, v, idx, valid, 0.3)
    ptr, flat = plan.token_index()
    ties = 0
    for s in range(plan.num_sequences):
        r, t = plan.locate(s)
        t = torch.from_numpy(t)
        n = t.shape[0]
        # Alone: the sequence's own tokens, causal, no tree; ties by position = by index.
        sc = indexer_scores(iq[r, t][None], ik[r, t][None], w[r, t][None], 0.5)[0]
        causal = torch.ones(n, n, dtype=torch.bool).tril()
        sc = sc.masked_fill(~causal, float("-inf"))
        order = torch.sort(sc, dim=-1, descending=True, stable=True).indices[:, : min(k, C)]
        ok = causal.gather(-1, order)
        ties += int(((sc == 0) & causal).sum(-1).gt(1).sum())
        got = torch.where(valid[r, t], pos[r][idx[r, t]], -1)
        want = torch.where(ok, order, -1)[:, : got.shape[1]]
        assert torch.equal(got[:, : want.shape[1]], want), f"sequence {s}: picks differ from its own run"
        alone = sparse_attention(q[r][:, t][None], kk[r][:, t][None], v[r][:, t][None], order[None], ok[None], 0.3)
        torch.testing.assert_close(out[r, t], alone[0], rtol=1e-12, atol=1e-12)
    assert ties > 0


def test_sparse_attention_equals_naive(planned):
    plan, se, pos = planned
    g = torch.Generator().manual_seed(5)
    R, C = plan.num_rows, plan.seq_len
    q = torch.randn(R, 4, C, 8, generator=g, dtype=torch.float64, requires_grad=True)
    k = torch.randn(R, 2, C, 8, generator=g, dtype=torch.float64, requires_grad=True)
    v = torch.randn(R, 2, C, 5, generator=g, dtype=torch.float64, requires_grad=True)
    idx, valid = tree_topk(torch.randn(R, C, C, generator=g), se, pos, 10)
    a = sparse_attention(q, k, v, idx, valid, 0.4, block=37)
    b = naive_sparse_attention(q, k, v, idx, valid, 0.4)
    torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    ga = torch.autograd.grad(a.square().sum(), (q, k, v))
    gb = torch.autograd.grad(b.square().sum(), (q, k, v))
    for x, y in zip(ga, gb):
        torch.testing.assert_close(x, y, rtol=1e-10, atol=1e-10)


def test_sparse_rejects_bad_input(planned):
    plan, se, pos = planned
    C = plan.seq_len
    s = torch.zeros(1, C, C)
    with pytest.raises(RequestError, match="k must be a positive int"):
        tree_topk(s, se[:1], pos[:1], 0)
    with pytest.raises(RequestError, match="subtree_end must be"):
        tree_topk(s, se[:1, :-1], pos[:1], 4)
    with pytest.raises(RequestError, match=r"scores must be \[B, T, T\]"):
        tree_topk(s[:, :-1], se[:1], pos[:1], 4)
    q = torch.zeros(1, 3, C, 4)
    idx, valid = tree_topk(s, se[:1], pos[:1], 4)
    with pytest.raises(RequestError, match="multiple of Hk"):
        sparse_attention(q, torch.zeros(1, 2, C, 4), torch.zeros(1, 2, C, 4), idx, valid, 1.0)
    assert np.all(plan.row_len <= C)
