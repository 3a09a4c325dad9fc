"""Tiny verl FSDP2 engines (stock and treepack) on one CPU gloo rank, GRPO batches for the actor,
PPO batches for the critic."""

from __future__ import annotations

import contextlib
import functools
import tempfile
from typing import Any

import torch
from tensordict import TensorDict
from verl.trainer.config import CheckpointConfig
from verl.utils import tensordict_utils as tu
from verl.workers.config import FSDPEngineConfig, FSDPOptimizerConfig, HFModelConfig
from verl.workers.config.actor import FSDPActorConfig
from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead
from verl.workers.utils.losses import ppo_loss, value_loss
from verl.workers.utils.padding import left_right_2_no_padding

VOCAB = 64

# The run's parity table (conftest prints it): (config, log-prob err, entropy err, update err).
PARITY: list[tuple[str, float, float, float]] = []


@functools.cache
def model_dir() -> str:
    """A random tiny Qwen2 saved once per session (weights drawn from seed 0)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen2Config(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=False,
    )
    d = tempfile.mkdtemp(prefix="treepack-verl-model-")
    Qwen2ForCausalLM(cfg).save_pretrained(d)
    return d


@functools.cache
def critic_dir() -> str:
    """A random tiny Qwen2 value model (``Qwen2ForTokenClassification``, one label) saved once per session."""
    from transformers import Qwen2Config, Qwen2ForTokenClassification

    torch.manual_seed(1)
    cfg = Qwen2Config(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        num_labels=1,
        classifier_dropout=0.0,
    )
    model = Qwen2ForTokenClassification(cfg)
    with torch.no_grad():
        model.score.weight.normal_(0, 0.5)  # values far from 0, so their errors show
    d = tempfile.mkdtemp(prefix="treepack-verl-critic-")
    model.save_pretrained(d)
    return d


def configs(*, grad_ckpt: bool = False, path: str | None = None, **model: Any) -> dict[str, Any]:
    """verl's four engine configs (on ``path``, default :func:`model_dir`).

    FSDP2, fp32, eager attention, SGD lr 1, no clipping.
    """
    mc = HFModelConfig(
        path=path or model_dir(),
        load_tokenizer=False,
        override_config={"attn_implementation": "eager"},
        enable_gradient_checkpointing=grad_ckpt,
        **model,
    )
    fp32 = {"param_dtype": "fp32", "reduce_dtype": "fp32", "buffer_dtype": "fp32"}
    ec = FSDPEngineConfig(
        strategy="fsdp2",
        use_torch_compile=False,
        dtype="float32",
        model_dtype="fp32",
        mixed_precision=fp32,
        micro_batch_size_per_gpu=2,
        infer_micro_batch_size_per_gpu=2,
        max_token_len_per_gpu=160,
        infer_max_token_len_per_gpu=160,
    )
    oc = FSDPOptimizerConfig(lr=1.0, optimizer="SGD", clip_grad=1e9, weight_decay=0.0, total_training_steps=10)
    return dict(model_config=mc, engine_config=ec, optimizer_config=oc, checkpoint_config=CheckpointConfig())


def build(cls: type, *, grad_ckpt: bool = False, path: str | None = None) -> FSDPEngineWithLMHead:
    """An initialized engine of class ``cls`` with :func:`configs`."""
    eng = cls(**configs(grad_ckpt=grad_ckpt, path=path))
    eng.initialize()
    return eng


def build_critic(cls: type, *, grad_ckpt: bool = False) -> FSDPEngineWithLMHead:
    """An initialized critic engine (model type ``value_model``) of class ``cls`` on :func:`critic_dir`."""
    cfg = configs(grad_ckpt=grad_ckpt, path=critic_dir())
    cfg["model_config"].model_type = "value_model"
    eng = cls(**cfg)
    eng.initialize()
    return eng


def critic_batch(seed: int = 0) -> TensorDict:
    """:func:`grpo_batch` as the critic's update reads it: old ``values`` and ``returns`` per response token."""
    td = grpo_batch(seed=seed)
    g = torch.Generator().manual_seed(seed + 100)
    B, R = td["responses"].shape
    td["values"] = torch.randn(B, R, generator=g)
    td["returns"] = torch.randn(B, R, generator=g)
    return td


def value_loss_fn(loss_agg_mode: str = "token-mean", cliprange_value: float = 0.5):
    """verl's own critic loss, as the critic worker binds it."""
    from verl.workers.config import FSDPCriticConfig

    cfg = FSDPCriticConfig(
        strategy="fsdp2",
        ppo_micro_batch_size_per_gpu=4,
        loss_agg_mode=loss_agg_mode,
        cliprange_value=cliprange_value,
        rollout_n=4,
        use_dynamic_bsz=False,
    )
    return functools.partial(value_loss, config=cfg)


@contextlib.contextmanager
def stock_registry():
    """verl's engine registry as it is now, put back on the way out (``verl_plugin.register()`` swaps entries)."""
    from verl.workers.engine.base import EngineRegistry

    saved = {t: {b: dict(v) for b, v in EngineRegistry._engines[t].items()} for t in ("language_model", "value_model")}
    try:
        yield
    finally:
        for t, tables in saved.items():
            for b, entries in tables.items():
                EngineRegistry._engines[t][b].clear()
                EngineRegistry._engines[t][b].update(entries)


def grpo_batch(
    *, groups: int = 2, n: int = 4, seed: int = 0, P: int = 28, R: int = 8, vocab: int = VOCAB
) -> TensorDict:
    """A padded GRPO batch (``groups`` prompts x ``n`` responses) as verl's trainer holds it.

    Prompts (``P - 10`` to ``P`` tokens) are left-padded, responses (2 to ``R`` tokens)
    right-padded; one response token in five is masked out of the loss (a tool token), as
    multi-turn batches have.
    """
    g = torch.Generator().manual_seed(seed)
    B = groups * n
    prompts = torch.zeros(B, P, dtype=torch.long)
    pmask = torch.zeros(B, P, dtype=torch.long)
    responses = torch.zeros(B, R, dtype=torch.long)
    rmask = torch.zeros(B, R, dtype=torch.long)
    for i in range(groups):
        plen = int(torch.randint(P - 10, P + 1, (1,), generator=g))
        prompt = torch.randint(1, vocab, (plen,), generator=g)
        for j in range(n):
            b = i * n + j
            prompts[b, P - plen :] = prompt
            pmask[b, P - plen :] = 1
            rlen = int(torch.randint(2, R + 1, (1,), generator=g))
            responses[b, :rlen] = torch.randint(1, vocab, (rlen,), generator=g)
            rmask[b, :rlen] = 1
    attention_mask = torch.cat([pmask, rmask], 1)
    response_mask = rmask * (torch.rand(B, R, generator=g) > 0.2).long()
    position_ids = (attention_mask.cumsum(1) - 1).clamp(min=0)
    td = TensorDict(
        {
            "prompts": prompts,
            "responses": responses,
            "input_ids": torch.cat([prompts, responses], 1),
            "attention_mask": attention_mask,
            "response_mask": response_mask,
            "position_ids": position_ids,
            "old_log_probs": -torch.rand(B, R, generator=g) * 3,
            "advantages": torch.randn(B, R, generator=g),
        },
        batch_size=[B],
    )
    return left_right_2_no_padding(td)


def flags(
    td: TensorDict, *, dynamic: bool, rmpad: bool, temperature: float = 1.0, micro: int = 4, **extra
) -> TensorDict:
    """The engine keys verl's worker injects (micro-batching, remove-padding, temperature)."""
    tu.assign_non_tensor(
        td,
        use_remove_padding=rmpad,
        use_dynamic_bsz=dynamic,
        max_token_len_per_gpu=160,
        micro_batch_size_per_gpu=micro,
        use_fused_kernels=False,
        temperature=temperature,
        **extra,
    )
    return td


def loss_fn(loss_agg_mode: str):
    """verl's own PPO loss, as the actor worker binds it."""
    cfg = FSDPActorConfig(
        strategy="fsdp2",
        ppo_micro_batch_size_per_gpu=4,
        loss_agg_mode=loss_agg_mode,
        rollout_n=4,
        use_dynamic_bsz=False,
    )
    return functools.partial(ppo_loss, config=cfg)


def params(eng) -> dict[str, torch.Tensor]:
    """Full parameter tensors by name (DTensor gathered)."""
    out = {}
    for k, p in eng.module.named_parameters():
        t = p.detach()
        out[k] = (t.full_tensor() if hasattr(t, "full_tensor") else t).clone()
    return out


def restore(eng, saved: dict[str, torch.Tensor]) -> None:
    with torch.no_grad():
        for k, p in eng.module.named_parameters():
            local = p.to_local() if hasattr(p, "to_local") else p
            local.copy_(saved[k])


def response_values(eng, td: TensorDict) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """``infer_batch`` log-probs and entropies at the response-mask positions, and the metrics.

    The log-probs are read back as verl's trainer does.
    """
    from verl.workers.utils.padding import no_padding_2_padding

    with eng.eval_mode():
        out = eng.infer_batch(td)
    mo = out["model_output"]
    m = td["response_mask"]
    mask = (m.to_padded_tensor(0) if m.is_nested else m).bool()
    return (
        no_padding_2_padding(mo["log_probs"], td)[mask],
        no_padding_2_padding(mo["entropy"], td)[mask],
        out["metrics"],
    )


def update(eng, td: TensorDict, mode: str = "token-mean", *, undo: bool = True) -> dict[str, torch.Tensor]:
    """The parameter update of one ``train_batch`` (SGD lr 1: the gradient), undone afterwards
    when ``undo`` (:func:`restore` copies whole tensors: one rank only)."""
    before = params(eng)
    with eng.train_mode():
        eng.train_batch(td, loss_function=loss_fn(mode))
    after = params(eng)
    if undo:
        restore(eng, before)
    return {k: before[k] - after[k] for k in before}
