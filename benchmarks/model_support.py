"""Model support of treepack's trainer: tiny HF decoders, their expected outcome, the docs' table.

``python benchmarks/model_support.py --write-docs`` rewrites the model-support section of
``docs/models.md`` from :data:`FAMILIES` (the tests check every row's outcome and that the guide
matches, tests/trainer/test_family_sweep.py); ``--train`` first runs the training setups
(gradient checkpointing, reentrant and not, on ``sdpa`` and ``flash``; perturbed parameters)
on every exact row and records them in ``model_support_training.json`` (the guide's
checkpointing column; the tests rerun a representative subset); ``--auto`` runs the
automatic sweep over every causal-LM architecture of the installed transformers (forward
oracle, SDPA) and prints it. The section ends with the static scan of transformers'
modeling code (``benchmarks/modeling_scan.py``).

Each family row is a tiny random fp32 config (hidden 32, 2-3 layers, 4 heads) of one HF
model type; its expectation is ``pass`` (the oracle: packed logprobs == each sequence
alone) or a refusal whose reason matches a pattern. Rows whose support lands with other
work (recurrent-mixer patches, attention sinks, chunked attention) are marked with the
capability that turns the refusal into a pass (:func:`expected`).
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

VOCAB = 97
MAX_PARAMS = 3_000_000

# Sizes every tiny config gets where the key exists (HF spells the same size many ways).
SIZES: dict[str, int] = {
    "hidden_size": 32,
    "n_embd": 32,
    "d_model": 32,
    "dim": 32,
    "n_embed": 32,
    "embed_dim": 32,
    "intermediate_size": 64,
    "n_inner": 64,
    "ffn_dim": 64,
    "ffn_hidden_size": 64,
    "mlp_hidden_size": 64,
    "num_attention_heads": 4,
    "n_head": 4,
    "num_heads": 4,
    "n_heads": 4,
    "decoder_attention_heads": 4,
    "num_key_value_heads": 2,
    "num_kv_heads": 2,
    "n_kv_heads": 2,
    "multi_query_group_num": 2,
    "head_dim": 8,
    "kv_channels": 8,
    "attention_head_dim": 8,
    "max_position_embeddings": 256,
    "n_positions": 256,
    "n_ctx": 256,
    "max_seq_len": 256,
    "num_experts": 4,
    "num_local_experts": 4,
    "n_routed_experts": 4,
    "moe_num_experts": 4,
    "num_experts_per_tok": 2,
    "moe_topk": 2,
    "top_k": 2,
    "moe_k": 2,
    "num_experts_per_token": 2,
    "moe_intermediate_size": 16,
    "shared_expert_intermediate_size": 16,
    "expert_intermediate_size": 16,
    "n_shared_experts": 1,
    "num_shared_experts": 1,
    "n_group": 1,
    "topk_group": 1,
    "first_k_dense_replace": 1,
    "kv_lora_rank": 16,
    "q_lora_rank": 16,
    "qk_rope_head_dim": 8,
    "qk_nope_head_dim": 8,
    "v_head_dim": 8,
    "qk_head_dim": 16,
    "index_n_heads": 2,
    "index_head_dim": 16,
    "index_topk": 8,
    "sliding_window": 6,
    "attention_chunk_size": 6,
    "linear_num_value_heads": 4,
    "linear_num_key_heads": 2,
    "linear_key_head_dim": 8,
    "linear_value_head_dim": 8,
    "mamba_d_state": 8,
    "ssm_state_size": 8,
    "state_size": 8,
    "mamba_n_heads": 4,
    "mamba_d_head": 16,
    "mamba_head_dim": 16,
    "mamba_d_ssm": 64,
    "linear_head_dim": 8,
    "linear_num_heads": 4,
    "mamba_n_groups": 1,
    "n_groups": 1,
    "mamba_d_conv": 4,
    "conv_kernel": 4,
    "mamba_expand": 2,
    "time_step_rank": 4,
    "num_nextn_predict_layers": 0,
    "vocab_size": VOCAB,
    "decoder_sparse_step": 1,
    "num_codebooks": 1,
}
TOKEN_IDS = (
    "pad_token_id",
    "bos_token_id",
    "eos_token_id",
    "sep_token_id",
    "decoder_start_token_id",
    "image_token_id",
    "image_token_index",
)


def _layer_types(types: list[str]) -> list[str]:
    """One layer of each distinct type, in first-appearance order (at least 2 layers)."""
    seen: list[str] = []
    for t in types:
        if t not in seen:
            seen.append(t)
    return seen if len(seen) >= 2 else (seen * 2)[:2]


def shrink_config(config: Any, keep_dropout: bool = False) -> Any:
    """Shrink ``config`` (and its ``text_config``) in place to a tiny fp32 model; returns it.

    Dropout fields are set to 0 unless ``keep_dropout`` (then they keep the config's defaults).
    """
    for cfg in (config, getattr(config, "text_config", None)):
        if cfg is None or cfg is not config and not hasattr(cfg, "to_dict"):
            continue
        keys = set(cfg.to_dict())
        for k, v in SIZES.items():
            if k in keys and isinstance(getattr(cfg, k, None), int) and not isinstance(getattr(cfg, k), bool):
                setattr(cfg, k, v)
        for k in TOKEN_IDS:
            if k in keys and isinstance(getattr(cfg, k, None), int) and getattr(cfg, k) >= VOCAB:
                setattr(cfg, k, 1)
        types = getattr(cfg, "layer_types", None)
        n = 2
        if isinstance(types, (list, tuple)) and types:
            try:
                cfg.layer_types = _layer_types(list(types))
                n = len(cfg.layer_types)
            except AttributeError:  # derived from other fields (a read-only property)
                pass
        for k in ("num_hidden_layers", "n_layer", "num_layers", "n_layers", "decoder_layers"):
            if k in keys and isinstance(getattr(cfg, k, None), int):
                setattr(cfg, k, n)
        _agree(cfg, keys)
        for k in (
            ()
            if keep_dropout
            else (
                "attention_dropout",
                "attn_pdrop",
                "resid_pdrop",
                "embd_pdrop",
                "hidden_dropout",
                "dropout",
                "attention_probs_dropout_prob",
                "hidden_dropout_prob",
            )
        ):
            if k in keys and isinstance(getattr(cfg, k, None), float):
                setattr(cfg, k, 0.0)
    return config


def _agree(cfg: Any, keys: set[str]) -> None:
    """Sizes that must agree with the ones :data:`SIZES` set (HF checks or derives them)."""
    if "kv_lora_rank" in keys and "num_key_value_heads" in keys:
        # MLA (DeepSeek-V2/V3, MiniCPM3, Kimi, GLM-4-MoE-Lite ...): one latent K/V per query head.
        cfg.num_key_value_heads = cfg.num_attention_heads
    if isinstance(getattr(cfg, "rotary_dim", None), int):  # GPT-J, CodeGen: a rotary part of the 8-dim head
        cfg.rotary_dim = 4
    if "num_experts_per_tok" in keys and cfg.num_experts_per_tok is None and getattr(cfg, "n_routed_experts", None):
        cfg.num_experts_per_tok = 2  # DeepSeek-V2 leaves it unset (dense) while it builds routed experts
    model_type = getattr(cfg, "model_type", "")
    if model_type == "mamba2":  # heads x head_dim == expand x hidden
        cfg.head_dim = cfg.expand * cfg.hidden_size // cfg.num_heads
    if model_type == "xlstm":  # its width and depth under other names
        cfg.embedding_dim = cfg.hidden_size
        cfg.num_blocks = 2
    if model_type == "zamba2":  # derived from hidden_size in the config's __init__
        cfg.attention_hidden_size = 2 * cfg.hidden_size
        cfg.attention_head_dim = 2 * cfg.hidden_size // cfg.num_attention_heads
        cfg.mamba_headdim = cfg.mamba_expand * cfg.hidden_size // cfg.n_mamba_heads
        cfg.kv_channels = cfg.hidden_size // cfg.num_attention_heads
        cfg.num_query_groups = cfg.num_attention_heads
        cfg.hybrid_layer_ids = [i for i, t in enumerate(cfg.layers_block_type) if t == "hybrid"]


def build_causal_lm(model_type: str, seed: int = 0, keep_dropout: bool = False, **overrides: Any) -> torch.nn.Module:
    """An fp32, eval-mode, random tiny ``*ForCausalLM`` of ``model_type`` (raises when it cannot be built).

    Dropout is 0 unless ``keep_dropout`` (the config's defaults, for the train-mode check).
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    config = shrink_config(AutoConfig.for_model(model_type), keep_dropout=keep_dropout)
    for k, v in overrides.items():
        setattr(config, k, v)
    with torch.device("meta"):
        n = sum(p.numel() for p in AutoModelForCausalLM.from_config(config).parameters())
    if n > MAX_PARAMS:
        raise ValueError(f"{n} parameters after shrinking (over {MAX_PARAMS}): a size this helper does not shrink")
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    if hasattr(model, "set_default_language") and getattr(config, "languages", None):
        model.set_default_language(config.languages[0])  # X-MOD: one language adapter for every call
    return model.float().eval()


HYBRID = r"scan over the whole row|Conv1d|token mixer|no tree-exact mixer"
MLA = dict(
    num_attention_heads=4,
    num_key_value_heads=4,
    kv_lora_rank=16,
    q_lora_rank=24,
    qk_rope_head_dim=8,
    qk_nope_head_dim=8,
    v_head_dim=8,
    head_dim=8,
    n_group=2,
    topk_group=1,
)


@dataclass(frozen=True)
class Family:
    """One row of the sweep.

    Attributes:
        name: the row's name (docs/models.md).
        model_type: the HF model type (``AutoConfig.for_model``).
        mechanism: what the row covers (docs/models.md).
        overrides: config fields set after shrinking.
        refused: None when the row must pass the oracle, else a regex the refusal matches.
        lands_with: work that makes a refused row exact (then it must pass the oracle).
        flex: False where the model reads its mask as a tensor (``flex`` is refused).
        at_run_time: check_model accepts the model; tree attention refuses it on its first
            call (a mask or bias the model builds itself).
    """

    name: str
    model_type: str
    mechanism: str
    overrides: dict = field(default_factory=dict)
    refused: str | None = None
    lands_with: str | None = None
    flex: bool = True
    at_run_time: bool = False


F = Family
FAMILIES: tuple[Family, ...] = (
    F("Llama", "llama", "dense, GQA"),
    F("Qwen2", "qwen2", "dense, qkv bias"),
    F("Qwen3", "qwen3", "dense, q/k norm"),
    F("Mistral", "mistral", "sliding window", dict(sliding_window=6)),
    F("Mixtral", "mixtral", "MoE, sliding window", dict(sliding_window=6)),
    F("Qwen2-MoE", "qwen2_moe", "MoE, shared expert"),
    F("Qwen3-MoE", "qwen3_moe", "MoE"),
    F("Gemma", "gemma", "dense, GeGLU"),
    F(
        "Gemma 2",
        "gemma2",
        "sliding/global, attention and final soft-caps",
        dict(attn_logit_softcapping=5.0, final_logit_softcapping=3.0),
    ),
    F("Gemma 3", "gemma3_text", "sliding/global, two RoPE bases"),
    F("Cohere", "cohere", "logit_scale", dict(logit_scale=0.5)),
    F("Cohere 2", "cohere2", "sliding/global, logit_scale"),
    F("Granite", "granite", "logits_scaling, multipliers", dict(logits_scaling=2.0)),
    F("GraniteMoE", "granitemoe", "MoE, logits_scaling"),
    F("Phi-3", "phi3", "fused qkv"),
    F("OLMo 2", "olmo2", "q/k norm"),
    F("OLMoE", "olmoe", "MoE"),
    F("StableLM", "stablelm", "partial RoPE"),
    F("Starcoder2", "starcoder2", "sliding window, bias", dict(sliding_window=6)),
    F("GPT-NeoX", "gpt_neox", "parallel residual, partial RoPE"),
    F("GPT-2", "gpt2", "learned absolute positions, Conv1D projections", flex=False),
    F("GPTBigCode", "gpt_bigcode", "multi-query, learned positions"),
    F("GLM-4", "glm4", "dense"),
    F("GLM-4-MoE", "glm4_moe", "MoE"),
    F("DeepSeek-V3", "deepseek_v3", "MLA, MoE", MLA),
    F(
        "DeepSeek-V3.2",
        "deepseek_v32",
        "MLA, DSA sparse indexer",
        dict(MLA, index_topk=8, index_head_dim=16, index_n_heads=4),
    ),
    F("Qwen3-Next", "qwen3_next", "Gated DeltaNet hybrid, MoE"),
    F("Qwen3.5", "qwen3_5_text", "Gated DeltaNet hybrid"),
    F("SmolLM3", "smollm3", "NoPE layers"),
    F("EXAONE 4", "exaone4", "sliding/global"),
    F("GPT-OSS", "gpt_oss", "attention sinks, MoE", refused=r"attention sinks", lands_with="sinks"),
    F("Llama 4", "llama4_text", "chunked attention, MoE", refused=r"chunked attention", lands_with="chunked"),
    F("GLM-MoE-DSA", "glm_moe_dsa", "shared DSA indexer", MLA, refused=r"Indexer", lands_with="GLM-MoE-DSA patch"),
    F("Jamba", "jamba", "Mamba1 hybrid", refused=HYBRID, lands_with="mixers"),
    F("Bamba", "bamba", "Mamba2 hybrid", refused=HYBRID, lands_with="mixers"),
    F("Falcon-H1", "falcon_h1", "Mamba2 parallel hybrid", refused=HYBRID, lands_with="mixers"),
    F("Nemotron-H", "nemotron_h", "Mamba2 hybrid", refused=HYBRID, lands_with="mixers"),
    F("GraniteMoeHybrid", "granitemoehybrid", "Mamba2 hybrid, MoE", refused=HYBRID, lands_with="mixers"),
    F(
        "LFM2",
        "lfm2",
        "short causal conv hybrid",
        dict(layer_types=["conv", "full_attention"]),
        refused=HYBRID,
        lands_with="mixers",
    ),
    F("Kimi-Linear", "kimi_linear", "KDA hybrid, MLA", MLA, refused=HYBRID, lands_with="mixers"),
    F("OLMo-hybrid", "olmo_hybrid", "GDN hybrid", refused=HYBRID, lands_with="mixers"),
    F("Mamba", "mamba", "pure SSM", refused=r"position_ids|scan over the whole row|token mixer \(Mamba\)"),
    F(
        "Llama, dynamic NTK",
        "llama",
        "length-dependent RoPE",
        dict(rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}),
        refused=r"length-dependent RoPE 'dynamic'",
    ),
    F(
        "HunYuan, fixed-alpha NTK",
        "hunyuan_v1_dense",
        "RoPE labelled 'dynamic' with a fixed alpha (a static base)",
        dict(head_dim=8, rope_parameters={"rope_type": "dynamic", "alpha": 1000.0, "rope_theta": 10000.0}),
    ),
    F(
        "Phi-3, LongRoPE",
        "phi3",
        "length-dependent RoPE",
        dict(
            max_position_embeddings=256,
            original_max_position_embeddings=16,
            rope_parameters={
                "rope_type": "longrope",
                "rope_theta": 10000.0,
                "short_factor": [1.0] * 4,
                "long_factor": [2.0] * 4,
                "original_max_position_embeddings": 16,
            },
        ),
        refused=r"length-dependent RoPE 'longrope'",
    ),
    F(
        "Mixtral, router logits",
        "mixtral",
        "MoE auxiliary loss",
        dict(output_router_logits=True),
        refused=r"auxiliary \(load-balancing\) loss",
    ),
    F("Bloom", "bloom", "ALiBi, own attention", refused=r"AttentionInterface|takes no position_ids"),
    F("BART decoder", "bart", "positions from the row", refused=r"takes no position_ids"),
    F("Doge", "doge", "learned dynamic attention mask", refused=r"mask or bias built by the model", at_run_time=True),
)


def build_family(row: Family, seed: int = 0, keep_dropout: bool = False) -> torch.nn.Module:
    """The row's tiny model (eval mode, eager attention; dropout 0 unless ``keep_dropout``)."""
    model = build_causal_lm(row.model_type, seed=seed, keep_dropout=keep_dropout, **row.overrides)
    model.set_attn_implementation("eager")
    return _with_patches(model)


def _with_patches(model: torch.nn.Module) -> torch.nn.Module:
    """Install the layer patches up front, as any packed call does: inside
    :func:`~treepack.trainer.hf.layers.reference_rules` (:func:`unpacked_logprobs`) a patched DSA
    indexer breaks top-k ties by the key's position on unpacked calls too (SPEC section 7), so
    the unpacked reference uses the same rule as the packed run. Without it, HF's arbitrary tie
    order (ReLU scores are often exactly 0) makes the reference differ from itself under any
    packing."""
    from treepack.trainer.hf.layers import patch_layers

    patch_layers(model)
    return model


def status_of(row: Family) -> tuple[str, str, str]:
    """(``exact`` | ``refused``, reason, train-mode dropout) of the row's model now.

    The status is :func:`treepack.trainer.hf.check_model`'s (for an ``at_run_time`` row
    that it accepts, a packed forward's); the model is built with the config's default
    dropout, which eval mode ignores. The third entry is what training mode with that
    dropout gives: ``refused: <what>`` (the first refusal check_model adds in training mode,
    naming the module or config field) or ``none`` (no dropout by default).
    """
    from treepack.proto.errors import UnsupportedModelError
    from treepack.trainer.hf import check_model

    model = build_family(row, keep_dropout=True)
    refusals = check_model(model, raise_error=False).refusals
    status, reason = ("refused", refusals[0].reason) if refusals else ("exact", "")
    if status == "exact" and row.at_run_time:
        try:
            with torch.no_grad():
                forward_oracle(model)
        except UnsupportedModelError as e:
            status, reason = "refused", "at run time: " + (e.refusals[0][2] if e.refusals else str(e))
    seen = {(r.path, r.cls, r.reason) for r in refusals}
    found = [r for r in check_model(model.train(), raise_error=False).refusals if (r.path, r.cls, r.reason) not in seen]
    model.eval()
    if not found:
        return status, reason, "none"
    what = found[0].reason.split(" while training")[0]
    if "p=" in what or not what.startswith(("config", "model.config")) and "=" not in what:
        what = f"{found[0].path} ({found[0].cls}) {what}"
    more = f" (+{len(found) - 1} more)" if len(found) > 1 else ""
    return status, reason, f"refused: {what}{more}"


def small_case() -> dict[str, Any]:
    """A tree of a shared prompt with 3 completions (one duplicated, one prompt prefix) and 2 unrelated sequences."""
    rng = np.random.default_rng(5)
    prompt = rng.integers(0, VOCAB, 10)
    seqs = [np.concatenate([prompt, rng.integers(0, VOCAB, n)]) for n in (5, 7, 4)]
    seqs += [seqs[1].copy(), prompt[:6].copy(), rng.integers(0, VOCAB, 9), rng.integers(0, VOCAB, 13)]
    trainable = [10, 10, 10, 10, 0, 2, 2]
    return dict(sequences=seqs, trainable=trainable, groups=[0, 0, 0, 0, 0, 1, 2], seq_len=32, min_shared_len=4)


def unpacked_logprobs(model: torch.nn.Module, sequences: list[np.ndarray]) -> list[torch.Tensor]:
    """[n_i - 1] logprob of token t given tokens < t, each sequence alone through the stock model
    (patched layers under :func:`~treepack.trainer.hf.layers.reference_rules`: DSA ties by position)."""
    from treepack.trainer.hf.layers import reference_rules

    out = []
    with reference_rules():
        for s in sequences:
            x = torch.as_tensor(np.asarray(s), dtype=torch.int64)[None]
            logits = model(input_ids=x, use_cache=False).logits[0].float()
            out.append(torch.log_softmax(logits[:-1], -1).gather(1, x[0, 1:, None]).squeeze(1))
    return out


def forward_oracle(model: torch.nn.Module, backend: str = "sdpa") -> float:
    """Max |packed - unpacked| logprob over the trainable targets of :func:`small_case` (no gradients),
    packed through the logits and through ``output="hidden"`` with the model's own head
    (:func:`treepack.trainer.hf.output_head`, the chunked head)."""
    from treepack.service.planner import plan_batch
    from treepack.trainer import materialize, naive_varlen_attention
    from treepack.trainer.hf import output_head, packed_forward

    c = small_case()
    plan = plan_batch(
        c["sequences"],
        seq_len=c["seq_len"],
        min_shared_len=c["min_shared_len"],
        trainable=c["trainable"],
        groups=c["groups"],
    )
    batch = materialize(plan, c["sequences"], trainable=c["trainable"], groups=c["groups"])
    kw = dict(backend=backend, varlen_fn=naive_varlen_attention, compile=False)
    with torch.no_grad():
        ref = unpacked_logprobs(model, c["sequences"])
        logits = batch.target_logprobs(packed_forward(model, batch, **kw))
        hidden = batch.target_logprobs_from_hidden(
            packed_forward(model, batch, output="hidden", **kw), output_head(model)
        )
    err = 0.0
    for lp in (logits, hidden):
        for r, g, t in zip(ref, batch.unpack_logprobs(lp), c["trainable"]):
            g = g[1:]
            keep = torch.arange(1, g.shape[0] + 1) >= max(t, 1)
            err = max(err, float((g[keep] - r[keep]).abs().max()) if bool(keep.any()) else 0.0)
    return err


LOGPROB_TOL = 1e-5
GRAD_RTOL = 1e-4
#: The training setups of the sweep: (backend, use_reentrant). Both backends with a CPU
#: backward (``flex`` has none); gradient checkpointing replays each decoder layer in backward.
TRAIN_SETUPS: tuple[tuple[str, bool], ...] = tuple((b, r) for b in ("sdpa", "flash") for r in (True, False))
TRAINING = Path(__file__).resolve().with_name("model_support_training.json")


def perturb(model: torch.nn.Module, seed: int = 1, scale: float = 0.05) -> torch.nn.Module:
    """Add seeded N(0, scale^2) noise to every parameter (biases, norms, learned masks too), in place.

    Init values are special (zero biases, unit norms, Doge's zero ``A``): a dropped term
    whose parameter is 0 at init changes nothing there. Returns ``model``.
    """
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen, dtype=torch.float32).to(p.dtype) * scale)
    return model


def _weights(seqs: list[np.ndarray]) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(11)
    return [torch.randn(len(s), generator=gen) for s in seqs]


def _scored(c: dict[str, Any]) -> list[torch.Tensor]:
    out = []
    for s, t in zip(c["sequences"], c["trainable"]):
        f = torch.zeros(len(s), dtype=torch.bool)
        f[max(int(t), 1) :] = True
        out.append(f)
    return out


def _take_grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    out = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return out


def grad_error(ref: dict[str, torch.Tensor], got: dict[str, torch.Tensor]) -> float:
    """The worst parameter's ``max |got - ref| / (max |ref| + floor / GRAD_RTOL)`` (pass: <= GRAD_RTOL).

    The floor is fp32 rounding of the largest gradient (1e-7 of it): a parameter whose
    gradient is 1e-5 of the others cannot be held to 1e-4 of itself. A parameter with a
    gradient on one side only, or an all-zero reference, is an infinite error.
    """
    if ref.keys() != got.keys() or not ref:
        return float("inf")
    floor = 1e-7 * max(float(g.abs().max()) for g in ref.values())
    worst = 0.0
    for k, r in ref.items():
        scale = float(r.abs().max())
        if scale == 0:
            return float("inf")
        worst = max(worst, float((got[k].double() - r.double()).abs().max()) / (scale + floor / GRAD_RTOL))
    return worst


def _lp_error(ref: list[torch.Tensor], got: list[torch.Tensor]) -> float:
    err = 0.0
    for r, g in zip(ref, got):
        keep = ~torch.isnan(r)
        if not torch.equal(keep, ~torch.isnan(g)):
            return float("inf")
        err = max(err, float((g[keep] - r[keep]).abs().max()) if bool(keep.any()) else 0.0)
    return err


def train_oracle(model: torch.nn.Module, setups=TRAIN_SETUPS) -> dict[str, tuple[float, float]]:
    """(max logprob error, :func:`grad_error`) of each training setup, packed vs each sequence alone.

    ``model`` runs in training mode (its dropout must be 0); the reference runs every
    sequence of :func:`small_case` alone without checkpointing; each setup runs the packed
    batch with gradient checkpointing on (``use_reentrant`` as given) on its backend
    (``flash``: the pure-torch varlen reference). The loss weights every scored logprob by
    a fixed random number (no gradient cancels by symmetry). The probe is off: this is its
    own oracle. Keys: ``"sdpa, reentrant"`` etc.
    """
    from treepack.service.planner import plan_batch, validate_plan
    from treepack.trainer import materialize, naive_varlen_attention
    from treepack.trainer.hf import packed_forward

    c = small_case()
    plan = plan_batch(
        c["sequences"],
        seq_len=c["seq_len"],
        min_shared_len=c["min_shared_len"],
        trainable=c["trainable"],
        groups=c["groups"],
    )
    validate_plan(plan, c["sequences"], trainable=c["trainable"])
    batch = materialize(plan, c["sequences"], trainable=c["trainable"], groups=c["groups"])
    weights, flags = _weights(c["sequences"]), _scored(c)
    model.train()
    model.zero_grad(set_to_none=True)
    alone = [torch.cat([lp.new_full((1,), float("nan")), lp]) for lp in unpacked_logprobs(model, c["sequences"])]
    alone = [torch.where(f, x, torch.full_like(x, float("nan"))) for x, f in zip(alone, flags)]
    sum((torch.nan_to_num(x) * w).sum() for x, w in zip(alone, weights)).backward()
    ref_lp, ref_grads = [x.detach() for x in alone], _take_grads(model)
    out = {}
    for backend, reentrant in setups:
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": reentrant})
        model.train()
        try:
            logits = packed_forward(model, batch, backend=backend, varlen_fn=naive_varlen_attention, verify=False)
            packed = batch.unpack_logprobs(batch.target_logprobs(logits))
            sum((torch.nan_to_num(x) * w).sum() for x, w in zip(packed, weights)).backward()
            out[f"{backend}, {'reentrant' if reentrant else 'non-reentrant'}"] = (
                _lp_error(ref_lp, [x.detach() for x in packed]),
                grad_error(ref_grads, _take_grads(model)),
            )
        finally:
            model.activation_checkpointing_disable()
            model.zero_grad(set_to_none=True)
    return out


def within(errs: tuple[float, float]) -> bool:
    """A training setup's (logprob, gradient) errors are within the sweep's tolerances."""
    return errs[0] <= LOGPROB_TOL and errs[1] <= GRAD_RTOL


def causal_lm_types() -> list[str]:
    """Every model type of the installed transformers with a causal-LM class."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


#: What each status of the automatic sweep (``--auto``) means.
SWEEP_STATUSES = {
    "pass": (
        "treepack ran it packed and its logprobs equal each sequence run alone (forward, sdpa; "
        "through the logits and through output='hidden' with the model's own head)"
    ),
    "refused": "check_model refuses it before any compute, naming the module and why",
    "stock_fails": (
        "the stock model fails unpacked on the tiny config the sweep builds, so there is nothing to compare with"
    ),
    "unbuildable": "no tiny model can be built from its shrunken default config",
    "WRONG": "accepted but packed differs from unpacked: a bug (never expected)",
}


def sweep_overrides(model_type: str) -> dict[str, Any]:
    """The config overrides of the first exact :data:`FAMILIES` row of ``model_type`` ({} if none).

    A shrunken default config is not always a valid model (DeepSeek-V3's MLA and router
    groups need consistent sizes); the table's rows say which sizes make one.
    """
    return next((dict(f.overrides) for f in FAMILIES if f.model_type == model_type and f.refused is None), {})


def _first_line(e: BaseException) -> str:
    return f"{type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''}"


def sweep_one(model_type: str, tol: float = 1e-5) -> tuple[str, str]:
    """(status, detail) of one architecture: one of :data:`SWEEP_STATUSES`.

    The tiny model is the shrunken default config with :func:`sweep_overrides`, so every
    model type of the model-support table is swept as the table's row builds it. Only building
    the stock model and running it alone, before any treepack patch, are guarded
    (``unbuildable``, ``stock_fails``): whatever treepack's own code raises (layer patches,
    the check, the packed forward) propagates, except a refusal
    (:class:`UnsupportedModelError`, status ``refused``).
    """
    from treepack.proto.errors import UnsupportedModelError
    from treepack.proto.options import PlanOptions
    from treepack.trainer.hf import check_model

    try:
        model = build_causal_lm(model_type, **sweep_overrides(model_type))
        model.set_attn_implementation("eager")
    except Exception as e:  # noqa: BLE001 - building the stock model only: listed, not hidden
        return "unbuildable", _first_line(e)
    try:
        with torch.no_grad():
            unpacked_logprobs(model, small_case()["sequences"][:1])
    except Exception as e:  # noqa: BLE001 - the stock model alone, before any patch
        return "stock_fails", _first_line(e)
    try:
        _with_patches(model)
    except UnsupportedModelError as e:
        return "refused", e.refusals[0][2] if getattr(e, "refusals", None) else str(e)
    # What packed_forward checks for forward_oracle's plan: its row length and conv width.
    report = check_model(
        model,
        raise_error=False,
        row_len=small_case()["seq_len"],
        conv_width=PlanOptions(seq_len=small_case()["seq_len"]).conv_width,
    )
    if report.refusals:
        return "refused", report.refusals[0].reason
    try:
        err = forward_oracle(model)
    except UnsupportedModelError as e:  # refused by a run-time guard (e.g. a mask the model built itself)
        return "refused", "at run time: " + (e.refusals[0][2] if getattr(e, "refusals", None) else str(e))
    return ("pass" if err <= tol else "WRONG"), f"max logprob error {err:.2g}"


def write_training(rows: tuple[Family, ...] = FAMILIES) -> dict[str, Any]:
    """Run :func:`train_oracle` on every row check_model accepts (perturbed parameters) and
    write the errors to :data:`TRAINING` (the guide's checkpointing columns come from it)."""
    import json
    import time

    import transformers

    out: dict[str, Any] = {
        "transformers": transformers.__version__,
        "torch": torch.__version__.split("+")[0],
        "rows": {},
    }
    for row in rows:
        if status_of(row)[0] != "exact":
            continue
        t = time.perf_counter()
        errs = train_oracle(perturb(build_family(row)))
        out["rows"][row.name] = {k: [float(f"{lp:.3g}"), float(f"{g:.3g}")] for k, (lp, g) in errs.items()}
        print(row.name, out["rows"][row.name], f"{time.perf_counter() - t:.1f} s", flush=True)
    TRAINING.write_text(json.dumps(out, indent=1) + "\n")
    return out


def recorded_training() -> dict[str, Any]:
    """The training errors recorded by ``--train`` (:data:`TRAINING`), or empty rows if none."""
    import json

    return json.loads(TRAINING.read_text()) if TRAINING.exists() else {"rows": {}}


BEGIN, END = "<!-- model-support:begin -->", "<!-- model-support:end -->"
#: The guide that holds the model-support table, between :data:`BEGIN` and :data:`END`.
MODELS_DOC = Path(__file__).resolve().parents[1] / "docs" / "models.md"


def _checkpoint_cell(recorded: dict[str, Any] | None) -> str:
    if recorded is None:
        return "not recorded"
    bad = [k for k, errs in recorded.items() if not within(tuple(errs))]
    if bad:
        return "WRONG: " + ", ".join(bad)
    setups = {k.split(", ")[0] for k in recorded}
    return "exact: " + ", ".join(sorted(setups)) + " (reentrant and not)"


def _scan_cell(hits: list[Any]) -> str:
    """The row's scan hits: pattern and how it is handled (``handled``, ``checked at run time``, ...)."""
    how = lambda h: "UNHANDLED" if h.handled is None else h.handled.split(":")[0] if ":" in h.handled else "handled"  # noqa: E731
    return "; ".join(dict.fromkeys(f"{SCAN_LABELS[h.pattern]} ({how(h)})" for h in hits)) or "-"


SCAN_LABELS = {
    "kwargs_dropped": "drops kwargs",
    "window_by_mask_builder": "mask-builder window",
    "model_built_mask": "own mask or bias",
}


def render_table(statuses: dict[str, tuple[str, str, str]], training: dict[str, Any] | None = None) -> str:
    """The generated section of docs/models.md: one line per family (:func:`status_of`; checkpointing columns from
    :data:`TRAINING`), then the static scan's summary, with the transformers version."""
    import transformers

    scan = modeling_scan()
    hits = scan.scan_transformers()
    training = recorded_training() if training is None else training
    lines = [
        BEGIN,
        "Generated by `python benchmarks/model_support.py --write-docs` "
        f"with transformers {transformers.__version__}, "
        "torch "
        + torch.__version__.split("+")[0]
        + "; checked by `tests/trainer/test_family_sweep.py` and `tests/trainer/test_modeling_scan.py` "
        "(tiny random fp32 configs, every parameter perturbed by seeded N(0, 0.05²) noise so no bias or mask sits at "
        "its init value: packed logprobs within 1e-5 and gradients within 1e-4 relative of each sequence alone on "
        "`sdpa` and the `flash` reference, `flex` forward; refused rows raise `UnsupportedModelError` before any "
        "compute, or at the first attention call where marked). **checkpointing**: training mode with gradient "
        "checkpointing, `use_reentrant` True and False, on both backends with a CPU backward (`python "
        "benchmarks/model_support.py --train`, recorded in `benchmarks/model_support_training.json`). **dropout**: "
        "training mode with the config's default dropout: refused naming the first module or config field (with "
        "dropout 0 training runs exactly: the checkpointing column), or `none` when the defaults have none. **scan**: "
        "the static scan's hits in the family's modeling code (below).",
        "",
        "| family | HF model type | mechanism | status | backends | checkpointing | dropout | scan |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in FAMILIES:
        status, reason, dropout = statuses[row.name]
        if status == "exact":
            cell, backends = "exact", "sdpa, flash (+grad)" + (", flex (forward)" if row.flex else "; flex refused")
            ckpt = _checkpoint_cell(training["rows"].get(row.name))
        else:
            until = f" (until {row.lands_with} lands)" if row.lands_with else ""
            cell, backends, ckpt, dropout = f"refused{until}: {reason}", "-", "-", "-"
        package = _package(row.model_type)
        row_hits = [h for h in hits if h.module == package]
        cells = (row.name, f"`{row.model_type}`", row.mechanism, cell, backends, ckpt, dropout, _scan_cell(row_hits))
        lines.append("| " + " | ".join(c.replace("|", "/") for c in cells) + " |")
    lines += ["", *scan.render_summary(hits), END]
    return "\n".join(lines)


def _package(model_type: str) -> str:
    """The modeling package of ``model_type``'s causal-LM class (``gemma3_text`` -> ``gemma3``)."""
    import importlib

    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    name = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(model_type)
    transformers = importlib.import_module("transformers")
    cls = getattr(transformers, name, None) if name else None
    return cls.__module__.split(".")[-2] if cls is not None else model_type


def modeling_scan() -> Any:
    """``benchmarks/modeling_scan.py`` as a module (loaded once per process)."""
    import importlib.util

    name = "_bench_modeling_scan"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, Path(__file__).resolve().with_name("modeling_scan.py"))
        mod = importlib.util.module_from_spec(spec)
        sys.modules[name] = mod
        spec.loader.exec_module(mod)
    return sys.modules[name]


def doc_section(text: str) -> str:
    """The generated section of ``text`` (between the markers)."""
    start, end = text.index(BEGIN), text.index(END) + len(END)
    return text[start:end]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--write-docs", action="store_true", help="rewrite the model-support section of docs/models.md")
    ap.add_argument(
        "--auto", action="store_true", help="sweep every causal-LM architecture of the installed transformers"
    )
    ap.add_argument(
        "--train",
        action="store_true",
        help=f"run the training setups on every exact row and record them in {TRAINING.name}",
    )
    args = ap.parse_args(argv)
    import transformers

    transformers.logging.set_verbosity_error()
    if args.train:
        write_training()
    if args.auto:
        for status, meaning in SWEEP_STATUSES.items():
            print(f"# {status}: {meaning}")
        for t in causal_lm_types():
            print(t, *sweep_one(t), sep="\t", flush=True)
    table = render_table({row.name: status_of(row) for row in FAMILIES})  # after --train: its new record
    if args.write_docs:
        text = MODELS_DOC.read_text()
        MODELS_DOC.write_text(text.replace(doc_section(text), table))
    else:
        print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
