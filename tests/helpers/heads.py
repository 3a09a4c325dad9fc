"""Reward models and value heads for the head tests: tiny HF classification models and a GRPO batch.

:func:`head_model` builds a ``*ForSequenceClassification`` (reward model) or
``*ForTokenClassification`` (value head) of a family from the family sweep's shrunken config
(:func:`helpers.families.model_support`), every parameter perturbed; :func:`grpo_case` is a
batch a reward model scores and a critic values: two prompts with four completions each (one
completion a prefix of another, completions ending in the pad id, one with the pad id
inside) and a sequence of its own. :func:`head_oracle` runs a head on the batch packed and
every sequence alone and returns both sides' outputs and gradients.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from helpers.families import model_support

PAD = 3  # also the EOS of the completions: HF pools at the last token that is not it


def head_model(model_type: str, head: str, *, pad_token_id: int | None = PAD, seed: int = 0, **over: Any) -> Any:
    """A tiny fp32 ``*For{head}Classification`` of ``model_type`` (eval mode, eager attention, perturbed).

    Args:
        model_type: an HF model type of the family sweep.
        head: ``sequence`` (one score per sequence, ``num_labels=1``) or ``token`` (one value
            per token, ``num_labels=1``).
        pad_token_id: the config's pad id (HF's pooling rule; None: the last token).
        seed: the weights' seed.
        **over: more config fields.
    """
    from transformers import AutoConfig, AutoModelForSequenceClassification, AutoModelForTokenClassification

    ms = model_support()
    config = ms.shrink_config(AutoConfig.for_model(model_type))
    config.num_labels = 1
    config.pad_token_id = pad_token_id
    for k, v in over.items():
        setattr(config, k, v)
    auto = AutoModelForSequenceClassification if head == "sequence" else AutoModelForTokenClassification
    torch.manual_seed(seed)
    model = auto.from_config(config, dtype=torch.float32)
    model.set_attn_implementation("eager")
    return ms.perturb(model.float().eval(), seed=seed + 1)


def grpo_case(vocab: int = 97) -> dict[str, Any]:
    """Two GRPO groups of four completions (prompts of 12 and 9 tokens) and one sequence of its own.

    Completions: one ends with the pad id (EOS), one with two, one holds the pad id inside,
    one is a strict prefix of another; the completions are trainable (a critic values them).
    """
    rng = np.random.default_rng(7)

    def r(n: int) -> np.ndarray:
        return rng.integers(4, vocab, n)

    seqs, trainable, groups = [], [], []
    for g, plen in enumerate((12, 9)):
        prompt = r(plen)
        c0 = np.concatenate([r(6), [PAD]])
        comps = [c0, np.concatenate([r(3), [PAD], r(4)]), np.concatenate([r(5), [PAD, PAD]]), c0[:4].copy()]
        for c in comps:
            seqs.append(np.concatenate([prompt, c]))
            trainable.append(plen)
            groups.append(g)
    seqs.append(r(11))
    trainable.append(3)
    groups.append(2)
    return dict(sequences=seqs, trainable=trainable, groups=groups, seq_len=48, min_shared_len=4)


def grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter's ``.grad`` (cloned), then zeroed."""
    out = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return out


def alone_outputs(model: Any, seqs: list[np.ndarray]) -> list[torch.Tensor]:
    """HF's own output of each sequence run alone: [num_labels] scores, or [n, num_labels] values."""
    return [model(input_ids=torch.as_tensor(np.asarray(s), dtype=torch.int64)[None]).logits[0] for s in seqs]


def packed_outputs(model: Any, batch: Any, **kw: Any) -> list[torch.Tensor]:
    """The packed call's output per sequence (the batch holds every sequence): scores or values."""
    from treepack.trainer.hf import packed_forward

    out = packed_forward(model, batch, **kw)
    if out.ndim == 2:  # [S, num_labels] scores in sequence order (every sequence is local)
        return list(out.unbind(0))
    return [v for v in batch.unpack_values(out)]


def head_oracle(model: Any, batch: Any, seqs: list[np.ndarray], **kw: Any) -> tuple[list, list, dict, dict]:
    """(alone outputs, packed outputs, alone grads, packed grads): both sides backpropagate the
    same fixed random weighting of every output (no gradient cancels by symmetry)."""
    alone = alone_outputs(model, seqs)
    gen = torch.Generator().manual_seed(5)
    weights = [torch.randn(a.shape, generator=gen) for a in alone]
    sum((a * w).sum() for a, w in zip(alone, weights)).backward()
    g_alone = grads(model)
    packed = packed_outputs(model, batch, **kw)
    sum((p * w).sum() for p, w in zip(packed, weights)).backward()
    g_packed = grads(model)
    return [a.detach() for a in alone], [p.detach() for p in packed], g_alone, g_packed
