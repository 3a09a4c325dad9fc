"""The copy-free varlen path: one call per tree level over the rows read in place, merged by LSE.

Checked against the dense-mask SDPA reference and the gathered-keys path (forward and
backward, soft-capping, sinks, GQA), for the loop pair, the batched CPU pair and flash-attn's
pair through pure-torch stand-ins of its private functions (tests/helpers/flash_standin.py).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from treepack.trainer import materialize, naive_varlen_attention, tree_attention
from treepack.trainer.kernels.gpu_flash import flash_split
from treepack.trainer.kernels.varlen import CPU_SPLIT, varlen_attention
from treepack.trainer.kernels.varlen_levels import naive_varlen_levels, varlen_levels
from treepack.trainer.kernels.varlen_merge import NAIVE_SPLIT, SplitVarlen, levels_attention, split_of

from helpers.flash_standin import make_old_pair, make_pair
from helpers.tolerance import assert_close, assert_not_close
from helpers.trainer_cases import VOCAB, mixed_batch, plan_of, random_batch


def _batch(case):
    plan = plan_of(case)
    return materialize(plan, case["sequences"], trainable=case["trainable"], groups=case["groups"], advise=False)


def _tree_case(seed: int) -> dict:
    """A random prefix tree: 1-3 roots, up to 3 levels of branching (a loop, not recursion), each
    node a random segment; leaves (and some inner nodes) are sequences, trainable after their
    ancestors' tokens, so every inner node is a shared, untrained prefix."""
    rng = np.random.default_rng(seed)
    seqs: list[np.ndarray] = []
    trainable: list[int] = []
    stack = [(np.zeros(0, np.int64), 0) for _ in range(int(rng.integers(1, 4)))]
    while stack and len(seqs) < 12:
        prefix, depth = stack.pop()
        node = np.concatenate([prefix, rng.integers(0, VOCAB, int(rng.integers(1, 16)))])
        kids = int(rng.integers(0, 4)) if depth < 3 else 0
        if kids == 0 or rng.random() < 0.2:
            seqs.append(node)
            trainable.append(prefix.shape[0])
        stack.extend((node, depth + 1) for _ in range(kids))
    seq_len = int(max(s.shape[0] for s in seqs) + rng.integers(0, 24))
    msl = int(rng.integers(1, 6))
    return dict(sequences=seqs, trainable=trainable, groups=None, seq_len=seq_len, min_shared_len=msl)


def _qkv(batch, seed=0, heads=(4, 2), dim=8, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    K, L = batch.num_rows, batch.seq_len
    make = lambda h: torch.randn(K, h, L, dim, generator=g, dtype=dtype).requires_grad_()  # noqa: E731
    return make(heads[0]), make(heads[1]), make(heads[1])


def _run(batch, split, seed=0, dtype=torch.float32, **kw):
    """(output, grads of q, k, v (and sinks)) of the levels path through ``split`` (None: dense SDPA;
    ``"gathered"``: the gathered-keys layout through the loop kernel)."""
    q, k, v = _qkv(batch, seed, dtype=dtype)
    sinks = kw.pop("sinks", None)
    leaves = [q, k, v] + ([sinks] if sinks is not None else [])
    if split is None:
        out = tree_attention(q, k, v, batch, backend="sdpa", sinks=sinks, **kw)
    elif split == "gathered":  # the reference layout: every segment over its gathered ancestor keys
        fn = naive_varlen_attention
        out = tree_attention(q, k, v, batch, backend="flash", varlen_fn=fn, gather_keys=True, sinks=sinks, **kw)
    else:
        K, H, L, D = q.shape
        flat = lambda x: x.transpose(1, 2).reshape(K * L, x.shape[1], D)  # noqa: E731
        scale = D**-0.5
        o = levels_attention(flat(q), flat(k), flat(v), batch.varlen_levels(), split, scale=scale, sinks=sinks, **kw)
        out = o.view(K, L, H, D).transpose(1, 2)
    w = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed + 1), dtype=out.dtype)
    return out, torch.autograd.grad((out * w).sum(), leaves)


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 2**31 - 1))
def test_levels_equal_naive_levels(seed):
    batch = _batch(random_batch(seed))
    a, b = varlen_levels(batch.plan, batch.rows), naive_varlen_levels(batch.plan, batch.rows)
    assert len(a.levels) == len(b.levels) >= 1
    for x, y in zip(a.levels, b.levels):
        for f in ("q_start", "q_end", "k_start", "k_end", "max_seqlen_q", "max_seqlen_k", "causal", "pairs"):
            assert getattr(x, f) == getattr(y, f), f
        assert torch.equal(x.cu_seqlens_q, y.cu_seqlens_q) and torch.equal(x.cu_seqlens_k, y.cu_seqlens_k)
        for f in ("q_valid", "k_valid"):
            u, w = getattr(x, f), getattr(y, f)
            assert (u is None and w is None) or torch.equal(u, w), f
    # The own level tiles the flattened rows on both sides; every call's sequences end at its spans.
    own = a.levels[0]
    assert (own.q_start, own.q_end, own.k_start, own.k_end) == (0, a.size, 0, a.size) and own.causal
    for lv in a.levels:
        assert lv.cu_seqlens_q.dtype == torch.int32 and int(lv.cu_seqlens_q[0]) == 0
        assert int(lv.cu_seqlens_q[-1]) == lv.q_end - lv.q_start and int(lv.cu_seqlens_k[-1]) == lv.k_end - lv.k_start
    # Every visible pair is computed once: the levels' pairs add up to the tree mask's.
    assert sum(lv.pairs for lv in a.levels) == int(batch.dense_mask().sum())


def test_the_mixed_batch_levels_by_hand():
    """Rows of 64: the ancestor levels hold each shared segment once as keys, its subtree as queries."""
    batch = _batch(mixed_batch())
    lv = batch.varlen_levels()
    seg, L = batch.plan.segments, batch.seq_len
    assert len(lv.levels) == 1 + int(seg.depth.max())
    for d, level in enumerate(lv.levels[1:]):
        have = seg.depth == d
        parents = np.flatnonzero(have & (seg.subtree_end > seg.row_start + seg.length))
        starts = seg.row * L + seg.row_start
        assert int(level.k_valid.sum() if level.k_valid is not None else level.k_end - level.k_start) == int(
            seg.length[parents].sum()
        )
        assert level.k_start == starts[parents].min()
    # Keys read in place (each shared segment once per level) vs the gathered layout's copies.
    assert lv.keys_read < int(batch.varlen_meta().k_index.numel()) + batch.num_rows * L


PAIRS = {"naive": NAIVE_SPLIT, "cpu": CPU_SPLIT, "flash stand-in": flash_split(make_pair())}


@pytest.mark.parametrize("pair", list(PAIRS))
@pytest.mark.parametrize("variant", ["plain", "softcap", "sinks"])
def test_levels_equal_dense_forward_and_backward(pair, variant):
    """Outputs and gradients (q, k, v, sinks) equal the dense-mask reference on several layouts."""
    kw = {"softcap": dict(softcap=2.5), "sinks": dict(sinks=torch.randn(4).requires_grad_()), "plain": {}}[variant]
    for seed, case in ((0, mixed_batch()), (1, random_batch(5)), (2, random_batch(11))):
        batch = _batch(case)
        ref, ref_g = _run(batch, None, seed, **dict(kw))
        out, g = _run(batch, PAIRS[pair], seed, **dict(kw))
        assert_close(f"{pair} {variant} out", ref, out, atol=2e-5)
        assert_close(f"{pair} {variant} grads", list(ref_g), list(g), atol=2e-5)


@settings(max_examples=20, deadline=None)
@given(
    st.integers(0, 2**31 - 1),
    st.sampled_from([_tree_case, random_batch]),
    st.sampled_from(list(PAIRS)),
    st.sampled_from(["plain", "softcap", "sinks"]),
)
def test_copy_free_equals_gathered_and_dense_on_random_trees(seed, case, pair, variant):
    """Random trees: the copy-free levels, the gathered layout (the reference kept beside it) and
    the dense mask give the same outputs and gradients (q, k, v, sinks); dropping the ancestor
    levels (where a row shares anything) does not."""
    batch = _batch(case(seed))
    kw = {"softcap": dict(softcap=2.5), "plain": {}}.get(variant) or dict(sinks=torch.randn(4).requires_grad_())
    ref, ref_g = _run(batch, None, seed % 1000, **dict(kw))
    gathered, gathered_g = _run(batch, "gathered", seed % 1000, **dict(kw))
    out, g = _run(batch, PAIRS[pair], seed % 1000, **dict(kw))
    assert_close(f"{pair} {variant} gathered vs dense", ref, gathered, atol=2e-5)
    assert_close(f"{pair} {variant} gathered vs dense grads", list(ref_g), list(gathered_g), atol=2e-5)
    assert_close(f"{pair} {variant} copy-free vs gathered", gathered, out, atol=2e-5)
    assert_close(f"{pair} {variant} copy-free vs gathered grads", list(gathered_g), list(g), atol=2e-5)
    full = batch.varlen_levels()
    if sum(lv.pairs for lv in full.levels[1:]):  # a shared segment with keys seen by other segments
        batch._cache["varlen_levels"] = type(full)(size=full.size, levels=full.levels[:1])
        cut, _ = _run(batch, PAIRS[pair], seed % 1000, **dict(kw))
        assert_not_close(f"{pair} {variant} own level only", ref, cut, atol=1e-4)


def test_levels_equal_dense_in_float64():
    """The plain case to float64 rounding: the merge and the merged-LSE backward are exact."""
    batch = _batch(mixed_batch())
    ref, ref_g = _run(batch, None, 3, dtype=torch.float64)
    for split in (NAIVE_SPLIT, CPU_SPLIT):
        out, g = _run(batch, split, 3, dtype=torch.float64)
        assert_close("fp64 out", ref, out, atol=1e-12)
        assert_close("fp64 grads", list(ref_g), list(g), atol=1e-12)


def test_levels_equal_the_gathered_path_through_tree_attention():
    """tree_attention's flash backend: copy-free (default) == gathered keys (the reference beside it)."""
    batch = _batch(random_batch(7))
    outs = []
    for gather in (False, True):
        q, k, v = _qkv(batch, 4)
        o = tree_attention(q, k, v, batch, backend="flash", varlen_fn=varlen_attention, gather_keys=gather)
        outs.append((o, torch.autograd.grad(o.square().sum(), (q, k, v))))
    assert "varlen_levels" in batch._cache and ("varlen", None) in batch._cache
    assert_close("copy-free vs gathered", outs[1][0], outs[0][0], atol=2e-5)
    assert_close("copy-free vs gathered grads", list(outs[1][1]), list(outs[0][1]), atol=2e-5)


def test_gap_rows_are_never_read():
    """A kernel that leaves NaN in every row of a query-less or key-less sequence: still exact."""
    batch = _batch(mixed_batch())
    assert any(lv.q_valid is not None for lv in batch.varlen_levels().levels)  # the layout has gaps
    ref, ref_g = _run(batch, None, 5)
    out, g = _run(batch, flash_split(make_pair(poison=True)), 5)
    assert not torch.isnan(out).any()
    assert_close("poisoned gaps", ref, out, atol=2e-5)
    assert_close("poisoned gaps grads", list(ref_g), list(g), atol=2e-5)


def test_old_flash_signatures_bind_by_name():
    """The 2.5-era pair (window_size tuple, 8-value forward, gradients returned) runs the same."""
    batch = _batch(random_batch(3))
    split = flash_split(make_old_pair())
    assert split is not None
    ref, ref_g = _run(batch, None, 6)
    out, g = _run(batch, split, 6)
    assert_close("old pair", ref, out, atol=2e-5)
    assert_close("old pair grads", list(ref_g), list(g), atol=2e-5)
    with pytest.raises(RuntimeError, match="softcap"):
        _run(batch, split, 6, softcap=2.0)


def test_unknown_flash_signatures_and_missing_flash_give_no_pair():
    """A pair whose signature this adapter does not know is not used (None: the gathered path)."""
    fwd, bwd = make_pair()

    def renamed(query, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale, causal):
        return fwd(
            query, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale, causal
        )

    def needs_more(*args, mystery_flag, **kw):
        return bwd(*args, **kw)

    assert flash_split((renamed, bwd)) is None
    assert flash_split((fwd, needs_more)) is None
    assert flash_split() is None  # flash-attn is not installed here


def test_negative_controls_own_lse_and_no_merge_differ():
    """Each piece is load-bearing: a backward that uses each call's own LSE (what the stock autograd
    function does) gets the gradients wrong; dropping the ancestor levels gets the outputs wrong."""
    batch = _batch(mixed_batch())
    ref, ref_g = _run(batch, None, 8)

    own_lse: dict[int, torch.Tensor] = {}

    def fwd(q, k, v, *args):
        out, lse = CPU_SPLIT.forward(q, k, v, *args)
        own_lse[q.data_ptr() + q.shape[0]] = lse
        return out, lse

    def bwd(dout, q, k, v, out, lse, *args):
        return CPU_SPLIT.backward(dout, q, k, v, out, own_lse[q.data_ptr() + q.shape[0]], *args)

    out, g = _run(batch, SplitVarlen(forward=fwd, backward=bwd, name="own lse"), 8)
    assert_close("forward unchanged", ref, out, atol=2e-5)
    assert_not_close("own-LSE backward", list(ref_g), list(g), atol=1e-3)

    full = batch.varlen_levels()
    batch._cache["varlen_levels"] = type(full)(size=full.size, levels=full.levels[:1])
    out, _ = _run(batch, CPU_SPLIT, 8)
    assert_not_close("own level only", ref, out, atol=1e-3)


def test_registered_pairs_and_dispatch():
    """Stock-signature CPU kernels map to their pairs; a window, a chunk or an unregistered function
    runs the gathered path; sinks with a soft-cap stay refused."""
    assert split_of(naive_varlen_attention) is NAIVE_SPLIT and split_of(varlen_attention) is CPU_SPLIT
    assert split_of(lambda *a, **k: None) is None
    batch = _batch(mixed_batch())
    q, k, v = _qkv(batch)
    tree_attention(q, k, v, batch, backend="flash", varlen_fn=naive_varlen_attention, sliding_window=4)
    assert "varlen_levels" not in batch._cache
    tree_attention(q, k, v, batch, backend="flash", varlen_fn=lambda *a, **kw: naive_varlen_attention(*a, **kw))
    assert "varlen_levels" not in batch._cache
    from treepack.proto.errors import RequestError

    with pytest.raises(RequestError, match="soft-capping"):
        tree_attention(q, k, v, batch, backend="flash", varlen_fn=varlen_attention, sinks=torch.zeros(4), softcap=3.0)
