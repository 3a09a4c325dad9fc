"""The oracle for a stock HF Gated DeltaNet hybrid: tiny random Qwen3-Next, fp32, CPU.

Packed (``packed_forward`` with the GDN layers patched) against every sequence run alone
through the stock model: log-probabilities at every position (max abs diff <= 1e-5) and
parameter gradients of a loss on the scored positions (relative <= 1e-4), on trees with
inner segments shorter than the conv window, segments crossing 64-token chunks, depth >= 3
and several trees per row. Negative control: the same packed rows with the GDN layers
left stock (each row one linear scan) differ. A loss on one leaf gives exactly zero
gradient to the embeddings of its siblings, other trees and padding.
"""

from __future__ import annotations

import math

import pytest
import torch

from treepack.proto.errors import RequestError
from treepack.trainer import materialize
from treepack.trainer.hf import packed_forward
from treepack.trainer.hf.admission.guards import trust_hook
from treepack.trainer.hf.layers import patch_layers, unpatch_layers

from helpers.tolerance import assert_close, assert_not_close
from helpers.trainer_cases import unchecked_packed_logits
from helpers.trees import param_grads, per_sequence_logprobs, scored_loss_pair, tree_features, tree_plan

VOCAB = 97
# Dimensions both tiny hybrids share: layers 0, 1, 3 Gated DeltaNet, layer 2 full attention.
TINY_GDN_DIMS = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=4,
    layer_types=["linear_attention", "linear_attention", "full_attention", "linear_attention"],
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=16,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=8,
    linear_value_head_dim=8,
)


def tiny_qwen3_next(conv_width: int, seed: int = 0):
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    cfg = Qwen3NextConfig(
        **TINY_GDN_DIMS,
        linear_conv_kernel_dim=conv_width,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=16,
        shared_expert_intermediate_size=16,
        decoder_sparse_step=2,  # layers 1 and 3 MoE, 0 and 2 dense MLP
        initializer_range=0.08,  # fp32 noise of the stock model itself (vs fp64) stays ~5e-6 < 1e-5
        max_position_embeddings=512,
    )
    torch.manual_seed(seed)
    model = Qwen3NextForCausalLM(cfg).float().eval()
    with torch.no_grad():
        for layer in model.model.layers:
            if layer.block_type == "linear_attention":
                # Long memory (decay exp(-A * softplus(.)) close to 1), so the state carries
                # far and a wrong fork point shows; the stock init forgets within a few tokens.
                layer.linear_attn.A_log.uniform_(math.log(0.02), math.log(0.3))
    model.set_attn_implementation("eager")
    return model


def _unpacked(model, seqs):
    """Per sequence: [n, V] log-softmax of the stock model run on that sequence alone."""
    return [
        torch.log_softmax(
            model(input_ids=torch.as_tensor(s, dtype=torch.int64)[None], use_cache=False).logits[0].float(), -1
        )
        for s in seqs
    ]


def _packed_logprobs(model, batch, patch_layers=True):
    return torch.log_softmax(packed_forward(model, batch, backend="sdpa", patch_layers=patch_layers).float(), -1)


CASES = [(0, 2, 4), (100, 4, 6)]  # (seed, min_shared_len, conv width): W-1 > some inner segment


@pytest.fixture(scope="module", params=CASES, ids=lambda c: f"seed{c[0]}-msl{c[1]}-W{c[2]}")
def case(request):
    seed, msl, W = request.param
    seqs, trainable, plan = tree_plan(
        seed, min_shared_len=msl, conv_width=W, tail=3, trees=3, depth=3, max_len=160, seq_len=192
    )
    assert tree_features(plan, W)["ok"]
    model = tiny_qwen3_next(W)
    batch = materialize(plan, seqs, trainable=trainable)
    return seqs, trainable, plan, model, batch


def test_packed_logprobs_equal_unpacked_and_linear_scan_does_not(case):
    seqs, _, plan, model, batch = case
    with torch.no_grad():
        ref = _unpacked(model, seqs)
        unpatch_layers(model)
        scan = torch.log_softmax(
            unchecked_packed_logits(model, batch).float(), -1
        )  # GDN layers stock: each row one linear scan
        tree = _packed_logprobs(model, batch)  # packed_forward patches the GDN layers itself
        assert patch_layers(model) == [
            "model.layers.0.linear_attn",
            "model.layers.1.linear_attn",
            "model.layers.3.linear_attn",
        ]
    assert not tree.isnan().any()
    assert_close("packed logprobs", ref, per_sequence_logprobs(batch, tree), atol=1e-5)
    assert_not_close("a linear scan of the row", ref, per_sequence_logprobs(batch, scan), atol=1e-3)


def test_packed_gradients_equal_unpacked(case):
    seqs, trainable, plan, model, batch = case
    patch_layers(model)
    ref = _unpacked(model, seqs)
    lp = _packed_logprobs(model, batch)
    loss, loss_ref = scored_loss_pair(seqs, trainable, ref, batch, lp)
    assert_close("loss", loss_ref, loss, atol=1e-5, ratio=1e-5)
    got, want = param_grads(model, loss, loss_ref)
    assert_close("grad", want, got, atol=1e-9, ratio=1e-4)
    assert sum(float(g.abs().max()) > 0 for g in want.values()) > 20, "too few parameters got a gradient to compare"


def test_leaf_loss_gradient_is_zero_off_its_chain(case):
    _, _, plan, model, batch = case
    patch_layers(model)
    seg = plan.segments
    has_child = set(seg.parent[seg.parent >= 0].tolist())
    leaf = next(
        s
        for s in range(seg.num_segments)
        if s not in has_child and seg.parent[s] >= 0 and (seg.parent == seg.parent[s]).sum() >= 2
    )
    chain, p = set(), leaf
    while p >= 0:
        chain.add(p)
        p = int(seg.parent[p])
    seg_ids = torch.from_numpy(plan.segment_ids())
    embeds = []
    hook = model.model.embed_tokens.register_forward_hook(trust_hook(lambda m, i, o: embeds.append(o)))
    try:
        lp = _packed_logprobs(model, batch)
    finally:
        hook.remove()
    on_leaf = seg_ids == leaf
    (grad,) = torch.autograd.grad(
        lp[on_leaf][..., 5].sum() + lp[on_leaf][..., 11].sum(), embeds[-1]
    )  # the packed call: the probe (if any) ran before it
    on_chain = torch.zeros_like(on_leaf)
    for s in chain:
        on_chain |= seg_ids == s
    per_pos = grad.abs().sum(-1)
    assert torch.count_nonzero(per_pos[~on_chain]) == 0, "gradient reached a sibling, another tree or padding"
    assert torch.count_nonzero(per_pos[on_chain]) == int(on_chain.sum()), "every chain token should get gradient"


def test_conv_width_mismatch_is_a_clear_error(case):
    seqs, trainable, plan, model, batch = case
    other = tiny_qwen3_next(plan.gdn.conv_width + 1)
    patch_layers(other)
    # Refused by the support check before any layer runs (UnsupportedModelError is a RequestError).
    with pytest.raises(RequestError, match=r"causal conv has kernel \d+ but the plan was made with conv_width=\d+"):
        packed_forward(other, batch)


def test_a_conv_narrower_than_the_plan_is_exact(case):
    """The plan's conv context covers any kernel up to its conv_width: a narrower GDN conv is exact too."""
    seqs, trainable, plan, model, batch = case
    narrow = tiny_qwen3_next(plan.gdn.conv_width - 2)
    with torch.no_grad():
        ref = _unpacked(narrow, seqs)
        tree = _packed_logprobs(narrow, batch)
    assert_close("packed logprobs", ref, per_sequence_logprobs(batch, tree), atol=1e-5)


def test_qwen3_5_packed_logprobs_equal_unpacked():
    """Qwen3.5's GDN layer (separate q/k/v, z, b, a projections) runs through the same patch."""
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    cfg = Qwen3_5TextConfig(
        **TINY_GDN_DIMS,
        linear_conv_kernel_dim=4,
        initializer_range=0.08,
        max_position_embeddings=512,
    )
    torch.manual_seed(0)
    model = Qwen3_5ForCausalLM(cfg).float().eval()
    with torch.no_grad():
        for layer in model.model.layers:
            if hasattr(layer, "linear_attn"):
                layer.linear_attn.A_log.uniform_(math.log(0.02), math.log(0.3))
    model.set_attn_implementation("eager")
    seqs, trainable, plan = tree_plan(
        0, min_shared_len=2, conv_width=4, tail=3, trees=3, depth=3, max_len=160, seq_len=192
    )
    batch = materialize(plan, seqs, trainable=trainable)
    assert len(patch_layers(model)) == 3
    with torch.no_grad():
        ref = _unpacked(model, seqs)
        tree = _packed_logprobs(model, batch)
    assert_close("packed logprobs", ref, per_sequence_logprobs(batch, tree), atol=1e-5)


def test_activation_checkpointing_replays_the_tree_layers(case):
    """Recomputation in backward (outside packed_forward) still runs the tree GDN: same gradients."""
    _, _, plan, model, batch = case
    patch_layers(model)
    params = list(model.parameters())
    calls = []
    hooks = [
        layer.linear_attn.register_forward_hook(trust_hook(lambda *a: calls.append(1)))
        for layer in model.model.layers
        if hasattr(layer, "linear_attn")
    ]

    def grads():
        lp = torch.log_softmax(
            packed_forward(model, batch, verify=False).float(), -1
        )  # counts calls; checks exactness itself
        loss = lp.reshape(-1, lp.shape[-1])[batch.score_flat].gather(1, batch.score_target[:, None]).sum()
        return torch.autograd.grad(loss, params, allow_unused=True)

    try:
        plain = grads()
        n_plain = len(calls)
        model.train()
        enable = getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable
        enable()
        ckpt = grads()
    finally:
        (getattr(model, "activation_checkpointing_disable", None) or model.gradient_checkpointing_disable)()
        model.eval()
        for h in hooks:
            h.remove()
    assert len(calls) == 3 * n_plain, "the GDN layers were not recomputed in backward"
    for a, b in zip(plain, ckpt):
        if a is not None:
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
