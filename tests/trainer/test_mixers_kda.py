"""Kimi-Linear's Kimi Delta Attention: chunked reference == token by token == HF's slow paths, then the oracle.

KDA is the gated delta rule with a per-channel decay; its chunks are 64 tokens (fla's and
HF's), and the trees' segments cross 64-token chunks and branch inside them.
"""

from __future__ import annotations

import math

import pytest
import torch

from treepack.trainer.hf.layers import is_handled, mixer_kind, patch_layers
from treepack.trainer.kernels.kda import naive_recurrent_kda, torch_chunk_kda, tree_kda
from treepack.trainer.kernels.tree_scan import naive_tree_scan, tree_schedule

from helpers.mixers import VOCAB, assert_oracle, mixer_case, run_oracle
from helpers.trees import tree_plan

F64 = torch.float64


def _inputs(B, T, H=2, HV=2, K=4, V=3, dtype=F64, seed=0):
    gen = torch.Generator().manual_seed(seed)
    t = lambda *s: torch.randn(*s, generator=gen, dtype=dtype)  # noqa: E731
    return [
        t(B, T, H, K),
        t(B, T, H, K),
        t(B, T, HV, V),
        -torch.rand(B, T, HV, K, generator=gen, dtype=dtype) * 0.5,
        torch.rand(B, T, HV, generator=gen, dtype=dtype),
    ]


KDA_CASES = [(2, 37, 8, None, False, 2), (1, 50, 16, [0, 5, 5, 20, 21, 50], True, 2), (1, 70, 64, [0, 1, 70], True, 4)]


@pytest.mark.parametrize("B,T,chunk,cu,h0,HV", KDA_CASES)
def test_kda_chunked_equals_naive_with_gradients(B, T, chunk, cu, h0, HV):
    xs = [x.requires_grad_(True) for x in _inputs(B, T, HV=HV)]
    n = B if cu is None else len(cu) - 1
    kw = dict(output_final_state=True, use_qk_l2norm_in_kernel=True, chunk_size=chunk)
    if cu is not None:
        kw["cu_seqlens"] = torch.tensor(cu)
    if h0:
        kw["initial_state"] = torch.randn(n, HV, 4, 3, dtype=F64, requires_grad=True)
    o1, s1 = torch_chunk_kda(*xs, **kw)
    o2, s2 = naive_recurrent_kda(*xs, **kw)
    torch.testing.assert_close(o1, o2, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(s1, s2, rtol=1e-10, atol=1e-10)
    leaves = xs + ([kw["initial_state"]] if h0 else [])
    w = torch.randn_like(o1)
    for a, c in zip(
        torch.autograd.grad((o1 * w).sum() + s1.sum(), leaves), torch.autograd.grad((o2 * w).sum() + s2.sum(), leaves)
    ):
        torch.testing.assert_close(a, c, rtol=1e-9, atol=1e-9)


def test_kda_equals_hf_slow_paths():
    from transformers.models.kimi_linear.modeling_kimi_linear import (
        chunk_kimi_delta_attention,
        recurrent_kimi_delta_attention,
    )

    xs = _inputs(2, 75, dtype=torch.float32)
    h0 = torch.randn(2, 2, 4, 3)
    o, s = torch_chunk_kda(*xs, initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=True)
    for hf in (chunk_kimi_delta_attention, recurrent_kimi_delta_attention):
        o_hf, s_hf = hf(
            *xs[:3], g=xs[3], beta=xs[4], initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=True
        )
        torch.testing.assert_close(o, o_hf, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(s, s_hf, rtol=1e-5, atol=1e-5)


def test_tree_kda_equals_segment_walk():
    _, _, plan = tree_plan(3, min_shared_len=2, conv_width=4, trees=3, depth=3, max_len=120, seq_len=160)
    xs = [x[0] for x in _inputs(1, plan.num_rows * plan.seq_len)]
    fast = tree_kda(*xs, tree_schedule(plan), use_qk_l2norm_in_kernel=True)
    assert not fast.isnan().any()

    def run(seg, h0):
        o, fin = naive_recurrent_kda(
            *(x[None] for x in seg), initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=True
        )
        return o[0], fin

    torch.testing.assert_close(fast, naive_tree_scan(run, xs, plan, tuple(xs[2].shape[1:])), rtol=1e-10, atol=1e-10)


def kimi_linear():
    from transformers import KimiLinearConfig, KimiLinearForCausalLM

    cfg = KimiLinearConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=48,
        moe_intermediate_size=16,
        num_hidden_layers=3,
        num_attention_heads=2,
        num_key_value_heads=2,
        kv_lora_rank=16,
        q_lora_rank=None,
        qk_rope_head_dim=8,
        qk_nope_head_dim=8,
        v_head_dim=8,
        num_local_experts=4,
        num_experts_per_tok=2,
        n_shared_experts=1,
        layer_types=["linear_attention", "full_attention", "linear_attention"],
        linear_head_dim=8,
        linear_num_heads=2,
        linear_conv_kernel_dim=4,
        max_position_embeddings=512,
        initializer_range=0.08,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    return KimiLinearForCausalLM(cfg)


def test_kimi_linear_oracle():
    torch.manual_seed(0)
    model = kimi_linear().float().eval()
    model.set_attn_implementation("eager")
    with torch.no_grad():
        for m in model.modules():
            if mixer_kind(m) == "kda":  # slow per-channel decay, so a wrong fork point shows
                m.forget_gate.A_log.uniform_(math.log(0.02), math.log(0.3))
                m.forget_gate.dt_bias.uniform_(-3.0, -1.0)
    mixers = [q for q, m in model.named_modules() if mixer_kind(m) == "kda"]
    assert len(mixers) == 2 and all(is_handled(m) for m in model.modules() if mixer_kind(m))
    assert patch_layers(model) == mixers
    figures = run_oracle(model, mixer_case(conv_width=4), model.get_input_embeddings())
    print(f"\nkimi_linear: {figures}")
    assert_oracle(figures)
