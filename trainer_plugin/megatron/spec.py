"""The tree layer spec of a Megatron GPTModel, and its admission: exact on tree rows, or refused.

:func:`tree_layer_spec` is Megatron-Core's local (non-Transformer-Engine) GPT layer spec with
:class:`~treepack.trainer.megatron.attention.TreeDotProductAttention` as the core attention and
the self-attention's ``attn_mask_type`` forced to ``arbitrary``.

:func:`check_megatron_model` runs before any compute (in ``from_hf`` and every
``packed_forward``) and refuses, naming each module's path, its class and why:

- a config a tree row cannot run exactly: sequence parallel, context or pipeline
  parallelism, dropout, FP8/FP4, multi-latent attention, sliding windows, attention sinks,
  query-key layer scaling, MTP, a position embedding other than non-interleaved ``rope``;
  MoE with token dropping (a capacity factor: which tokens drop depends on the batch), input
  jitter (random numbers), an auxiliary / z loss or an expert-bias update (each counts the
  tokens of a batch, and packed rows count a shared prefix once);
- any module class outside the list this backend was checked with (:data:`_ALLOWED`):
  Transformer Engine modules (their attention takes cu_seqlens, which express no tree),
  Mamba and other mixers, unknown specs;
- a self-attention whose mask type is not ``arbitrary`` or whose core attention is not the
  tree one; a rotary embedding that is Megatron's stock one (it embeds ``range(seq_len)``).
"""

from __future__ import annotations

from typing import Any

from torch import nn

from treepack.proto.errors import UnsupportedModelError

__all__ = ["tree_layer_spec", "check_megatron_model", "megatron_refusals", "config_refusals", "refuse"]

# (module, class) pairs checked on tree rows; anything else is refused by name.
_ALLOWED = {
    ("megatron.core.models.gpt.gpt_model", "GPTModel"),
    ("megatron.core.models.common.embeddings.language_model_embedding", "LanguageModelEmbedding"),
    ("megatron.core.tensor_parallel.layers", "VocabParallelEmbedding"),
    ("megatron.core.tensor_parallel.layers", "ColumnParallelLinear"),
    ("megatron.core.tensor_parallel.layers", "RowParallelLinear"),
    ("megatron.core.transformer.transformer_block", "TransformerBlock"),
    ("megatron.core.transformer.transformer_layer", "TransformerLayer"),
    ("megatron.core.transformer.attention", "SelfAttention"),
    ("megatron.core.transformer.mlp", "MLP"),
    ("megatron.core.transformer.identity_op", "IdentityOp"),
    ("megatron.core.transformer.identity_op", "IdentityFuncOp"),
    ("megatron.core.fusions.fused_softmax", "FusedScaleMaskSoftmax"),
    ("torch.nn.modules.container", "ModuleList"),
    ("torch.nn.modules.dropout", "Dropout"),
    ("torch.nn.modules.normalization", "RMSNorm"),
    ("torch.nn.modules.normalization", "LayerNorm"),
    ("treepack.trainer.megatron.attention", "TreeDotProductAttention"),
    ("treepack.trainer.megatron.rope", "TreeRotaryEmbedding"),
}
_MOE_ALLOWED = {
    ("megatron.core.transformer.moe.moe_layer", "MoELayer"),
    ("megatron.core.transformer.moe.router", "TopKRouter"),
    ("megatron.core.transformer.moe.experts", "SequentialMLP"),
}


def tree_layer_spec(config: Any) -> Any:
    """Megatron's local GPT layer spec with the tree core attention and mask type ``arbitrary``.

    Args:
        config: the model's ``TransformerConfig`` (a Megatron-Bridge provider is one).

    Returns:
        A ``ModuleSpec`` of ``TransformerLayer``.
    """
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.attention import SelfAttention
    from megatron.core.transformer.enums import AttnMaskType

    from treepack.trainer.megatron.attention import TreeDotProductAttention

    spec = get_gpt_layer_local_spec(
        num_experts=config.num_moe_experts,
        moe_grouped_gemm=config.moe_grouped_gemm,
        qk_layernorm=config.qk_layernorm,
        normalization=config.normalization,
    )
    attn = spec.submodules.self_attention
    assert attn.module is SelfAttention, f"the local spec's self-attention is {attn.module}"
    attn.params = {**attn.params, "attn_mask_type": AttnMaskType.arbitrary}
    attn.submodules.core_attention = TreeDotProductAttention
    return spec


def config_refusals(config: Any) -> list[tuple[str, str, str]]:
    """(path, class, reason) of every config setting a tree row cannot run exactly."""
    c, name, out = config, type(config).__name__, []

    def no(field: str, why: str) -> None:
        out.append((f"config.{field}", name, why))

    if getattr(c, "sequence_parallel", False):
        no("sequence_parallel", "sequence parallel splits rows over TP ranks by position; not checked on tree rows")
    if getattr(c, "context_parallel_size", 1) != 1:
        no("context_parallel_size", "context parallelism is not wired to tree rows in the Megatron backend")
    if getattr(c, "pipeline_model_parallel_size", 1) != 1:
        no("pipeline_model_parallel_size", "packed_forward runs one stage holding the whole model")
    for f in ("hidden_dropout", "attention_dropout"):
        if getattr(c, f, 0.0):
            no(f, f"dropout {getattr(c, f)} draws random numbers: packed and unpacked runs differ")
    if getattr(c, "fp8", None) or getattr(c, "fp4", None):
        no("fp8", "FP8/FP4 recipes run Transformer Engine layers")
    if getattr(c, "multi_latent_attention", False):
        no("multi_latent_attention", "multi-latent attention is not checked on tree rows")
    if getattr(c, "window_size", None) is not None:
        no("window_size", "sliding-window attention is not wired to the tree core attention")
    if getattr(c, "softmax_type", "vanilla") != "vanilla":
        no("softmax_type", f"softmax_type {c.softmax_type!r} (attention sinks) is not wired")
    if getattr(c, "apply_query_key_layer_scaling", False):
        no("apply_query_key_layer_scaling", "the tree core attention applies the plain softmax scale")
    if getattr(c, "mtp_num_layers", None):
        no("mtp_num_layers", "multi-token prediction layers are not checked on tree rows")
    if getattr(c, "rotary_interleaved", False):
        no("rotary_interleaved", "interleaved RoPE is not checked against HF")
    if getattr(c, "num_moe_experts", None):
        if getattr(c, "moe_expert_capacity_factor", None) is not None:
            no("moe_expert_capacity_factor", "token dropping: which tokens an expert drops depends on the batch")
        if getattr(c, "moe_input_jitter_eps", None):
            no("moe_input_jitter_eps", "router input jitter draws random numbers")
        coeff = getattr(c, "moe_aux_loss_coeff", 0.0)
        if any(coeff) if isinstance(coeff, (list, tuple)) else coeff:
            no("moe_aux_loss_coeff", "a load-balancing loss counts the batch's tokens (a shared prefix once)")
        if getattr(c, "moe_z_loss_coeff", None):
            no("moe_z_loss_coeff", "the router z-loss averages over the batch's tokens")
        if getattr(c, "moe_router_enable_expert_bias", False):
            no("moe_router_enable_expert_bias", "the expert-bias update counts the batch's tokens per expert")
    return out


def _module_refusals(model: nn.Module, moe: bool) -> list[tuple[str, str, str]]:
    """(path, class, reason) of every module this backend has no exact tree path for."""
    from megatron.core.transformer.enums import AttnMaskType

    from treepack.trainer.megatron.attention import TreeDotProductAttention

    allowed = _ALLOWED | (_MOE_ALLOWED if moe else set())
    out = []
    for path, m in model.named_modules():
        cls, mod = type(m).__name__, type(m).__module__
        if mod.startswith("megatron.core.extensions.transformer_engine") or mod.startswith("transformer_engine"):
            out.append((path, cls, "a Transformer Engine module: its attention takes cu_seqlens (thd), no tree mask"))
        elif "mamba" in mod.lower() or "ssm" in mod.split("."):
            out.append((path, cls, "Mamba / hybrid layers are not wired to the tree scan in the Megatron backend"))
        elif cls == "RotaryEmbedding":
            out.append((path, cls, "stock RoPE embeds range(seq_len), not the plan's position_ids"))
        elif (mod, cls) not in allowed:
            out.append((path, cls, f"{mod}.{cls} is not a module this backend checked on tree rows"))
        elif cls == "SelfAttention":
            if m.attn_mask_type != AttnMaskType.arbitrary:
                out.append((path, cls, f"attn_mask_type {m.attn_mask_type.name}: tree rows need arbitrary"))
            if not isinstance(m.core_attention, TreeDotProductAttention):
                out.append((path, cls, "its core attention is not TreeDotProductAttention"))
        elif cls == "Dropout" and m.p:
            out.append((path, cls, f"dropout {m.p} draws random numbers"))
    gpt = [m for m in model.modules() if type(m).__name__ == "GPTModel"]
    if gpt and getattr(gpt[0], "position_embedding_type", None) != "rope":
        kind = gpt[0].position_embedding_type
        out.append(("", "GPTModel", f"position_embedding_type {kind!r}: the backend runs rope"))
    elif gpt and getattr(gpt[0], "rotary_pos_emb", None) is None:
        out.append(("rotary_pos_emb", "GPTModel", "no tree rotary embedding (from_hf swaps it in)"))
    return out


def megatron_refusals(model: nn.Module) -> list[tuple[str, str, str]]:
    """Every (path, class, reason) that keeps ``model`` (a GPTModel, or a wrapper of one) off tree rows."""
    inner = model
    while hasattr(inner, "module") and isinstance(inner.module, nn.Module) and type(inner).__name__ != "GPTModel":
        inner = inner.module
    config = getattr(inner, "config", None)
    out = config_refusals(config) if config is not None else [("config", type(inner).__name__, "no config")]
    return out + _module_refusals(inner, bool(getattr(config, "num_moe_experts", None)))


def check_megatron_model(model: nn.Module) -> None:
    """Refuse a model :func:`~treepack.trainer.megatron.packed_forward` cannot run exactly.

    Raises:
        UnsupportedModelError: naming each refused setting or module (path, class, reason),
            with ``refusals`` holding them as triples.
    """
    refuse(megatron_refusals(model))


def refuse(refusals: list[tuple[str, str, str]]) -> None:
    """Raise one ``UnsupportedModelError`` naming every (path, class, reason), if there is any."""
    if refusals:
        lines = "; ".join(f"{p or '<model>'} ({c}): {r}" for p, c, r in refusals)
        raise UnsupportedModelError(
            f"the Megatron model cannot run tree rows exactly: {lines}", rule="megatron", refusals=tuple(refusals)
        )
