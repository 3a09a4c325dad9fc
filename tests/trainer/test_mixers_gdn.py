"""Gated DeltaNet variants found by mechanism: OLMo-hybrid's GDN and renamed / subclassed Qwen3-Next GDN.

OLMo-hybrid runs its own GDN layer (separate projections, a ``g_proj`` gate, negative
eigenvalues); a renamed subclass of Qwen3-Next's GDN layer must be patched although its
class name is unknown, and a subclass that changes the computation must not be.
"""

from __future__ import annotations

import math

import torch

from treepack.trainer.hf.layers import is_handled, mixer_kind, patch_layers, unhandled_reason
from treepack.trainer.hf.layers.stock import forward_fingerprint

from helpers.mixers import VOCAB, assert_oracle, mixer_case, run_oracle

GDN_DIMS = dict(linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8)


def olmo_hybrid(neg_eigval: bool = True):
    from transformers import OlmoHybridConfig, OlmoHybridForCausalLM

    cfg = OlmoHybridConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=3,
        num_attention_heads=2,
        num_key_value_heads=1,
        layer_types=["linear_attention", "full_attention", "linear_attention"],
        linear_conv_kernel_dim=4,
        linear_allow_neg_eigval=neg_eigval,
        max_position_embeddings=512,
        initializer_range=0.08,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        **GDN_DIMS,
    )
    return OlmoHybridForCausalLM(cfg)


def _long_memory(model):
    with torch.no_grad():
        for m in model.modules():
            if mixer_kind(m) in ("gdn", "gdn_olmo"):
                m.A_log.uniform_(math.log(0.02), math.log(0.3))


def test_olmo_hybrid_oracle():
    torch.manual_seed(0)
    model = olmo_hybrid().float().eval()
    model.set_attn_implementation("eager")
    _long_memory(model)
    mixers = [q for q, m in model.named_modules() if mixer_kind(m) == "gdn_olmo"]
    assert len(mixers) == 2 and all(is_handled(m) for m in model.modules() if mixer_kind(m))
    assert patch_layers(model) == mixers
    figures = run_oracle(model, mixer_case(conv_width=4), model.get_input_embeddings())
    print(f"\nolmo_hybrid: {figures}")
    assert_oracle(figures)


def _qwen3_next_with(layer_cls_factory):
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    cfg = Qwen3NextConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        layer_types=["linear_attention", "full_attention"],
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        linear_conv_kernel_dim=4,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=16,
        shared_expert_intermediate_size=16,
        decoder_sparse_step=2,
        initializer_range=0.08,
        max_position_embeddings=512,
        **GDN_DIMS,
    )
    torch.manual_seed(0)
    model = Qwen3NextForCausalLM(cfg).float().eval()
    model.set_attn_implementation("eager")
    layer = model.model.layers[0]
    derived = layer_cls_factory()(cfg, 0)
    derived.load_state_dict(layer.linear_attn.state_dict())
    layer.linear_attn = derived
    _long_memory(model)
    return model


def test_renamed_qwen3_next_gdn_subclass_is_patched_and_exact():
    from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextGatedDeltaNet

    model = _qwen3_next_with(lambda: type("AcmeLinearMixer", (Qwen3NextGatedDeltaNet,), {}))
    assert mixer_kind(model.model.layers[0].linear_attn) == "gdn" and is_handled(model.model.layers[0].linear_attn)
    assert patch_layers(model) == ["model.layers.0.linear_attn"]
    figures = run_oracle(model, mixer_case(conv_width=4), model.get_input_embeddings())
    print(f"\nrenamed qwen3_next gdn: {figures}")
    assert_oracle(figures)


def test_gdn_subclass_that_changes_forward_is_refused():
    from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextGatedDeltaNet

    class Halved(Qwen3NextGatedDeltaNet):
        def forward(self, hidden_states, cache=None, attention_mask=None, **kwargs):
            return 0.5 * super().forward(hidden_states, cache=cache, attention_mask=attention_mask, **kwargs)

    model = _qwen3_next_with(lambda: Halved)
    layer = model.model.layers[0].linear_attn
    assert mixer_kind(layer) == "gdn" and not is_handled(layer)
    assert "not the code of a stock gdn layer" in unhandled_reason(layer)
    assert patch_layers(model) == []


def test_stock_copies_share_oneforward_fingerprint():
    """HF's modular copies (Qwen3.5 dense / MoE GDN) are recognised as the same code."""
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5GatedDeltaNet
    from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeGatedDeltaNet
    from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextGatedDeltaNet

    assert forward_fingerprint(Qwen3_5GatedDeltaNet.forward) == forward_fingerprint(Qwen3_5MoeGatedDeltaNet.forward)
    assert forward_fingerprint(Qwen3_5GatedDeltaNet.forward) != forward_fingerprint(Qwen3NextGatedDeltaNet.forward)


def test_fingerprint_follows_the_module_level_helpers():
    """Same forward code calling a helper of the same name but other code: not the same layer."""
    src = "def helper(x):\n    return x * {}\n\ndef forward(self, x):\n    return helper(x) + 1\n"
    a, b, c = {}, {}, {}
    exec(src.format(2), a)  # noqa: S102 - two modules' worth of code, built in the test
    exec(src.format(3), b)  # noqa: S102
    exec(src.format(2), c)  # noqa: S102
    assert forward_fingerprint(a["forward"]) != forward_fingerprint(b["forward"])
    assert forward_fingerprint(a["forward"]) == forward_fingerprint(c["forward"])


def test_pure_mamba_mixers_are_mixers_but_not_handled():
    """MambaMixer / FalconMambaMixer have Jamba's structure but not its code (no dt/B/C norms): refused."""
    from transformers import FalconMambaConfig, FalconMambaForCausalLM, MambaConfig, MambaForCausalLM

    for model_cls, cfg in ((MambaForCausalLM, MambaConfig), (FalconMambaForCausalLM, FalconMambaConfig)):
        with torch.device("meta"):
            model = model_cls(cfg(vocab_size=VOCAB, hidden_size=16, state_size=4, num_hidden_layers=1))
        (layer,) = [m for m in model.modules() if mixer_kind(m)]
        assert mixer_kind(layer) == "mamba" and not is_handled(layer)
        assert "JambaMambaMixer" in unhandled_reason(layer)
