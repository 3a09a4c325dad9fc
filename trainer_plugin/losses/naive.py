"""Loop-based references of the losses, on unpacked per-sequence log-probabilities.

Each ``naive_*`` computes its packed loss of :mod:`~treepack.trainer.losses.packed` from
per-sequence token log-probabilities with plain loops (the weights from
:func:`naive_entry_weights`); the tests compare the two.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from treepack.proto.errors import RequestError

__all__ = ["naive_entry_weights", "naive_sft_loss", "naive_ppo_clip_loss", "naive_cispo_loss"]


def naive_entry_weights(
    trainable: Sequence[torch.Tensor], groups: Sequence[Any] | None, normalization: Any = "token"
) -> list[torch.Tensor]:
    """Reference weights on unpacked sequences: per sequence a [n] float64 weight per token
    (0 at unscored tokens). ``trainable[s]`` is a [n] bool tensor; token 0 is never scored."""
    S = len(trainable)
    scored = []
    for t in trainable:
        m = t.clone().bool()
        if m.numel():
            m[0] = False
        scored.append(m)
    counts = [int(m.sum()) for m in scored]
    labels = list(range(S)) if groups is None else [("own", s) if g is None else g for s, g in enumerate(groups)]
    total = sum(counts)
    seqs_with = sum(1 for c in counts if c)
    group_count: dict[Any, int] = {}
    for s in range(S):
        group_count[labels[s]] = group_count.get(labels[s], 0) + counts[s]
    groups_with = sum(1 for c in group_count.values() if c)
    out = []
    for s in range(S):
        if isinstance(normalization, (int, float)) and not isinstance(normalization, bool):
            w = 1.0 / normalization
        elif normalization == "sum":
            w = 1.0
        elif normalization == "token":
            w = 1.0 / max(total, 1)
        elif normalization == "sequence":
            w = 1.0 / (counts[s] * seqs_with) if counts[s] else 0.0
        elif normalization == "group":
            w = 1.0 / (group_count[labels[s]] * groups_with) if group_count[labels[s]] else 0.0
        else:
            raise RequestError(f"unknown normalization {normalization!r}", path="$.normalization", rule="enum")
        out.append(scored[s].to(torch.float64) * w)
    return out


def _seq_value(x: Any, s: int, n: int) -> torch.Tensor:
    """Sequence s's per-token values: ``x`` is a list of [n] tensors or a [S] tensor."""
    if isinstance(x, torch.Tensor):
        return x[s].expand(n)
    return torch.as_tensor(x[s])


def naive_sft_loss(
    seq_logprobs: Sequence[torch.Tensor],
    trainable: Sequence[torch.Tensor],
    *,
    groups: Sequence[Any] | None = None,
    weights: Any = None,
    normalization: Any = "token",
) -> torch.Tensor:
    """Reference :func:`sft_loss` on unpacked sequences.

    Args:
        seq_logprobs: per sequence [n] token log-probabilities (index i: token i given
            0..i-1; entry 0 unused).
        trainable: per sequence [n] bool.
        groups: per sequence group ids.
        weights: None, a [S] tensor, or per sequence [n] tensors.
        normalization: as :func:`sft_loss`.
    """
    ws = naive_entry_weights(trainable, groups, normalization)
    loss = torch.zeros((), dtype=torch.float64)
    for s, (lp, w) in enumerate(zip(seq_logprobs, ws)):
        for i in range(lp.shape[0]):
            if w[i] != 0:
                extra = 1.0 if weights is None else float(_seq_value(weights, s, lp.shape[0])[i])
                loss = loss - w[i] * extra * lp[i]
    return loss


def naive_ppo_clip_loss(
    seq_logprobs,
    trainable,
    *,
    advantages,
    old_logprobs=None,
    groups=None,
    clip_low=0.2,
    clip_high=None,
    normalization="token",
    ref_logprobs=None,
    kl_coef=0.0,
) -> torch.Tensor:
    """Reference :func:`ppo_clip_loss` on unpacked sequences (arguments as :func:`naive_sft_loss`;
    ``advantages`` a [S] tensor or per-sequence [n] tensors, log-probabilities per sequence)."""
    eh = clip_low if clip_high is None else clip_high
    ws = naive_entry_weights(trainable, groups, normalization)
    loss = torch.zeros((), dtype=torch.float64)
    for s, (lp, w) in enumerate(zip(seq_logprobs, ws)):
        n = lp.shape[0]
        a = _seq_value(advantages, s, n)
        old = lp.detach() if old_logprobs is None else _seq_value(old_logprobs, s, n)
        for i in range(n):
            if w[i] == 0:
                continue
            r = torch.exp(lp[i] - old[i])
            term = torch.minimum(r * a[i], torch.clamp(r, 1.0 - clip_low, 1.0 + eh) * a[i])
            if kl_coef:
                d = _seq_value(ref_logprobs, s, n)[i] - lp[i]
                term = term - kl_coef * (torch.exp(d) - d - 1)
            loss = loss - w[i] * term
    return loss


def naive_cispo_loss(
    seq_logprobs,
    trainable,
    *,
    advantages,
    old_logprobs,
    groups=None,
    clip_low=None,
    clip_high=0.2,
    normalization="token",
) -> torch.Tensor:
    """Reference :func:`cispo_loss` on unpacked sequences."""
    ws = naive_entry_weights(trainable, groups, normalization)
    loss = torch.zeros((), dtype=torch.float64)
    for s, (lp, w) in enumerate(zip(seq_logprobs, ws)):
        n = lp.shape[0]
        a = _seq_value(advantages, s, n)
        old = _seq_value(old_logprobs, s, n)
        for i in range(n):
            if w[i] == 0:
                continue
            r = torch.exp(lp[i].detach() - old[i])
            r = torch.clamp(r, min=None if clip_low is None else 1.0 - clip_low, max=1.0 + clip_high)
            loss = loss - w[i] * r * a[i] * lp[i]
    return loss
