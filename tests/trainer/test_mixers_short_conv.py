"""LFM2's gated short convolution on tree rows: the reference against HF's layer, then the oracle.

LFM2's conv window is 3 (``conv_L_cache``); the plan is made with conv_width 4, so the
layer reads only the nearest context columns of each segment (a narrower layer is exact),
and inner segments of 1 token make a window span several ancestors.
"""

from __future__ import annotations

import pytest
import torch

from treepack.trainer.hf.layers import is_handled, mixer_kind, patch_layers
from treepack.trainer.kernels.short_conv import torch_gated_short_conv

from helpers.mixers import VOCAB, assert_oracle, mixer_case, run_oracle

COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=48,
    num_attention_heads=2,
    num_key_value_heads=1,
    max_position_embeddings=512,
    initializer_range=0.08,
)


def lfm2(conv_bias: bool = True):
    from transformers import Lfm2Config, Lfm2ForCausalLM

    return Lfm2ForCausalLM(
        Lfm2Config(
            **COMMON,
            num_hidden_layers=4,
            layer_types=["conv", "full_attention", "conv", "conv"],
            conv_bias=conv_bias,
            conv_L_cache=3,
        )
    )


def lfm2_moe():
    from transformers import Lfm2MoeConfig, Lfm2MoeForCausalLM

    cfg = Lfm2MoeConfig(
        **COMMON,
        num_hidden_layers=3,
        layer_types=["conv", "full_attention", "conv"],
        conv_L_cache=3,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=16,
        num_dense_layers=1,
    )
    return Lfm2MoeForCausalLM(cfg)


FAMILIES = {"lfm2": (lfm2, 3), "lfm2_no_bias": (lambda: lfm2(conv_bias=False), 3), "lfm2_moe": (lfm2_moe, 2)}


def _build(name):
    factory, n = FAMILIES[name]
    torch.manual_seed(0)
    model = factory().float().eval()
    model.set_attn_implementation("eager")
    return model, n


def test_gated_short_conv_equals_hf_layer():
    model, _ = _build("lfm2")
    layer = model.model.layers[0].conv
    h = torch.randn(2, 23, 32)
    with torch.no_grad():
        stock = layer(h)
        BCx = layer.in_proj(h).transpose(1, 2)
        ours = layer.out_proj(
            torch_gated_short_conv(BCx, layer.conv.weight.squeeze(1), layer.conv.bias).transpose(1, 2)
        )
    torch.testing.assert_close(ours, stock, rtol=1e-6, atol=1e-6)


@pytest.fixture(scope="module")
def case():
    return mixer_case(conv_width=4)


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_short_conv_family_oracle(name, case):
    model, n = _build(name)
    mixers = [q for q, m in model.named_modules() if mixer_kind(m) == "short_conv"]
    assert len(mixers) == n and all(is_handled(m) for m in model.modules() if mixer_kind(m))
    assert patch_layers(model) == mixers
    figures = run_oracle(model, case, model.get_input_embeddings())
    print(f"\n{name}: {figures}")
    assert_oracle(figures)
