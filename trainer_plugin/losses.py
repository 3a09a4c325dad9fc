"""Losses on packed rows: SFT NLL, GRPO/PPO-clip, CISPO (SPEC 7).

Every loss is a weighted sum over **scored entries** (sequence s, token p trainable, p >= 1)
and equals the same loss computed on the unpacked sequences, term by term: each entry
reads the log-probability of the row position that predicts its token
(``lp[score_flat[e]]``, a gather, so autograd sums the gradients of a shared position's
sharers) and combines it with **its own sequence's** inputs. A position shared by several
sequences (generalized sharing mode, SPEC 2) therefore contributes once per sharer, with
each sharer's own weight, advantage, behaviour and reference log-probability: nothing is
merged, so PPO-clip (not linear in the advantage, and whose ratio depends on each sharer's
own ``old_logprobs``) is exact as well as the linear losses. (A behaviour log-probability
of a shared position may well differ among its sharers: they were sampled by different
inference runs, engines or policy versions.)

Normalizations (the weight ``w`` of an entry of sequence s, counts over **all**
sequences of the plan, every rank included, so per-rank losses add up to the global loss):

- ``token``: 1 / (scored entries of the batch) — token mean (DAPO);
- ``sequence``: 1 / (n_s * sequences with entries) — mean of per-sequence token means (GRPO);
- ``group``: 1 / (n_g * groups with entries), n_g the entries of s's group — mean of
  per-group token means;
- ``sum``: 1; a number c: 1 / c (a constant denominator, Dr. GRPO).

Per-entry inputs (``advantages``, ``weights``, ``old_logprobs``, ``ref_logprobs``) are: a
payload name (target-aligned, see :func:`~treepack.trainer.data.materialize`: read per
scored entry, i.e. per (position, sharer)), a [S] tensor (one value per sequence, e.g.
GRPO advantages), a [K, L] packed tensor (one value per position: the same for every
sharer, e.g. log-probabilities computed on these packed rows), or a number.

``naive_*`` references compute the same losses from unpacked per-sequence log-probabilities
with plain loops.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from treepack.proto.errors import InputTypeError, RequestError

if TYPE_CHECKING:
    from treepack.trainer.data.packed_batch import PackedBatch

__all__ = [
    "NORMALIZATIONS",
    "entry_weights",
    "entry_values",
    "position_sum",
    "entry_logprobs",
    "sft_loss",
    "ppo_clip_loss",
    "cispo_loss",
    "naive_entry_weights",
    "naive_sft_loss",
    "naive_ppo_clip_loss",
    "naive_cispo_loss",
]

NORMALIZATIONS = ("token", "sequence", "group", "sum")


def _weights_from_counts(counts: torch.Tensor, groups: torch.Tensor, normalization: Any) -> torch.Tensor:
    """[S] float64 weight of one entry of each sequence."""
    c = counts.to(torch.float64)
    if isinstance(normalization, (int, float)) and not isinstance(normalization, bool):
        if normalization <= 0:
            raise RequestError(
                f"a constant normalization must be > 0, got {normalization}", path="$.normalization", rule="positive"
            )
        return torch.full_like(c, 1.0 / float(normalization))
    if normalization == "sum":
        return torch.ones_like(c)
    # Every count stays on the device (no .item(): on a GPU each one would stall the stream).
    if normalization == "token":
        return torch.ones_like(c) / c.sum().clamp(min=1.0)
    if normalization == "sequence":
        nz = (c > 0).sum().clamp(min=1)
        return torch.where(c > 0, 1.0 / (c.clamp(min=1) * nz), torch.zeros_like(c))
    if normalization == "group":
        # Group codes are dense, below the number of sequences: S bins always suffice.
        ng = torch.zeros(c.shape[0], dtype=torch.float64, device=c.device).index_add(0, groups, c)
        nz = (ng > 0).sum().clamp(min=1)
        mine = ng[groups]
        return torch.where(mine > 0, 1.0 / (mine.clamp(min=1) * nz), torch.zeros_like(c))
    raise RequestError(
        f"normalization must be one of {NORMALIZATIONS} or a positive number, got {normalization!r}",
        path="$.normalization",
        rule="enum",
    )


def entry_weights(batch: PackedBatch, normalization: Any = "token") -> torch.Tensor:
    """[T] float64 normalization weight of every scored entry (module docstring)."""
    w = _weights_from_counts(batch.score_counts, batch.groups, normalization)
    return w[batch.score_seq]


def entry_values(batch: PackedBatch, x: Any, *, what: str) -> torch.Tensor:
    """[T] per-entry values of ``x`` (payload name, [S], [K, L] or a number)."""
    if isinstance(x, str):
        if x not in batch.entry_payloads:
            raise RequestError(
                f"{what}: no target-aligned payload named {x!r} (have {sorted(batch.entry_payloads)})",
                path=f"$.{what}",
                rule="unknown_payload",
            )
        return batch.entry_payloads[x]
    if isinstance(x, (int, float)) and not isinstance(x, bool):
        return torch.full((batch.num_scored,), float(x), dtype=torch.float64, device=batch.device)
    if not isinstance(x, torch.Tensor):
        raise InputTypeError(
            f"{what} must be a payload name, a tensor or a number, got {type(x).__name__}",
            path=f"$.{what}",
            rule="type",
        )
    S, K, L = batch.plan.num_sequences, batch.num_rows, batch.seq_len
    if x.ndim == 1 and x.shape[0] == S:
        return x[batch.score_seq]
    if x.ndim == 2 and tuple(x.shape) == (K, L):
        return x.reshape(-1)[batch.score_flat]
    raise RequestError(
        f"{what} must have shape [{S}] (per sequence) or [{K}, {L}] (packed), got {tuple(x.shape)}",
        path=f"$.{what}",
        rule="shape",
    )


def position_sum(batch: PackedBatch, values: torch.Tensor) -> torch.Tensor:
    """[K, L] sum over the sharers of each position of their entries' ``values`` ([T])."""
    K, L = batch.num_rows, batch.seq_len
    return (
        torch.zeros(K * L, dtype=values.dtype, device=values.device).index_add(0, batch.score_flat, values).view(K, L)
    )


def entry_logprobs(batch: PackedBatch, logprobs: torch.Tensor) -> torch.Tensor:
    """[T] the log-probability of every scored entry's token (a gather of the predicting positions).

    Args:
        batch: the packed batch.
        logprobs: [K, L] from :meth:`PackedBatch.target_logprobs`, or [K, L, V] logits.
    """
    if not isinstance(logprobs, torch.Tensor):
        raise InputTypeError(
            f"logprobs must be a tensor, got {type(logprobs).__name__}", path="$.logprobs", rule="type"
        )
    if logprobs.ndim == 3:
        logprobs = batch.target_logprobs(logprobs)
    if tuple(logprobs.shape) != (batch.num_rows, batch.seq_len):
        raise RequestError(
            f"logprobs must have shape [{batch.num_rows}, {batch.seq_len}] (or logits [K, L, V]), got {tuple(logprobs.shape)}",
            path="$.logprobs",
            rule="shape",
        )
    return logprobs.reshape(-1)[batch.score_flat]


def _entries_like(batch: PackedBatch, x: Any, *, what: str, like: torch.Tensor) -> torch.Tensor:
    """[T] per-entry values of ``x`` in ``like``'s dtype."""
    return entry_values(batch, x, what=what).to(like.dtype)


def sft_loss(
    logprobs: torch.Tensor, batch: PackedBatch, *, weights: Any = None, normalization: Any = "token"
) -> torch.Tensor:
    """Negative log-likelihood of the scored tokens.

    Args:
        logprobs: [K, L] from :meth:`PackedBatch.target_logprobs`, or [K, L, V] logits.
        batch: the packed batch.
        weights: optional per-entry weights (payload name, [S], [K, L] or a number).
        normalization: module docstring.

    Returns:
        Scalar: ``-sum_e w_e * weight_e * lp_e``.
    """
    lp = entry_logprobs(batch, logprobs)
    w = entry_weights(batch, normalization).to(lp.dtype)
    if weights is not None:
        w = w * _entries_like(batch, weights, what="weights", like=lp)
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
    normalization and summed (module docstring for the packed form).

    Args:
        logprobs: [K, L] or [K, L, V] logits.
        batch: the packed batch.
        advantages: per-entry advantages (payload name, [S], [K, L] or a number).
        old_logprobs: per-entry behaviour log-probabilities (payload name: each sharer's
            own; or [K, L], [S], a number); None means on-policy (``old = lp.detach()``, r = 1).
        clip_low, clip_high: clip range (``clip_high`` defaults to ``clip_low``).
        normalization: module docstring.
        ref_logprobs: per-entry reference log-probabilities (as ``old_logprobs``), needed
            when ``kl_coef`` != 0.
        kl_coef: weight of the k3 KL estimator.

    Returns:
        Scalar loss.
    """
    lp = entry_logprobs(batch, logprobs)
    eh = clip_low if clip_high is None else clip_high
    old = lp.detach() if old_logprobs is None else _entries_like(batch, old_logprobs, what="old_logprobs", like=lp)
    ratio = torch.exp(lp - old)
    w = entry_weights(batch, normalization).to(lp.dtype)
    adv = _entries_like(batch, advantages, what="advantages", like=lp)
    term = torch.minimum(ratio * adv, torch.clamp(ratio, 1.0 - clip_low, 1.0 + eh) * adv)
    loss = -(w * term).sum()
    if kl_coef:
        if ref_logprobs is None:
            raise RequestError("kl_coef needs ref_logprobs", path="$.ref_logprobs", rule="required")
        d = _entries_like(batch, ref_logprobs, what="ref_logprobs", like=lp) - lp
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
        normalization: module docstring.

    Returns:
        Scalar loss.
    """
    lp = entry_logprobs(batch, logprobs)
    old = _entries_like(batch, old_logprobs, what="old_logprobs", like=lp)
    r = torch.exp(lp.detach() - old)
    r = torch.clamp(r, min=None if clip_low is None else 1.0 - clip_low, max=1.0 + clip_high)
    w = entry_weights(batch, normalization).to(lp.dtype)
    return -(w * _entries_like(batch, advantages, what="advantages", like=lp) * r * lp).sum()


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
