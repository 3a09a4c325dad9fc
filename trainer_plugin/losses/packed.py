"""The losses on packed rows: SFT NLL, GRPO/PPO-clip, CISPO (:mod:`treepack.trainer.losses`).

Each is a weighted sum over the batch's scored entries, every entry with its own sequence's
inputs (:mod:`~treepack.trainer.losses.entries`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from treepack.proto.errors import RequestError
from treepack.trainer.losses.entries import entries_like, entry_logprobs, entry_weights

if TYPE_CHECKING:
    from treepack.trainer.data.packed_batch import PackedBatch

__all__ = ["sft_loss", "ppo_clip_loss", "cispo_loss"]


def sft_loss(
    logprobs: torch.Tensor, batch: PackedBatch, *, weights: Any = None, normalization: Any = "token"
) -> torch.Tensor:
    """Negative log-likelihood of the scored tokens.

    Args:
        logprobs: [K, L] from :meth:`PackedBatch.target_logprobs`, or [K, L, V] logits.
        batch: the packed batch.
        weights: optional per-entry weights (payload name, [S], [K, L] or a number).
        normalization: see :mod:`treepack.trainer.losses`.

    Returns:
        Scalar: ``-sum_e w_e * weight_e * lp_e``.
    """
    lp = entry_logprobs(batch, logprobs)
    w = entry_weights(batch, normalization).to(lp.dtype)
    if weights is not None:
        w = w * entries_like(batch, weights, what="weights", like=lp)
    return -(w * lp).sum()


def ppo_clip_loss(
    logprobs: torch.Tensor,
    batch: PackedBatch,
    *,
    advantages: Any,
    old_logprobs: Any = None,
    clip_low: float = 0.2,
    clip_high: float | None = None,
    normalization: Any = "token",
    ref_logprobs: Any = None,
    kl_coef: float = 0.0,
) -> torch.Tensor:
    """GRPO / PPO clipped surrogate (plus optional k3 KL to a reference policy).

    Per entry: ``-min(r A, clip(r, 1 - clip_low, 1 + clip_high) A) + kl_coef * k3``, with
    ``r = exp(lp - old_lp)`` and ``k3 = exp(ref - lp) - (ref - lp) - 1``, weighted by the
    normalization and summed (:mod:`treepack.trainer.losses` for the packed form).

    Args:
        logprobs: [K, L] or [K, L, V] logits.
        batch: the packed batch.
        advantages: per-entry advantages (payload name, [S], [K, L] or a number).
        old_logprobs: per-entry behaviour log-probabilities (payload name: each sharer's
            own; or [K, L], [S], a number); None means on-policy (``old = lp.detach()``, r = 1).
        clip_low, clip_high: clip range (``clip_high`` defaults to ``clip_low``).
        normalization: see :mod:`treepack.trainer.losses`.
        ref_logprobs: per-entry reference log-probabilities (as ``old_logprobs``), needed
            when ``kl_coef`` != 0.
        kl_coef: weight of the k3 KL estimator.

    Returns:
        Scalar loss.
    """
    lp = entry_logprobs(batch, logprobs)
    eh = clip_low if clip_high is None else clip_high
    old = lp.detach() if old_logprobs is None else entries_like(batch, old_logprobs, what="old_logprobs", like=lp)
    ratio = torch.exp(lp - old)
    w = entry_weights(batch, normalization).to(lp.dtype)
    adv = entries_like(batch, advantages, what="advantages", like=lp)
    term = torch.minimum(ratio * adv, torch.clamp(ratio, 1.0 - clip_low, 1.0 + eh) * adv)
    loss = -(w * term).sum()
    if kl_coef:
        if ref_logprobs is None:
            raise RequestError("kl_coef needs ref_logprobs", path="$.ref_logprobs", rule="required")
        d = entries_like(batch, ref_logprobs, what="ref_logprobs", like=lp) - lp
        loss = loss + kl_coef * (w * (torch.exp(d) - d - 1)).sum()
    return loss


def cispo_loss(
    logprobs: torch.Tensor,
    batch: PackedBatch,
    *,
    advantages: Any,
    old_logprobs: Any,
    clip_low: float | None = None,
    clip_high: float = 0.2,
    normalization: Any = "token",
) -> torch.Tensor:
    """CISPO: REINFORCE with a clipped, stop-gradient importance weight.

    Per entry: ``-sg(clip(r, 1 - clip_low, 1 + clip_high)) * A * lp`` (no lower clip when
    ``clip_low`` is None), each entry with its own ratio and advantage.

    Args:
        logprobs: [K, L] or [K, L, V] logits.
        batch: the packed batch.
        advantages: per-entry advantages (payload name, [S], [K, L] or a number).
        old_logprobs: per-entry behaviour log-probabilities (payload name: each sharer's
            own; or [K, L], [S], a number).
        clip_low, clip_high: importance-weight clip range.
        normalization: see :mod:`treepack.trainer.losses`.

    Returns:
        Scalar loss.
    """
    lp = entry_logprobs(batch, logprobs)
    old = entries_like(batch, old_logprobs, what="old_logprobs", like=lp)
    r = torch.exp(lp.detach() - old)
    r = torch.clamp(r, min=None if clip_low is None else 1.0 - clip_low, max=1.0 + clip_high)
    w = entry_weights(batch, normalization).to(lp.dtype)
    return -(w * entries_like(batch, advantages, what="advantages", like=lp) * r * lp).sum()
