"""The oracle for stock HF DeepSeek-V3.2 (MLA + DSA lightning indexer): tiny random model, fp32, CPU.

Packed (``packed_forward`` with the DSA layers patched) against every sequence alone
through the stock model, whose indexers break exact score ties towards lower positions
inside ``reference_rules()`` (the stock ``torch.topk`` order among ties is unspecified; the
test checks that the rule only reorders ties, and that outside it the indexers run
stock). Controls: letting the indexer pick keys off the query's ancestor chain changes the
result, and ties do straddle the top-k boundary in this model, so the tie rule is exercised.
A loss on one leaf gives exactly zero gradient off its chain.
"""

from __future__ import annotations

import pytest
import torch

import treepack.trainer.hf.layers.dsa as dsa
from treepack.trainer import materialize
from treepack.trainer.hf import packed_forward
from treepack.trainer.hf.admission.guards import trust_hook
from treepack.trainer.hf.layers import patch_layers, reference_rules

from helpers.tolerance import assert_close, assert_not_close
from helpers.trees import param_grads, per_sequence_logprobs, scored_loss_pair, tree_features, tree_plan

VOCAB = 97
TOPK = 8


def tiny_deepseek_v32(seed: int = 0):
    from transformers import DeepseekV32Config, DeepseekV32ForCausalLM

    cfg = DeepseekV32Config(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=48,
        moe_intermediate_size=16,
        num_hidden_layers=3,
        first_k_dense_replace=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        n_shared_experts=1,
        n_routed_experts=4,
        n_group=2,
        topk_group=1,
        num_experts_per_tok=2,
        kv_lora_rank=16,
        q_lora_rank=24,
        qk_rope_head_dim=8,
        qk_nope_head_dim=8,
        v_head_dim=8,
        index_topk=TOPK,
        index_head_dim=16,
        index_n_heads=4,
        initializer_range=0.08,
        max_position_embeddings=512,
    )
    torch.manual_seed(seed)
    model = DeepseekV32ForCausalLM(cfg).float().eval()
    model.set_attn_implementation("eager")
    patch_layers(model)
    return model


def _unpacked(model, seqs):
    with reference_rules():
        return [
            torch.log_softmax(
                model(input_ids=torch.as_tensor(s, dtype=torch.int64)[None], use_cache=False).logits[0].float(), -1
            )
            for s in seqs
        ]


def _packed(model, batch):
    return torch.log_softmax(packed_forward(model, batch, backend="sdpa").float(), -1)


@pytest.fixture(scope="module")
def case():
    seqs, trainable, plan = tree_plan(
        300, min_shared_len=2, conv_width=4, tail=3, trees=3, depth=3, max_len=160, seq_len=192
    )
    assert tree_features(plan, 4)["ok"]
    model = tiny_deepseek_v32()
    batch = materialize(plan, seqs, trainable=trainable)
    with torch.no_grad():
        ref = _unpacked(model, seqs)
    return seqs, trainable, plan, model, batch, ref


def test_packed_logprobs_equal_unpacked(case):
    seqs, _, plan, model, batch, ref = case
    with torch.no_grad():
        lp = _packed(model, batch)
    assert_close("packed logprobs", ref, per_sequence_logprobs(batch, lp), atol=1e-5)


def test_off_chain_picks_change_the_result(case, monkeypatch):
    """Negative control: an indexer that may pick any earlier key of the row (causal only)."""
    seqs, _, plan, model, batch, ref = case
    C = plan.seq_len
    causal_only = torch.full_like(batch.subtree_end, C)
    real = dsa.tree_topk
    monkeypatch.setattr(dsa, "tree_topk", lambda s, se, pos, k: real(s, causal_only, pos, k))
    with torch.no_grad():
        lp = _packed(model, batch)
    assert_not_close("off-chain picks", ref, per_sequence_logprobs(batch, lp), atol=1e-3)


def test_ties_straddle_the_topk_boundary(case):
    """Vacuity guard for the tie rule: some query's k-th and (k+1)-th visible scores tie."""
    seqs, _, plan, model, batch, _ = case
    caught = []
    attn = model.model.layers[0].self_attn
    hook = attn.indexer.register_forward_pre_hook(trust_hook(lambda m, a, kw: caught.append((a, kw))), with_kwargs=True)
    try:
        with torch.no_grad():
            model(input_ids=torch.as_tensor(seqs[0], dtype=torch.int64)[None])
    finally:
        hook.remove()
    (h, q_resid, pe, *_), _ = caught[0]
    scores = dsa.dsa_indexer_scores(attn.indexer, h, q_resid, pe)[0]
    n = scores.shape[0]
    scores = scores.masked_fill(~torch.ones(n, n, dtype=torch.bool).tril(), float("-inf"))
    top = scores.sort(-1, descending=True).values
    rows = torch.arange(TOPK, n)  # queries that see more than k keys
    assert bool((top[rows, TOPK - 1] == top[rows, TOPK]).any()), (
        "no tie at the top-k boundary: the tie rule is untested"
    )


def test_tiebreak_only_reorders_ties(case):
    """The position rule picks the same score values as the stock indexer's torch.topk."""
    seqs, _, plan, model, batch, _ = case
    ind = model.model.layers[1].self_attn.indexer
    stock = ind.__dict__[dsa.STOCK_ATTR]
    torch.manual_seed(1)
    h = torch.randn(2, 40, 32)
    q_resid = torch.randn(2, 40, 24)
    pos = torch.arange(40)[None].expand(2, -1)
    pe = model.model.rotary_emb(h, pos)
    mask = torch.ones(40, 40, dtype=torch.bool).tril()[None].expand(2, -1, -1)
    with torch.no_grad():
        with reference_rules():
            a = ind(h, q_resid, pe, mask, pos).long()
        b = stock(h, q_resid, pe, mask, pos).long()
        outside = ind(h, q_resid, pe, mask, pos).long()
        sc = dsa.dsa_indexer_scores(ind, h, q_resid, pe).masked_fill(~mask, float("-inf"))
    assert torch.equal(sc.gather(-1, a).sort(-1).values, sc.gather(-1, b).sort(-1).values)
    assert torch.equal(outside, b)  # outside the rule the patched indexer is the stock one, bitwise
    assert not torch.equal(a, b)  # vacuity guard: the rule did reorder ties here


def test_packed_gradients_equal_unpacked(case):
    seqs, trainable, plan, model, batch, _ = case
    ref = _unpacked(model, seqs)
    lp = _packed(model, batch)
    loss, loss_ref = scored_loss_pair(seqs, trainable, ref, batch, lp)
    assert_close("loss", loss_ref, loss, atol=1e-5, ratio=1e-5)
    got, want = param_grads(model, loss, loss_ref)
    assert_close("grad", want, got, atol=1e-9, ratio=1e-4)
    assert sum(float(g.abs().max()) > 0 for g in want.values()) > 15, "too few parameters got a gradient to compare"


def test_leaf_loss_gradient_is_zero_off_its_chain(case):
    seqs, _, plan, model, batch, _ = case
    seg = plan.segments
    has_child = set(seg.parent[seg.parent >= 0].tolist())
    leaf = next(
        s
        for s in range(seg.num_segments)
        if s not in has_child and seg.parent[s] >= 0 and (seg.parent == seg.parent[s]).sum() >= 2
    )
    seg_ids = torch.from_numpy(plan.segment_ids())
    on_chain, p = torch.zeros_like(seg_ids, dtype=torch.bool), leaf
    while p >= 0:
        on_chain |= seg_ids == p
        p = int(seg.parent[p])
    embeds = []
    hook = model.model.embed_tokens.register_forward_hook(trust_hook(lambda m, i, o: embeds.append(o)))
    try:
        lp = _packed(model, batch)
    finally:
        hook.remove()
    on_leaf = seg_ids == leaf
    (grad,) = torch.autograd.grad(
        lp[on_leaf][..., 3].sum() + lp[on_leaf][..., 7].sum(), embeds[-1]
    )  # the packed call: the probe (if any) ran before it
    per_pos = grad.abs().sum(-1)
    assert torch.count_nonzero(per_pos[~on_chain]) == 0, "gradient reached a sibling, another tree or padding"
    assert torch.count_nonzero(per_pos[on_leaf]) == int(on_leaf.sum())


def test_tiebreak_indexer_with_a_cache_matches_the_full_forward(case):
    """Unpacked decoding keeps the rule: prefill + one cached step == one full forward."""
    seqs, *_ = case
    model = case[3]
    x = torch.as_tensor(seqs[1][:50], dtype=torch.int64)[None]
    with torch.no_grad(), reference_rules():
        full = model(input_ids=x, use_cache=False).logits[0]
        pre = model(input_ids=x[:, :-1], use_cache=True)
        step = model(input_ids=x[:, -1:], cache=pre.cache, use_cache=True).logits[0, -1]
    torch.testing.assert_close(pre.logits[0], full[:-1], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(step, full[-1], rtol=1e-5, atol=1e-5)


def test_unpatched_sparse_layer_is_refused_not_run_dense(case):
    """Without the DSA patch the stock layer would hand top-k indices to the tree attention
    function, which would ignore them: the support check refuses before any compute."""
    from treepack.proto.errors import UnsupportedModelError
    from treepack.trainer.hf.layers import unpatch_layers

    seqs, _, plan, model, batch, _ = case
    assert unpatch_layers(model) > 0
    try:
        with torch.no_grad(), pytest.raises(UnsupportedModelError) as info:
            packed_forward(model, batch, backend="sdpa", patch_layers=False)
        assert "DeepseekV32Attention" in info.value.message and "patch_layers=False" in info.value.message
        with torch.no_grad():  # the default patches the layers again
            lp = torch.log_softmax(packed_forward(model, batch, backend="sdpa").float(), -1)
        assert not lp.isnan().any()
    finally:
        patch_layers(model)
