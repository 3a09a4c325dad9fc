"""Log-probabilities of a packed batch's targets: from logits, or from hidden states in chunks.

:func:`target_stats` is the log-softmax at the targets (and the entropy) of one block of
logits; :func:`chunked_target_stats` runs an output head and it ``chunk_size`` positions at a
time under activation checkpointing, so at most one chunk's logits exist at once. The
:class:`~treepack.trainer.data.packed_batch.PackedBatch` methods ``target_logprobs`` and
``target_logprobs_from_hidden`` read them.
"""

from __future__ import annotations

from typing import Any

import torch

from treepack.proto.errors import RequestError

__all__ = ["check_temperature", "target_stats", "chunked_target_stats"]


def check_temperature(temperature: float) -> None:
    """Refuse a temperature that is not a finite number > 0 (``RequestError``, rule ``range``)."""
    if (
        isinstance(temperature, bool)
        or not isinstance(temperature, (int, float))
        or not temperature > 0
        or temperature == float("inf")
    ):
        raise RequestError(
            f"temperature must be a finite number > 0, got {temperature!r}", path="$.temperature", rule="range"
        )


def target_stats(
    logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0, with_entropy: bool = False
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """([n] log-softmax of [n, V] ``logits / temperature`` at ``targets``, [n] entropies or None).

    Half precision is lifted to float32 first.
    """
    x = logits.float() if logits.dtype in (torch.float16, torch.bfloat16) else logits
    if temperature != 1.0:
        x = x / temperature
    lse = torch.logsumexp(x, dim=-1)
    lp = x.gather(1, targets[:, None]).squeeze(1) - lse
    if not with_entropy:
        return lp, None
    logp = x - lse[:, None]
    return lp, -(logp.exp() * logp).sum(-1)


def chunked_target_stats(
    flat: torch.Tensor,
    targets: torch.Tensor,
    pos: torch.Tensor,
    head: Any,
    chunk_size: int,
    *,
    temperature: float = 1.0,
    with_entropy: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """:func:`target_stats` of ``head(flat[pos])``, ``chunk_size`` positions at a time.

    Each chunk runs under activation checkpointing while gradients are on, so at most one
    chunk's logits exist at once (forward or backward).

    Args:
        flat: [N, d] hidden states.
        targets: [N] int64 the token each position predicts.
        pos: [U] int64 the positions to score.
        head: callable [n, d] -> [n, V] (logits).
        chunk_size: positions per chunk (>= 1).
        temperature: the logits are divided by it first.
        with_entropy: also return the entropies.

    Returns:
        ([U] float log-probabilities, [U] entropies or None).
    """
    from torch.utils.checkpoint import checkpoint

    def fn(h: torch.Tensor, t: torch.Tensor) -> tuple[torch.Tensor, ...]:
        lp, ent = target_stats(head(h), t, temperature, with_entropy)
        return (lp,) if ent is None else (lp, ent)

    parts = []
    for a in range(0, int(pos.shape[0]), chunk_size):
        p = pos[a : a + chunk_size]
        parts.append(
            checkpoint(fn, flat[p], targets[p], use_reentrant=False)
            if torch.is_grad_enabled()
            else fn(flat[p], targets[p])
        )
    empty = flat.new_zeros(0, dtype=torch.float32)
    lp = torch.cat([x[0] for x in parts]) if parts else empty
    ent = (torch.cat([x[1] for x in parts]) if parts else empty) if with_entropy else None
    return lp, ent
