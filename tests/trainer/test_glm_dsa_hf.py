"""The oracle for stock HF GLM-MoE-DSA (GLM-5 style, cross-layer shared indexer), fp32, CPU.

Layers ``full, shared, full, shared``: a shared layer has no indexer and attends to the
top-k its previous full layer picked. Packed (the DSA layers patched) against every
sequence alone through the stock model (inside ``reference_rules()``: indexers breaking
exact ties towards lower positions, as for DeepSeek-V3.2): logprobs <= 1e-5, parameter gradients <= 1e-4 relative.
Checks: each shared layer attends with its full layer's very selection; a shared layer
handed a stock selection is refused; off-chain picks (negative control) change the result;
ties straddle the top-k boundary, so the tie rule is exercised.
"""

from __future__ import annotations

import pytest
import torch

import treepack.trainer.hf.layers.dsa as dsa
from treepack.proto.errors import RequestError
from treepack.trainer import materialize
from treepack.trainer.hf import packed_forward
from treepack.trainer.hf.admission.guards import trust_hook
from treepack.trainer.hf.layers import patch_layers, reference_rules

from helpers.tolerance import assert_close, assert_not_close
from helpers.trees import param_grads, per_sequence_logprobs, scored_loss_pair, tree_plan

VOCAB = 97
TOPK = 8


def tiny_glm_moe_dsa(seed: int = 0):
    from transformers import GlmMoeDsaConfig, GlmMoeDsaForCausalLM

    cfg = GlmMoeDsaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=48,
        moe_intermediate_size=16,
        num_hidden_layers=4,
        first_k_dense_replace=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        n_shared_experts=1,
        n_routed_experts=4,
        n_group=1,
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
        indexer_types=["full", "shared", "full", "shared"],
    )
    torch.manual_seed(seed)
    model = GlmMoeDsaForCausalLM(cfg).float().eval()
    model.set_attn_implementation("eager")
    assert len(patch_layers(model)) == 4 + 2  # four attention layers, two indexers
    return model


def _alone(model, seqs, grad=False):
    with torch.set_grad_enabled(grad), reference_rules():
        return [
            torch.log_softmax(
                model(input_ids=torch.as_tensor(s, dtype=torch.int64)[None], use_cache=False).logits[0], -1
            )
            for s in seqs
        ]


def _packed(model, batch, grad=False):
    with torch.set_grad_enabled(grad):
        return torch.log_softmax(packed_forward(model, batch, backend="sdpa"), -1)


@pytest.fixture(scope="module")
def case():
    seqs, trainable, plan = tree_plan(
        300, min_shared_len=2, conv_width=4, tail=3, trees=3, depth=3, max_len=120, seq_len=160
    )
    model = tiny_glm_moe_dsa()
    batch = materialize(plan, seqs, trainable=trainable)
    return seqs, trainable, model, batch, _alone(model, seqs)


def test_logprobs_equal_alone(case):
    seqs, _, model, batch, ref = case
    assert_close("glm-moe-dsa logprobs", ref, per_sequence_logprobs(batch, _packed(model, batch)), atol=1e-5)


def test_grads_equal_alone(case):
    seqs, trainable, model, batch, _ = case
    ref = _alone(model, seqs, grad=True)
    loss, loss_ref = scored_loss_pair(seqs, trainable, ref, batch, _packed(model, batch, grad=True))
    assert_close("glm-moe-dsa loss", loss_ref.detach(), loss.detach(), atol=1e-5, ratio=1e-5)
    got, want = param_grads(model, loss, loss_ref)
    assert any("indexer" not in n and "layers.1.self_attn" in n for n in want), "no gradient reached a shared layer"
    assert_close("glm-moe-dsa grads", want, got, ratio=1e-4)


def test_shared_layers_attend_with_their_full_layers_selection(case, monkeypatch):
    _, _, model, batch, _ = case
    seen = []
    real = dsa.dsa_tree_attention

    def spy(attn, h, pe, b, shared=None):
        out, sel = real(attn, h, pe, b, shared=shared)
        seen.append((attn.layer_idx, attn.indexer is None, shared, sel))
        return out, sel

    monkeypatch.setattr(dsa, "dsa_tree_attention", spy)
    _packed(model, batch)
    assert [(i, s) for i, s, _, _ in seen] == [(0, False), (1, True), (2, False), (3, True)]
    for (_, _, _, full_sel), (_, _, shared_in, shared_sel) in ((seen[0], seen[1]), (seen[2], seen[3])):
        assert shared_in is full_sel and shared_sel is full_sel
    assert not torch.equal(seen[0][3].idx, seen[2][3].idx)  # two indexers, two selections


def test_a_shared_layer_without_a_tree_selection_is_refused(case):
    _, _, model, batch, _ = case
    attn = model.model.layers[1].self_attn
    h = torch.zeros(batch.num_rows, batch.seq_len, model.config.hidden_size)
    pe = model.model.rotary_emb(h, batch.position_ids)
    stock = torch.zeros(batch.num_rows, batch.seq_len, TOPK, dtype=torch.int32)
    with pytest.raises(
        RequestError, match=r"GlmMoeDsaAttention \(layer 1\) shares the top-k of an earlier layer but received Tensor"
    ):
        dsa.dsa_tree_attention(attn, h, pe, batch, shared=stock)


def test_off_chain_picks_change_the_result(case, monkeypatch):
    """Negative control: the full layers' indexers may pick any earlier key of the row."""
    seqs, _, model, batch, ref = case
    causal_only = torch.full_like(batch.subtree_end, batch.seq_len)
    real = dsa.tree_topk
    monkeypatch.setattr(dsa, "tree_topk", lambda s, se, pos, k: real(s, causal_only, pos, k))
    assert_not_close("off-chain picks", ref, per_sequence_logprobs(batch, _packed(model, batch)), atol=1e-3)


def test_ties_straddle_the_topk_boundary(case):
    """Vacuity guard for the tie rule: some query's k-th and (k+1)-th visible scores tie."""
    seqs, _, model, _, _ = case
    caught = []
    attn = model.model.layers[0].self_attn
    hook = attn.indexer.register_forward_pre_hook(trust_hook(lambda m, a, kw: caught.append(a)), with_kwargs=True)
    try:
        with torch.no_grad():
            model(input_ids=torch.as_tensor(max(seqs, key=len), dtype=torch.int64)[None])
    finally:
        hook.remove()
    h, q_resid, pe = caught[0][:3]
    scores = dsa.dsa_indexer_scores(attn.indexer, h, q_resid, pe)[0]
    n = scores.shape[0]
    top = scores.masked_fill(~torch.ones(n, n, dtype=torch.bool).tril(), float("-inf")).sort(-1, descending=True).values
    assert bool((top[TOPK:, TOPK - 1] == top[TOPK:, TOPK]).any()), (
        "no tie at the top-k boundary: the tie rule is untested"
    )
