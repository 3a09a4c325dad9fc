"""The Megatron oracle: tree rows through ``from_hf`` + ``packed_forward`` against HF running each sequence alone.

One case (:func:`tree_case`): GRPO groups (a prompt, several completions) and an agent-style
tree (a shared system prompt, then distinct prompts and completions), planned with a small
``min_shared_len`` so rows hold branches and several trees. The families (:data:`FAMILIES`)
are tiny random HF models: Llama with grouped-query attention, Qwen2 (q/k/v biases), Qwen3
(qk-norm), Llama with Llama-3 rope scaling (``original_max_position_embeddings`` far below
Megatron's hard-coded 8192, so a wrong conversion shows).

:func:`step` runs one GRPO (PPO-clip plus SFT) loss on one rank's rows and returns the per-sequence
log-probabilities and the parameter gradients converted back to HF names by Megatron-Bridge's
own export (gradients go through the same linear re-layout and TP gather as the weights).
:func:`hf_alone` is the reference: each sequence alone through the HF model, the loss of the
loop references (``naive_ppo_clip_loss`` + ``naive_sft_loss``), its HF gradients.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
import transformers

from treepack.service.planner import plan_batch, validate_plan
from treepack.trainer import materialize
from treepack.trainer.losses import naive_ppo_clip_loss, naive_sft_loss, ppo_clip_loss, sft_loss

# What the tests measured, printed by conftest at the end of the run: (family, TP, DP, backend,
# logprob err, gradient rel err, loss err) rows, and (negative control, its error) pairs.
EXACTNESS: list[tuple] = []
CONTROLS: list[tuple[str, float]] = []
TIMINGS: list[tuple[str, float]] = []  # multi-rank runs: (what, wall seconds)
# fp32 on tiny models: the packed step lands within ~1e-6 of HF alone; a broken mask or
# position misses by more than CONTROL_GAP.
TOL = 1e-5
CONTROL_GAP = 1e-3

VOCAB = 96
SEQ_LEN = 64
_BASE = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    tie_word_embeddings=False,
)
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 16,
    "rope_theta": 10000.0,
}
# A Qwen3-MoE config: 4 experts, top-2, every layer sparse.
MOE = dict(
    _BASE,
    moe_intermediate_size=32,
    head_dim=16,
    num_experts=4,
    num_experts_per_tok=2,
    decoder_sparse_step=1,
    mlp_only_layers=[],
)
FAMILIES = {
    "llama-gqa": lambda: transformers.LlamaConfig(**_BASE),
    "qwen2-bias": lambda: transformers.Qwen2Config(**_BASE),
    "qwen3-qknorm": lambda: transformers.Qwen3Config(**_BASE, head_dim=16),
    "llama3-rope-scaling": lambda: transformers.LlamaConfig(**_BASE, rope_scaling=LLAMA3_ROPE),
}


def hf_model(family: str, seed: int = 0) -> torch.nn.Module:
    """A tiny random HF causal LM of ``family`` (float32, eval mode: no dropout anywhere)."""
    torch.manual_seed(seed)
    cfg = FAMILIES[family]()
    cls = {"LlamaConfig": transformers.LlamaForCausalLM, "Qwen2Config": transformers.Qwen2ForCausalLM}.get(
        type(cfg).__name__, transformers.Qwen3ForCausalLM
    )
    model = cls(cfg).float()
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim == 1:  # norms and biases away from their init (1 / 0), so a dropped one shows
                p.add_(0.1 * torch.randn_like(p))
    return model.eval()


def tree_case(seed: int = 0, num_ranks: int = 1) -> tuple[list[np.ndarray], list[int], Any, torch.Tensor]:
    """(sequences, prompt lengths, plan, [S] advantages): GRPO groups and an agent tree (module docstring)."""
    rng = np.random.default_rng(seed)
    seqs, prompts = [], []
    for _ in range(2):  # GRPO groups: one prompt, three completions
        prompt = rng.integers(0, VOCAB, size=int(rng.integers(9, 15)))
        for _ in range(3):
            seqs.append(np.concatenate([prompt, rng.integers(0, VOCAB, size=int(rng.integers(3, 9)))]))
            prompts.append(len(prompt))
    system = rng.integers(0, VOCAB, size=7)
    for _ in range(3):  # a shared system prompt, then a task prompt and a completion each
        task = rng.integers(0, VOCAB, size=int(rng.integers(3, 6)))
        seqs.append(np.concatenate([system, task, rng.integers(0, VOCAB, size=int(rng.integers(4, 8)))]))
        prompts.append(len(system) + len(task))
    seqs = [s.astype(np.uint32) for s in seqs]
    plan = plan_batch(seqs, seq_len=SEQ_LEN, min_shared_len=2, trainable=prompts, num_ranks=num_ranks)
    validate_plan(plan, seqs, trainable=prompts)  # also in the rank processes, which no conftest wraps
    adv = torch.tensor(rng.standard_normal(len(seqs)), dtype=torch.float64)
    return seqs, prompts, plan, adv


def hf_alone(hf: torch.nn.Module, seqs, prompts, adv) -> tuple[list[torch.Tensor], torch.Tensor, dict]:
    """(per-sequence [n] log-probabilities (NaN where untrainable), the loss, HF gradients by name)."""
    hf.zero_grad(set_to_none=True)
    lps, trainable = [], []
    for x, p in zip(seqs, prompts):
        ids = torch.as_tensor(x.astype(np.int64))[None]
        logits = hf(input_ids=ids).logits[0].double()
        lp = torch.full((ids.shape[1],), float("nan"), dtype=torch.float64)
        got = torch.log_softmax(logits[:-1], -1).gather(1, ids[0, 1:, None])[:, 0]
        lp = torch.cat([lp[:1], got])
        t = torch.zeros(ids.shape[1], dtype=torch.bool)
        t[p:] = True
        lps.append(torch.where(t, lp, torch.full_like(lp, float("nan"))))
        trainable.append(t)
    seq_lps = [torch.nan_to_num(x) for x in lps]
    loss = naive_ppo_clip_loss(seq_lps, trainable, advantages=adv) + naive_sft_loss(seq_lps, trainable)
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in hf.named_parameters() if p.grad is not None}
    return [x.detach() for x in lps], loss.detach(), grads


def grpo_loss(lp: torch.Tensor, batch: Any, adv: torch.Tensor) -> torch.Tensor:
    """PPO-clip (on-policy: its value is the advantages' mean, its gradient is not) plus SFT (its value
    reads the log-probabilities), token-mean over the whole plan."""
    return ppo_clip_loss(lp, batch, advantages=adv) + sft_loss(lp, batch)


def step(model, plan, seqs, adv, *, rows=None, backend: str = "sdpa", tp_group=None, varlen_fn=None) -> dict:
    """One :func:`grpo_loss` on ``rows`` of the plan: {"lps": per-sequence (None off this rank), "loss", "batch"}.

    The model's gradients are accumulated (``.grad``); :func:`hf_grads` converts them."""
    from treepack.trainer.megatron import packed_forward, vocab_parallel_target_logprobs

    batch = materialize(plan, seqs, rows=rows)
    logits = packed_forward(model, batch, backend=backend, varlen_fn=varlen_fn)
    lp = vocab_parallel_target_logprobs(logits, batch, vocab_size=model.config.vocab_size, group=tp_group)
    loss = grpo_loss(lp, batch, adv)
    loss.backward()
    lps = [None if x is None else x.detach().double() for x in batch.unpack_logprobs(lp)]
    return {"lps": lps, "loss": loss.detach().double(), "batch": batch}


def hf_bridge(hf: torch.nn.Module) -> Any:
    """Megatron-Bridge's AutoBridge of a loaded HF model (for exporting gradients by HF name)."""
    from megatron.bridge import AutoBridge
    from megatron.bridge.models.hf_pretrained.causal_lm import PreTrainedCausalLM

    w = PreTrainedCausalLM()
    w.model, w.config = hf, hf.config
    return AutoBridge(w)


def hf_grads(model, bridge) -> dict[str, torch.Tensor]:
    """The model's gradients by HF parameter name: Bridge's export run on the gradients
    (every TP rank takes part; every rank gets the whole tensors)."""
    params = [p for p in model.parameters()]
    saved = [p.data for p in params]
    try:
        for p in params:
            p.data = p.grad if p.grad is not None else torch.zeros_like(p)
        return {n: t.detach().clone() for n, t in bridge.export_hf_weights([model], show_progress=False)}
    finally:
        for p, d in zip(params, saved):
            p.data = d


def reduce_grads(model) -> None:
    """The gradient reductions of Megatron's ``finalize_model_grads`` for this model, by hand:
    the sum over the DP group (treepack's losses are normalized over the whole plan, so the
    ranks' gradients add up; Megatron's DDP sums with ``calculate_per_token_loss=True``), and the
    sum over the TP group of the qk-norm weights (replicated, but each TP rank's heads give
    part of their gradient)."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    for name, p in model.named_parameters():
        if p.grad is None:
            continue
        if ps.get_data_parallel_world_size() > 1:
            dist.all_reduce(p.grad, group=ps.get_data_parallel_group())
        if ps.get_tensor_model_parallel_world_size() > 1 and ("q_layernorm" in name or "k_layernorm" in name):
            dist.all_reduce(p.grad, group=ps.get_tensor_model_parallel_group())


def compare(family: str, tp: int, dp: int, backend: str, ref: tuple, lps: list, loss: torch.Tensor, grads: dict):
    """Assert a packed step equals HF alone (``ref`` from :func:`hf_alone`) and record its row."""
    from helpers.tolerance import assert_close, max_abs_err

    ref_lps, ref_loss, ref_g = ref
    assert sorted(grads) == sorted(ref_g), sorted(set(grads) ^ set(ref_g))
    lp_err = max_abs_err(ref_lps, lps)
    g_err = max(float((grads[k] - ref_g[k]).abs().max() / ref_g[k].abs().max()) for k in ref_g)
    loss_err = float((loss - ref_loss).abs())
    EXACTNESS.append((family, tp, dp, backend, lp_err, g_err, loss_err))
    assert_close(f"{family} tp{tp} dp{dp} logprobs", ref_lps, lps, atol=TOL)
    assert_close(f"{family} tp{tp} dp{dp} loss", ref_loss, loss, atol=TOL)
    assert_close(f"{family} tp{tp} dp{dp} grads", ref_g, grads, ratio=TOL)


def control(name: str, ref_lps: list, lps: list) -> float:
    """Record a negative control and assert it misses HF alone by more than ``CONTROL_GAP``."""
    from helpers.tolerance import max_abs_err

    err = max_abs_err(ref_lps, lps)
    CONTROLS.append((name, err))
    assert err > CONTROL_GAP, f"negative control {name!r} was not caught: {err:.2e}"
    return err
