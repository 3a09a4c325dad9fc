"""What the Megatron backend cannot run exactly is refused by name, before any compute.

Each refusal names the module's path (or the config field), its class and why; each case
also shows the refused thing is reached: the same model without it is admitted.
"""

from __future__ import annotations

import re
from types import SimpleNamespace

import oracle
import pytest
import torch
import transformers

from treepack.proto.errors import RequestError, UnsupportedModelError
from treepack.trainer import materialize
from treepack.trainer.megatron import check_megatron_model, from_hf, megatron_refusals, packed_forward


@pytest.fixture(scope="module")
def model():
    return from_hf(oracle.hf_model("llama-gqa"), tp=1)


@pytest.fixture(scope="module")
def batch():
    seqs, _, plan, _ = oracle.tree_case(0)
    return materialize(plan, seqs)


def _refused(model, match: str) -> UnsupportedModelError:
    with pytest.raises(UnsupportedModelError, match=match) as e:
        check_megatron_model(model)
    return e.value


def test_admitted_model_has_no_refusal(model):
    assert megatron_refusals(model) == []


@pytest.mark.parametrize(
    ("field", "value", "match"),
    [
        ("sequence_parallel", True, r"config.sequence_parallel .*sequence parallel"),
        ("hidden_dropout", 0.1, r"config.hidden_dropout .*draws random numbers"),
        ("attention_dropout", 0.1, r"config.attention_dropout .*draws random numbers"),
        ("context_parallel_size", 2, r"config.context_parallel_size"),
        ("window_size", (8, 0), r"config.window_size .*sliding-window"),
        ("softmax_type", "learnable", r"config.softmax_type .*attention sinks"),
        ("multi_latent_attention", True, r"config.multi_latent_attention"),
        ("mtp_num_layers", 1, r"config.mtp_num_layers"),
        ("apply_query_key_layer_scaling", True, r"config.apply_query_key_layer_scaling"),
    ],
)
def test_config_refusals(model, field, value, match):
    old = getattr(model.config, field)
    setattr(model.config, field, value)
    try:
        err = _refused(model, match)
        assert any(p == f"config.{field}" for p, _, _ in err.refusals)
    finally:
        setattr(model.config, field, old)
    check_megatron_model(model)


@pytest.mark.parametrize(
    ("fields", "match"),
    [
        ({"moe_expert_capacity_factor": 1.0}, r"moe_expert_capacity_factor .*token dropping"),
        ({"moe_input_jitter_eps": 0.01}, r"moe_input_jitter_eps .*random numbers"),
        ({"moe_aux_loss_coeff": 0.01}, r"moe_aux_loss_coeff .*load-balancing loss"),
        ({"moe_z_loss_coeff": 0.001}, r"moe_z_loss_coeff"),
        ({"moe_router_enable_expert_bias": True}, r"moe_router_enable_expert_bias .*tokens per expert"),
    ],
)
def test_moe_config_refusals(model, fields, match):
    """The MoE settings whose result depends on the batch or on random numbers (the config checks alone)."""
    from treepack.trainer.megatron.spec import config_refusals

    cfg = SimpleNamespace(num_moe_experts=4, **fields)
    assert any(re.search(match, f"{p} {r}") for p, _, r in config_refusals(cfg))
    assert config_refusals(SimpleNamespace(num_moe_experts=4)) == []


def test_unknown_module_is_refused(model):
    layer = model.decoder.layers[0]
    stock = layer.mlp
    layer.mlp = torch.nn.Sequential(stock)
    try:
        err = _refused(model, r"decoder.layers.0.mlp \(Sequential\): torch.nn.modules.container.Sequential is not")
        assert ("decoder.layers.0.mlp", "Sequential") in [(p, c) for p, c, _ in err.refusals]
    finally:
        layer.mlp = stock


def test_transformer_engine_module_is_refused(model):
    """A module from Megatron's TE extension (TE itself cannot be installed on a CPU host: its class
    is re-homed here by its module path, which is what the admission reads)."""
    te_like = type(
        "TEDotProductAttention", (torch.nn.Module,), {"__module__": "megatron.core.extensions.transformer_engine"}
    )
    attn = model.decoder.layers[1].self_attention
    stock = attn.core_attention
    attn.core_attention = te_like()
    try:
        err = _refused(
            model, r"decoder.layers.1.self_attention.core_attention \(TEDotProductAttention\): a Transformer"
        )
        assert any("not TreeDotProductAttention" in r for _, _, r in err.refusals)
    finally:
        attn.core_attention = stock


def test_mamba_and_gated_delta_net_layers_are_refused(model):
    """Megatron's Mamba mixer needs the mamba_ssm / causal-conv1d kernels, which do not build on a
    CPU host: its class (and the ssm package's gated delta net) is re-homed here by module path."""
    stock = model.decoder.layers[0].mlp
    for home, cls in (("megatron.core.ssm.mamba_mixer", "MambaMixer"), ("megatron.core.ssm.gated_delta_net", "GDN")):
        model.decoder.layers[0].mlp = type(cls, (torch.nn.Module,), {"__module__": home})()
        try:
            _refused(model, rf"decoder.layers.0.mlp \({cls}\): Mamba / hybrid layers are not wired")
        finally:
            model.decoder.layers[0].mlp = stock
    check_megatron_model(model)


def test_causal_mask_type_and_stock_core_attention_are_refused():
    """The stock local spec (DotProductAttention, mask type causal): refused, both named, for every layer."""
    from megatron.bridge.models.gpt_provider import local_layer_spec

    from treepack.trainer.megatron import bridge

    hf = oracle.hf_model("llama-gqa")
    b, _ = bridge._bridge_of(hf, None)
    prov = bridge._provider(b, 1, torch.float32, False)
    prov.transformer_layer_spec = local_layer_spec
    stock = prov.provide()
    b.load_hf_weights([stock])
    reasons = [(p, r) for p, _, r in megatron_refusals(stock)]
    for i in range(2):
        path = f"decoder.layers.{i}.self_attention"
        assert (path, "attn_mask_type causal: tree rows need arbitrary") in reasons
        assert (path, "its core attention is not TreeDotProductAttention") in reasons
    assert ("rotary_pos_emb", "stock RoPE embeds range(seq_len), not the plan's position_ids") in reasons


def test_tree_core_attention_asserts_arbitrary_mask_type(model, batch):
    from megatron.core.transformer.enums import AttnMaskType

    core = model.decoder.layers[0].self_attention.core_attention
    q = torch.zeros(4, 1, 2, 16)
    with pytest.raises(AssertionError, match="mask type arbitrary"):
        core(q, q[:, :, :1], q[:, :, :1], None, attn_mask_type=AttnMaskType.causal)


def test_rope_types_without_exact_tree_positions_are_refused():
    cfg = oracle.FAMILIES["llama-gqa"]()
    cfg.rope_parameters = {
        "rope_type": "yarn",
        "factor": 4.0,
        "rope_theta": 10000.0,
        "original_max_position_embeddings": 64,
    }
    hf = transformers.LlamaForCausalLM(cfg)
    with pytest.raises(UnsupportedModelError, match=r"model.rotary_emb \(LlamaRotaryEmbedding\): rope_type 'yarn'"):
        from_hf(hf, tp=1)


def test_parallel_state_mismatch_and_bad_inputs(model, batch):
    with pytest.raises(RequestError, match="tp=2, but parallel_state has tensor parallel size 1"):
        from_hf(oracle.hf_model("llama-gqa"), tp=2)
    with pytest.raises(RequestError, match="is not a checkpoint directory"):
        from_hf("/nonexistent/checkpoint", tp=1)
    with pytest.raises(RequestError, match="backend must be one of"):
        packed_forward(model, batch, backend="eager")


def test_recompute_needs_the_sdpa_backend(model, batch):
    model.config.recompute_granularity = "full"
    try:
        with pytest.raises(RequestError, match="activation recomputation needs backend='sdpa'"):
            packed_forward(model, batch, backend="flex")
    finally:
        model.config.recompute_granularity = None


def test_unloaded_parameters_are_refused():
    """Bridge 0.6.2 maps Qwen3-MoE's experts per expert (``experts.{i}.gate_proj``), transformers 5
    fuses them (``experts.gate_up_proj``): the experts stay unloaded, and from_hf names them
    instead of returning a model of uninitialized experts. The dense model's load is complete."""
    hf = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(**oracle.MOE))
    with pytest.raises(UnsupportedModelError, match=r"16 parameter\(s\) unloaded") as e:
        from_hf(hf, tp=1)
    assert all(".mlp.experts.local_experts." in p for p, _, _ in e.value.refusals)
    assert all("left it unloaded" in r for _, _, r in e.value.refusals)
