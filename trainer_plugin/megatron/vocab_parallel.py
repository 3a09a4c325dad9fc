"""Target log-probabilities and entropies of vocab-parallel logits, never gathering the vocabulary.

Under tensor parallelism Megatron's output layer leaves each TP rank the logits of its own
slice of the (padded) vocabulary: rank r of a TP group of size t holds entries
``[r * Vp, (r + 1) * Vp)`` with ``Vp = padded_vocab // t``. :func:`vocab_parallel_target_logprobs`
returns what :meth:`~treepack.trainer.data.packed_batch.PackedBatch.target_logprobs` returns
on the whole vocabulary, as Megatron's own ``vocab_parallel_cross_entropy`` does: three
all-reduces of ``[n]`` values over the TP group (the max, the sum of exponentials, the target
logit; with the entropy, a fourth for ``sum p * x``). The result is the same on every TP rank,
so the treepack losses (:mod:`treepack.trainer.losses`: SFT, PPO/GRPO, CISPO) run on it
unchanged.

Gradients: every TP rank computes the same loss from these replicated values, so the
reductions are all-reduces forward and the identity backward (Megatron's
``reduce_from_tensor_model_parallel_region``); each rank's logits shard gets the gradient
of its own entries.

Entries at or past the model's true vocabulary (``vocab_size``; Megatron pads the output
layer to a multiple of ``make_vocab_size_divisible_by * t``) are left out of the softmax, as
the HF model, which has no padding rows, leaves them out.

:func:`naive_vocab_parallel_target_logprobs` is the reference: it all-gathers the whole
vocabulary and runs the one-device log-softmax.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from treepack.proto.errors import RequestError
from treepack.trainer.data.logprobs import check_temperature, target_stats

if TYPE_CHECKING:
    from treepack.trainer.data.packed_batch import PackedBatch

__all__ = ["vocab_parallel_target_logprobs", "naive_vocab_parallel_target_logprobs", "vocab_parallel_stats"]


class _AllReduceSum(torch.autograd.Function):
    """Sum over the group forward, identity backward (every rank's loss is the same replicated value)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        y = x.clone()
        if group is not None and dist.get_world_size(group) > 1:
            dist.all_reduce(y, op=dist.ReduceOp.SUM, group=group)
        return y

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None]:
        return g, None


def _all_reduce_sum(x: torch.Tensor, group: Any) -> torch.Tensor:
    return _AllReduceSum.apply(x, group)


def vocab_parallel_stats(
    logits: torch.Tensor,
    targets: torch.Tensor,
    *,
    vocab_start: int,
    vocab_size: int,
    group: Any = None,
    temperature: float = 1.0,
    with_entropy: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-softmax at ``targets`` (and entropies) of logits split over a group by vocabulary.

    Args:
        logits: [n, Vp] this rank's slice of the logits (entries ``vocab_start + j``).
        targets: [n] int64 global token ids (the same on every rank of the group).
        vocab_start: the global id of this slice's first entry.
        vocab_size: the true vocabulary; entries at or past it are left out.
        group: the TP process group (None: one rank holds the whole vocabulary).
        temperature: the logits are divided by it first.
        with_entropy: also return the entropies.

    Returns:
        ([n] log-probabilities, [n] entropies or None), float32 or wider, the same on every rank.
    """
    x = logits.float() if logits.dtype in (torch.float16, torch.bfloat16) else logits
    if temperature != 1.0:
        x = x / temperature
    n, vp = x.shape
    ids = torch.arange(vocab_start, vocab_start + vp, device=x.device)
    real = ids < vocab_size
    x = x.masked_fill(~real, float("-inf")) if not bool(real.all()) else x
    # The max only shifts the exponentials (the result does not depend on it): no gradient.
    m = x.detach().max(dim=-1).values if vp else x.new_full((n,), float("-inf"))
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
    e = torch.exp(x - m[:, None])
    sumexp = _all_reduce_sum(e.sum(-1), group)
    lse = m + torch.log(sumexp)
    local = (targets >= vocab_start) & (targets < vocab_start + vp)
    idx = (targets - vocab_start).clamp(0, max(vp - 1, 0))
    picked = torch.where(local, x.gather(1, idx[:, None]).squeeze(1), torch.zeros_like(lse))
    lp = _all_reduce_sum(picked, group) - lse
    if not with_entropy:
        return lp, None
    # H = lse - sum_j p_j x_j; padding entries (x = -inf, p = 0) contribute 0.
    px = torch.where(real[None, :], e * x.masked_fill(~real[None, :], 0.0), torch.zeros_like(e)).sum(-1)
    return lp, lse - _all_reduce_sum(px, group) / sumexp


def _check(logits: Any, batch: PackedBatch, vocab_size: Any, group: Any) -> tuple[int, int]:
    """(this rank's vocab_start, its slice width); refuses a bad shape or vocabulary."""
    if not isinstance(logits, torch.Tensor) or logits.ndim != 3:
        got = tuple(logits.shape) if isinstance(logits, torch.Tensor) else type(logits).__name__
        raise RequestError(f"logits must have shape [K, L, vocab // tp], got {got}", path="$.logits", rule="shape")
    if tuple(logits.shape[:2]) != (batch.num_rows, batch.seq_len):
        raise RequestError(
            f"logits must have shape [{batch.num_rows}, {batch.seq_len}, vocab // tp], got {tuple(logits.shape)}",
            path="$.logits",
            rule="shape",
        )
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < 1:
        raise RequestError(
            f"vocab_size must be a positive int (the model's unpadded vocabulary), got {vocab_size!r}",
            path="$.vocab_size",
            rule="range",
        )
    vp = int(logits.shape[2])
    rank = dist.get_rank(group) if group is not None else 0
    size = dist.get_world_size(group) if group is not None else 1
    if vp * size < vocab_size:
        raise RequestError(
            f"logits hold {vp} vocabulary entries on each of {size} rank(s), fewer than vocab_size {vocab_size}",
            path="$.logits",
            rule="shape",
        )
    return rank * vp, vp


def vocab_parallel_target_logprobs(
    logits: torch.Tensor,
    batch: PackedBatch,
    *,
    vocab_size: int,
    group: Any = None,
    temperature: float = 1.0,
    with_entropy: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """[K, L] log-probability of the batch's targets from this TP rank's logits shard, 0 off the loss mask.

    Args:
        logits: [K, L, Vp] this TP rank's vocabulary slice (``packed_forward``'s output).
        batch: the packed batch the logits were computed on.
        vocab_size: the model's unpadded vocabulary (``model.config.vocab_size`` of a
            :func:`~treepack.trainer.megatron.from_hf` model).
        group: the TP process group (``parallel_state.get_tensor_model_parallel_group()``);
            None for one rank holding the whole vocabulary.
        temperature: the logits are divided by it first.
        with_entropy: also return the entropy of that distribution at every scored position.

    Returns:
        [K, L] log-probabilities (and [K, L] entropies with ``with_entropy``), the same on
        every rank of the group.
    """
    check_temperature(temperature)
    start, vp = _check(logits, batch, vocab_size, group)
    K, L = batch.num_rows, batch.seq_len
    pos = torch.nonzero(batch.loss_mask.reshape(-1)).flatten()
    targets = batch.targets.reshape(-1)[pos]
    if targets.numel() and int(targets.max()) >= vocab_size:
        raise RequestError(
            f"target token {int(targets.max())} is outside the vocabulary of {vocab_size}",
            path="$.batch.targets",
            rule="range",
        )
    lp, ent = vocab_parallel_stats(
        logits.reshape(K * L, vp)[pos],
        targets,
        vocab_start=start,
        vocab_size=vocab_size,
        group=group,
        temperature=temperature,
        with_entropy=with_entropy,
    )

    def put(v: torch.Tensor) -> torch.Tensor:
        return torch.zeros(K * L, dtype=v.dtype, device=v.device).index_put((pos,), v).view(K, L)

    return put(lp) if ent is None else (put(lp), put(ent))


def naive_vocab_parallel_target_logprobs(
    logits: torch.Tensor,
    batch: PackedBatch,
    *,
    vocab_size: int,
    group: Any = None,
    temperature: float = 1.0,
    with_entropy: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Reference of :func:`vocab_parallel_target_logprobs`: all-gathers the vocabulary (no gradient
    through the other ranks' slices), drops the padding entries and runs the one-device log-softmax."""
    _check(logits, batch, vocab_size, group)
    parts = [logits]
    if group is not None and dist.get_world_size(group) > 1:
        parts = [torch.empty_like(logits) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, logits.detach().contiguous(), group=group)
        parts[dist.get_rank(group)] = logits
    full = torch.cat(parts, dim=-1)[..., :vocab_size]
    K, L, V = full.shape
    out_lp = torch.zeros(K * L, dtype=torch.float64 if full.dtype == torch.float64 else torch.float32)
    out_ent = torch.zeros_like(out_lp)
    flat, tg, mask = full.reshape(K * L, V), batch.targets.reshape(-1), batch.loss_mask.reshape(-1)
    lps, ents = [], []
    for i in range(K * L):
        if bool(mask[i]):
            lp, ent = target_stats(flat[i : i + 1], tg[i : i + 1], temperature, True)
            assert ent is not None
            lps.append((i, lp[0]))
            ents.append((i, ent[0]))
    lp_t = torch.stack([v for _, v in lps]) if lps else out_lp[:0]
    ent_t = torch.stack([v for _, v in ents]) if ents else out_ent[:0]
    idx = torch.tensor([i for i, _ in lps], dtype=torch.int64)
    lp_full = torch.zeros(K * L, dtype=lp_t.dtype).index_put((idx,), lp_t).view(K, L)
    if not with_entropy:
        return lp_full
    return lp_full, torch.zeros(K * L, dtype=ent_t.dtype).index_put((idx,), ent_t).view(K, L)
