"""Small batches and tiny HF models for the trainer tests (shared by tests/trainer/)."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

VOCAB = 97


def mixed_batch() -> dict[str, Any]:
    """A hand-made batch exercising every layout case in rows of 64.

    - tree A: a 20-token prompt shared by 3 completions (join tokens duplicated), plus an
      identical copy of one completion and a sequence that is a prefix of the prompt
      (nothing trainable: fully shareable);
    - tree B: a 12-token system prefix, two task prompts under it (no join token: the
      task prompts are not scored where they diverge), completions under each task with
      interleaved trainable turns (bool flags);
    - unrelated short sequences (own trees, filling rows), and padding at row ends.
    min_shared_len 6 so that trees are several levels deep inside short rows.
    """
    rng = np.random.default_rng(1234)
    r = lambda n: rng.integers(0, VOCAB, n)  # noqa: E731
    seqs: list[np.ndarray] = []
    trainable: list[Any] = []
    groups: list[Any] = []
    prompt = r(20)
    for n in (7, 5, 9):
        seqs.append(np.concatenate([prompt, r(n)]))
        trainable.append(20)
        groups.append("A")
    seqs.append(seqs[1].copy())
    trainable.append(20)
    groups.append("A")
    seqs.append(prompt[:8].copy())
    trainable.append(None)
    groups.append("A")
    system = r(12)
    for t in range(2):
        task = r(8)
        for _ in range(2):
            turn1, obs, turn2 = r(3), r(3), r(2)
            s = np.concatenate([system, task, turn1, obs, turn2])
            flags = np.zeros(s.shape[0], dtype=bool)
            flags[20:23] = True
            flags[26:28] = True
            seqs.append(s)
            trainable.append(flags)
            groups.append(f"B{t}")
    for n in (9, 13, 4):
        seqs.append(r(n))
        trainable.append(2)
        groups.append(None)
    trainable = [np.zeros(len(s), bool) if t is None else t for s, t in zip(seqs, trainable)]
    return dict(sequences=seqs, trainable=trainable, groups=groups, seq_len=64, min_shared_len=6)


def random_batch(seed: int) -> dict[str, Any]:
    """A random batch with shared prefixes of random depth, random trainable flags.

    Sequences are built by extending random earlier prefixes, so they share runs of every
    length (some shorter than ``min_shared_len``), some are prefixes of others, some
    identical; trainable flags are a prompt length or a random bool array.
    """
    rng = np.random.default_rng(seed)
    n = int(rng.integers(2, 12))
    msl = int(rng.integers(1, 8))
    seqs: list[np.ndarray] = []
    for _ in range(n):
        if seqs and rng.random() < 0.7:
            base = seqs[int(rng.integers(0, len(seqs)))]
            cut = int(rng.integers(0, base.shape[0] + 1))
            tail = rng.integers(0, VOCAB, int(rng.integers(0 if cut else 1, 20)))
            s = np.concatenate([base[:cut], tail])
        else:
            s = rng.integers(0, VOCAB, int(rng.integers(1, 30)))
        seqs.append(s[:48] if s.shape[0] else rng.integers(0, VOCAB, 1))
    trainable: list[Any] = []
    for s in seqs:
        u = rng.random()
        if u < 0.5:
            trainable.append(int(rng.integers(0, s.shape[0] + 1)))
        else:
            trainable.append(rng.random(s.shape[0]) < rng.random())
    seq_len = int(max(s.shape[0] for s in seqs) + rng.integers(0, 24))
    groups = [int(g) for g in rng.integers(0, 3, n)]
    return dict(sequences=seqs, trainable=trainable, groups=groups, seq_len=seq_len, min_shared_len=msl)


def plan_of(case: dict[str, Any], **kw: Any):
    from treepack.service.planner import plan_batch, validate_plan

    plan = plan_batch(
        case["sequences"],
        seq_len=case["seq_len"],
        min_shared_len=case["min_shared_len"],
        trainable=case["trainable"],
        groups=case["groups"],
        **kw,
    )
    validate_plan(plan, case["sequences"], trainable=case["trainable"])
    return plan


def trainable_flags(case: dict[str, Any]) -> list[torch.Tensor]:
    out = []
    for s, t in zip(case["sequences"], case["trainable"]):
        if isinstance(t, (int, np.integer)):
            f = np.zeros(len(s), dtype=bool)
            f[int(t) :] = True
        else:
            f = np.asarray(t, dtype=bool)
        out.append(torch.from_numpy(f))
    return out


def tiny_model(family: str, seed: int = 0, heads: tuple[int, int] = (4, 2)) -> torch.nn.Module:
    """A 2-layer fp32 model with random weights (no hub access needed); ``heads`` is
    (query heads, key/value heads)."""
    import transformers as tf

    torch.manual_seed(seed)
    common = dict(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=heads[0],
        num_key_value_heads=heads[1],
        max_position_embeddings=256,
    )
    if family == "qwen3":
        cfg = tf.Qwen3Config(head_dim=8, **common)
        model = tf.Qwen3ForCausalLM(cfg)
    elif family == "llama":
        cfg = tf.LlamaConfig(**common)
        model = tf.LlamaForCausalLM(cfg)
    elif family == "gemma2":
        # Sliding window on alternate layers and attention logit soft-capping.
        cfg = tf.Gemma2Config(
            head_dim=8,
            sliding_window=6,
            attn_logit_softcapping=5.0,
            final_logit_softcapping=None,
            query_pre_attn_scalar=8,
            **common,
        )
        model = tf.Gemma2ForCausalLM(cfg)
    else:
        raise ValueError(family)
    model.set_attn_implementation("sdpa" if family != "gemma2" else "eager")
    return model.float().eval()


def reference_logprobs(
    model: torch.nn.Module, sequences: list[np.ndarray], flags: list[torch.Tensor], impl: str = "sdpa"
) -> list[torch.Tensor]:
    """Each sequence alone through the stock model: [n] logprob of token i given 0..i-1 at
    every trainable i >= 1, NaN elsewhere (the :meth:`PackedBatch.unpack_logprobs` format)."""
    model.set_attn_implementation(impl)
    out = []
    for s, f in zip(sequences, flags):
        x = torch.as_tensor(np.asarray(s), dtype=torch.int64)[None]
        logits = model(input_ids=x, use_cache=False).logits[0].float()
        lp = torch.log_softmax(logits[:-1], -1).gather(1, x[0, 1:, None]).squeeze(1)
        full = torch.cat([lp.new_full((1,), float("nan")), lp])
        keep = f.clone()
        keep[0] = False
        out.append(torch.where(keep, full, torch.full_like(full, float("nan"))))
    return out


def shared_trainable_batch() -> dict[str, Any]:
    """Completions that agree on their first trainable tokens (generalized sharing mode).

    A 16-token prompt; completions in pairs share their first 8 tokens, one pair shares
    12; one completion is a prefix of another; plus an unrelated sequence. Planned with
    ``share_trainable=True`` the shared completion runs become shared scored positions.
    """
    rng = np.random.default_rng(99)
    r = lambda n: rng.integers(0, VOCAB, n)  # noqa: E731
    prompt = r(16)
    seqs: list[np.ndarray] = []
    for head_len in (8, 8, 12):
        head = r(head_len)
        for tail in (5, 7):
            seqs.append(np.concatenate([prompt, head, r(tail)]))
    seqs.append(seqs[0][:20].copy())
    seqs.append(r(11))
    trainable = [16] * (len(seqs) - 1) + [3]
    return dict(sequences=seqs, trainable=trainable, groups=[0] * 6 + [1, 2], seq_len=96, min_shared_len=6)


def unchecked_packed_logits(model: torch.nn.Module, batch: Any) -> torch.Tensor:
    """[K, L, vocab] logits of the packed rows with the model's layers as they are, skipping
    ``check_model`` (which refuses unpatched mixers): for negative controls only, to show what
    running a stock mixer over a whole row gives."""
    from treepack.trainer.hf.context import BATCH_KWARG, PackedContext, use_packed
    from treepack.trainer.hf.dispatch import install_dispatch
    from treepack.trainer.hf.layer_masks import attention_mask_for

    install_dispatch(model)
    ctx = PackedContext(batch=batch, backend="sdpa")
    with use_packed(ctx):
        out = model(
            input_ids=batch.input_ids,
            position_ids=batch.position_ids,
            attention_mask=attention_mask_for(model, batch.dense_mask()),
            use_cache=False,
            **{BATCH_KWARG: ctx},
        )
    return out.logits


def tiny_gpt_oss():
    """Sliding (window 6) and full layers, both with sinks; sinks drawn large so they matter."""
    from transformers import GptOssConfig, GptOssForCausalLM

    cfg = GptOssConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        num_local_experts=4,
        num_experts_per_tok=2,
        sliding_window=6,
        max_position_embeddings=512,
        layer_types=["sliding_attention", "full_attention"],
    )
    torch.manual_seed(0)
    model = GptOssForCausalLM(cfg).float().eval()
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.sinks.normal_(0, 2)
    return model


def tiny_llama4():
    """Three chunked (RoPE) layers of chunk 16 and one full NoPE layer, MoE every other layer."""
    from transformers import Llama4ForCausalLM, Llama4TextConfig

    cfg = Llama4TextConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=32,
        intermediate_size_mlp=48,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        num_local_experts=2,
        num_experts_per_tok=1,
        attention_chunk_size=16,
        max_position_embeddings=512,
        interleave_moe_layer_step=2,
    )
    assert cfg.layer_types.count("chunked_attention") == 3
    torch.manual_seed(0)
    return Llama4ForCausalLM(cfg).float().eval()
