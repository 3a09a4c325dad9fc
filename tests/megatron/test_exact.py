"""Tree rows through a Megatron GPTModel (TP = DP = 1, this process) equal HF running each sequence alone.

Per family (:data:`oracle.FAMILIES`): per-sequence log-probabilities, the GRPO loss and every
parameter gradient (converted to HF names by Bridge's export). Also: the unpacked conversion
(causal mask, positions 0..s-1) against HF, including Llama-3 rope scaling, the ``flex`` and
``flash`` attention backends, a checkpoint directory, CISPO and the vocab-parallel entropy.

Negative controls (each must miss HF by more than ``oracle.CONTROL_GAP``): Megatron's stock
RoPE over ``range(seq_len)``, a causal row mask instead of the tree mask, and Megatron's own
Llama-3 rope scaling (the conversion that is 4e-3 off even unpacked).
"""

from __future__ import annotations

import numpy as np
import oracle
import pytest
import torch
import transformers

from treepack.trainer import materialize, naive_varlen_attention
from treepack.trainer.losses import cispo_loss, naive_cispo_loss
from treepack.trainer.megatron import (
    from_hf,
    naive_vocab_parallel_target_logprobs,
    packed_forward,
    tree_attention_mask,
    vocab_parallel_target_logprobs,
)
from treepack.trainer.megatron.context import MegatronRows, use_rows

from helpers.tolerance import assert_close, max_abs_err


@pytest.fixture(scope="module")
def case():
    seqs, prompts, plan, adv = oracle.tree_case(0)
    seg = plan.segments
    assert plan.stats.tree_tokens < plan.stats.unpacked_tokens  # the rows share prefixes
    assert int(seg.depth.max()) >= 1 and (np.bincount(seg.row[seg.parent < 0]) >= 2).any()  # branches, several trees
    return seqs, prompts, plan, adv


@pytest.fixture(scope="module")
def built():
    """Per family: (HF model, the Megatron model, the HF-alone reference of the case)."""
    cache: dict = {}

    def get(family, case):
        if family not in cache:
            hf = oracle.hf_model(family)
            seqs, prompts, _, adv = case
            cache[family] = (hf, from_hf(hf, tp=1), oracle.hf_alone(hf, seqs, prompts, adv))
        return cache[family]

    return get


@pytest.mark.parametrize("family", list(oracle.FAMILIES))
def test_packed_step_equals_hf_alone(family, case, built):
    seqs, _, plan, adv = case
    hf, model, ref = built(family, case)
    model.zero_grad(set_to_none=True)
    r = oracle.step(model, plan, seqs, adv)
    oracle.compare(family, 1, 1, "sdpa", ref, r["lps"], r["loss"], oracle.hf_grads(model, oracle.hf_bridge(hf)))


def test_flash_backend_equals_hf_alone(case, built):
    """The varlen path (flash_attn_varlen_func on a GPU; its loop reference on CPU)."""
    seqs, _, plan, adv = case
    hf, model, ref = built("qwen3-qknorm", case)
    model.zero_grad(set_to_none=True)
    r = oracle.step(model, plan, seqs, adv, backend="flash", varlen_fn=naive_varlen_attention)
    grads = oracle.hf_grads(model, oracle.hf_bridge(hf))
    oracle.compare("qwen3-qknorm", 1, 1, "flash", ref, r["lps"], r["loss"], grads)


def test_flex_backend_forward_equals_hf_alone(case, built):
    """FlexAttention's BlockMask (forward only: torch has no FlexAttention backward on CPU)."""
    seqs, _, plan, _ = case
    _, model, (ref_lps, _, _) = built("qwen3-qknorm", case)
    batch = materialize(plan, seqs)
    with torch.no_grad():
        logits = packed_forward(model, batch, backend="flex")
    lp = vocab_parallel_target_logprobs(logits, batch, vocab_size=model.config.vocab_size)
    lps = [None if x is None else x.double() for x in batch.unpack_logprobs(lp)]
    oracle.EXACTNESS.append(("qwen3-qknorm", 1, 1, "flex", max_abs_err(ref_lps, lps), float("nan"), float("nan")))
    assert_close("flex logprobs", ref_lps, lps, atol=oracle.TOL)


@pytest.mark.parametrize("family", ["llama-gqa", "llama3-rope-scaling"])
def test_unpacked_conversion_equals_hf(family, case, built):
    """The converted model on one plain sequence (causal mask, positions 0..n-1) is HF's logits."""
    hf, model, _ = built(family, case)
    ids = torch.as_tensor(case[0][0].astype(np.int64))[None]
    n = ids.shape[1]
    causal = ~torch.tril(torch.ones(n, n, dtype=torch.bool))[None, None]
    with torch.no_grad():
        got = model(input_ids=ids, position_ids=torch.arange(n)[None], attention_mask=causal)
        want = hf(input_ids=ids).logits
    assert_close(f"{family} unpacked logits", want, got[..., : want.shape[-1]], atol=oracle.TOL)


def _rows_logprobs(model, batch, mask, rows=True):
    """Per-sequence log-probabilities of the model run on the rows directly (bypassing the admission)."""
    ctx = MegatronRows(batch=batch, position_ids=batch.position_ids) if rows else None
    with torch.no_grad():
        if ctx is None:
            logits = model(input_ids=batch.input_ids, position_ids=batch.position_ids, attention_mask=mask)
        else:
            with use_rows(ctx):
                logits = model(input_ids=batch.input_ids, position_ids=batch.position_ids, attention_mask=mask)
    lp = vocab_parallel_target_logprobs(logits, batch, vocab_size=model.config.vocab_size)
    return [None if x is None else x.double() for x in batch.unpack_logprobs(lp)]


def test_controls_stock_rope_and_causal_mask_are_caught(case, built):
    """Stock RoPE (row index as position) and a causal row mask: each refused by packed_forward,
    and, run anyway, far from HF alone; the tree modules on the same rows are exact."""
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    from treepack.proto.errors import UnsupportedModelError

    seqs, _, plan, _ = case
    _, model, (ref_lps, _, _) = built("llama-gqa", case)
    batch = materialize(plan, seqs)
    assert max_abs_err(ref_lps, _rows_logprobs(model, batch, tree_attention_mask(batch))) <= oracle.TOL
    n = batch.seq_len
    causal = ~torch.tril(torch.ones(n, n, dtype=torch.bool))[None, None].expand(batch.num_rows, 1, n, n)
    oracle.control("causal row mask (tree RoPE)", ref_lps, _rows_logprobs(model, batch, causal))

    tree_rope = model.rotary_pos_emb
    c = model.config
    stock = RotaryEmbedding(c.kv_channels, c.rotary_percent, rotary_base=c.rotary_base, use_cpu_initialization=True)
    stock.inv_freq = tree_rope.inv_freq.clone()  # the same frequencies: only the positions differ
    model.rotary_pos_emb = stock
    try:
        with pytest.raises(UnsupportedModelError, match="rotary_pos_emb.*stock RoPE embeds range"):
            packed_forward(model, batch)
        mask = tree_attention_mask(batch)
        oracle.control("stock RoPE over range(seq_len) (tree mask)", ref_lps, _rows_logprobs(model, batch, mask, False))
    finally:
        model.rotary_pos_emb = tree_rope


def test_control_megatron_llama3_scaling_is_off(case, built):
    """Megatron's own Llama-3 scaling (its hard-coded constants) is off even unpacked; from_hf's is exact."""
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    hf, model, _ = built("llama3-rope-scaling", case)
    c = model.config
    assert c.rope_scaling, "Bridge converts the checkpoint's Llama-3 scaling"
    stock = RotaryEmbedding(
        c.kv_channels,
        c.rotary_percent,
        rotary_base=c.rotary_base,
        rope_scaling=True,
        rope_scaling_factor=c.rope_scaling_factor,
        use_cpu_initialization=True,
    )
    ids = torch.as_tensor(case[0][0].astype(np.int64))[None]
    n = ids.shape[1]
    want = hf.model.rotary_emb.inv_freq.float()
    assert torch.equal(model.rotary_pos_emb.inv_freq, want)
    freq_err = float((stock.inv_freq - want).abs().max())
    tree_rope = model.rotary_pos_emb
    model.rotary_pos_emb = stock
    try:
        with torch.no_grad():
            causal = ~torch.tril(torch.ones(n, n, dtype=torch.bool))[None, None]
            got = model(input_ids=ids, position_ids=torch.arange(n)[None], attention_mask=causal)
            ref = torch.log_softmax(hf(input_ids=ids).logits.double(), -1)
        err = max_abs_err(ref, torch.log_softmax(got.double(), -1))
    finally:
        model.rotary_pos_emb = tree_rope
    oracle.CONTROLS.append((f"Megatron's Llama-3 rope scaling, unpacked (inv_freq off by {freq_err:.1e})", err))
    assert err > oracle.CONTROL_GAP, err


def test_from_checkpoint_directory(case, built, tmp_path):
    """from_hf(dir) (save_pretrained's output) gives the same model as from_hf(loaded model)."""
    seqs, _, plan, _ = case
    hf, model, _ = built("qwen2-bias", case)
    hf.save_pretrained(tmp_path)
    from_dir = from_hf(str(tmp_path), tp=1)
    batch = materialize(plan, seqs)
    with torch.no_grad():
        a, b = packed_forward(model, batch), packed_forward(from_dir, batch)
    assert_close("from_hf(dir) logits", a, b, atol=0.0)


def test_cispo_and_entropy(case, built):
    """CISPO on vocab-parallel log-probabilities equals its loop reference on HF alone; the
    entropy equals the one-device log-softmax's (and the all-gather reference's)."""
    seqs, prompts, plan, adv = case
    hf, model, (ref_lps, _, _) = built("llama-gqa", case)
    batch = materialize(plan, seqs)
    logits = packed_forward(model, batch)
    V = model.config.vocab_size
    lp, ent = vocab_parallel_target_logprobs(logits, batch, vocab_size=V, with_entropy=True)
    want_lp, want_ent = batch.target_logprobs(logits[..., :V], with_entropy=True)
    assert_close("logprobs vs one-device", want_lp, lp, atol=1e-6)
    assert_close("entropy vs one-device", want_ent, ent, atol=1e-5)
    nlp, nent = naive_vocab_parallel_target_logprobs(logits, batch, vocab_size=V, with_entropy=True)
    assert_close("entropy vs naive", nent, ent, atol=1e-5)
    old = torch.tensor([float(np.nanmean(x.numpy())) for x in ref_lps])  # one behaviour log-prob per sequence
    loss = cispo_loss(lp, batch, advantages=adv, old_logprobs=old)
    trainable = [torch.arange(len(x)) >= p for x, p in zip(seqs, prompts)]
    ref = naive_cispo_loss([torch.nan_to_num(x) for x in ref_lps], trainable, advantages=adv, old_logprobs=old)
    assert_close("cispo loss", ref, loss.double(), atol=oracle.TOL)
    assert abs(float(ref)) > 1e-3


def _moe_model():
    """A Megatron GPTModel with MoELayers (4 experts, top-2, no capacity: no token dropped) from a
    Qwen3-MoE config: Bridge converts the config; its weights are drawn here, because Bridge
    0.6.2 maps per-expert HF weights (``experts.{i}.gate_proj``) that transformers 5 fuses
    (``experts.gate_up_proj``), and from_hf refuses such a model (test_refusals)."""
    from treepack.trainer.megatron import bridge
    from treepack.trainer.megatron.rope import TreeRotaryEmbedding, hf_inv_freq
    from treepack.trainer.megatron.spec import check_megatron_model

    cfg = transformers.Qwen3MoeConfig(**oracle.MOE)
    hf = transformers.Qwen3MoeForCausalLM(cfg)
    b, _ = bridge._bridge_of(hf, None)
    model = bridge._provider(b, 1, torch.float32, False).provide()
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * (0.1 if p.ndim > 1 else 1.0) + (p.ndim == 1))
    model.rotary_pos_emb = TreeRotaryEmbedding(hf_inv_freq(hf))
    check_megatron_model(model)
    return model


def test_moe_layer_packed_equals_each_sequence_alone(case):
    """MoELayer (all-gather dispatcher, SequentialMLP experts) on tree rows equals the same model
    on each sequence alone (causal mask, positions 0..n-1): log-probabilities and gradients."""
    seqs, prompts, plan, adv = case
    model = _moe_model()
    assert type(model.decoder.layers[0].mlp).__name__ == "MoELayer"
    names = [n for n, _ in model.named_parameters()]
    params = list(model.parameters())
    r = oracle.step(model, plan, seqs, adv)
    g_packed = [p.grad.clone() for p in params]
    model.zero_grad(set_to_none=True)
    lps, trainable = [], []
    for x, p in zip(seqs, prompts):
        ids = torch.as_tensor(x.astype(np.int64))[None]
        n = ids.shape[1]
        causal = ~torch.tril(torch.ones(n, n, dtype=torch.bool))[None, None]
        logits = model(input_ids=ids, position_ids=torch.arange(n)[None], attention_mask=causal)[0].double()
        lp = torch.log_softmax(logits[:-1], -1).gather(1, ids[0, 1:, None])[:, 0]
        lp = torch.cat([lp.new_zeros(1), lp])
        lps.append(lp)
        trainable.append(torch.arange(n) >= p)
    from treepack.trainer.losses import naive_ppo_clip_loss, naive_sft_loss

    loss = naive_ppo_clip_loss(lps, trainable, advantages=adv) + naive_sft_loss(lps, trainable)
    loss.backward()
    ref = [torch.where(t, x.detach(), torch.full_like(x, float("nan"))) for x, t in zip(lps, trainable)]
    err = max_abs_err(ref, r["lps"])
    g_err = max(float((a - p.grad).abs().max() / p.grad.abs().max()) for a, p in zip(g_packed, params))
    oracle.EXACTNESS.append(("qwen3-moe (vs itself alone)", 1, 1, "sdpa", err, g_err, float((r["loss"] - loss).abs())))
    assert_close("moe logprobs", ref, r["lps"], atol=oracle.TOL)
    assert_close("moe grads", dict(zip(names, [p.grad for p in params])), dict(zip(names, g_packed)), ratio=oracle.TOL)
    batch = r["batch"]
    n = batch.seq_len
    causal = ~torch.tril(torch.ones(n, n, dtype=torch.bool))[None, None].expand(batch.num_rows, 1, n, n)
    oracle.control("qwen3-moe: causal row mask", ref, _rows_logprobs(model, batch, causal))
