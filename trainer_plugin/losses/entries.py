"""What every loss reads of a packed batch's scored entries: normalization weights and inputs.

:func:`entry_weights` is the weight of each scored entry under a normalization (``token``,
``sequence``, ``group``, ``sum`` or a constant; :mod:`treepack.trainer.losses`), counted over
every sequence of the plan; :func:`entry_values` reads a per-entry input (a payload name, a
[S] or [K, L] tensor, a number); :func:`entry_logprobs` gathers each entry's log-probability
from the position that predicts its token; :func:`position_sum` folds entries back onto
positions.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from treepack.proto.errors import InputTypeError, RequestError

if TYPE_CHECKING:
    from treepack.trainer.data.packed_batch import PackedBatch

__all__ = ["NORMALIZATIONS", "entry_weights", "entry_values", "position_sum", "entry_logprobs", "entries_like"]

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
    """[T] float64 normalization weight of every scored entry (:mod:`treepack.trainer.losses`)."""
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
            f"logprobs must have shape [{batch.num_rows}, {batch.seq_len}] (or logits [K, L, V]), "
            f"got {tuple(logprobs.shape)}",
            path="$.logprobs",
            rule="shape",
        )
    return logprobs.reshape(-1)[batch.score_flat]


def entries_like(batch: PackedBatch, x: Any, *, what: str, like: torch.Tensor) -> torch.Tensor:
    """[T] per-entry values of ``x`` in ``like``'s dtype."""
    return entry_values(batch, x, what=what).to(like.dtype)
