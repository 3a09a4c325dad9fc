"""Per-position outputs of a packed batch read back per sequence: value heads and reward scores.

A head that is not a language model head gives one output per row position: a
token-classification head (the usual PPO value head, ``num_labels=1``) or the score module
of a sequence-classification head (a reward model). On tree rows every token of every
sequence sits at exactly one row position (the plan's no-data-loss invariant), and a shared
position's output is the same for every sharer (causal attention sees the same prefix), so:

- :func:`token_values`: each sequence's outputs at its own tokens, in order (what the
  sequence alone gives at every position);
- :func:`last_token_positions`: the row position each sequence is pooled at by HF's
  sequence-classification rule applied to the sequence alone: its last token that is not
  ``pad_token_id`` (position 0 when every token is the pad id, as HF's ``argmax`` gives),
  or its last token when no pad id is set; :func:`naive_last_token` is the loop reference.

Both read :class:`~treepack.trainer.data.packed_batch.PackedBatch`'s token map
(``local_seqs``, ``seq_ptr``, ``seq_flat``) of whole rows (a context-parallel shard's heads are
refused by the admission).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

__all__ = ["token_values", "last_token_positions", "naive_last_token"]


def token_values(batch: Any, x: torch.Tensor) -> list[torch.Tensor | None]:
    """Each local sequence's per-position outputs, at its own tokens in order.

    Args:
        batch: a whole-row :class:`~treepack.trainer.data.packed_batch.PackedBatch`.
        x: [K, L, ...] per-position outputs of its rows.

    Returns:
        S entries (the plan's sequences): a [len(s), ...] tensor for a sequence of these
        rows (differentiable), None for one not materialized here.
    """
    K, L = batch.num_rows, batch.seq_len
    flat = x.reshape(K * L, *x.shape[2:])
    cat = flat.index_select(0, batch.seq_flat.to(x.device))
    parts = torch.split(cat, np.diff(batch.seq_ptr).tolist())
    out: list[torch.Tensor | None] = [None] * batch.plan.num_sequences
    for s, p in zip(batch.local_seqs.tolist(), parts):
        out[s] = p
    return out


def last_token_positions(batch: Any, pad_token_id: int | None) -> torch.Tensor:
    """[S_local] int64 flat row position (``row * L + index``) of each local sequence's pooled token.

    Args:
        batch: a whole-row :class:`~treepack.trainer.data.packed_batch.PackedBatch`.
        pad_token_id: the model's pad id (None: every sequence is pooled at its last token).

    Returns:
        One position per sequence of ``batch.local_seqs``, in that order (:func:`naive_last_token`
        gives the index within the sequence).
    """
    flat_pos = batch.seq_flat
    ptr = torch.from_numpy(batch.seq_ptr).to(flat_pos.device)
    lens = ptr[1:] - ptr[:-1]
    if pad_token_id is None:
        return flat_pos[ptr[1:] - 1]
    ids = batch.input_ids.reshape(-1).index_select(0, flat_pos)
    seg = torch.repeat_interleave(torch.arange(lens.shape[0], device=flat_pos.device), lens)
    within = torch.arange(flat_pos.shape[0], device=flat_pos.device) - ptr[:-1][seg]
    # HF: argmax of index * (token != pad); all-pad gives 0.
    score = torch.where(ids != pad_token_id, within, torch.zeros_like(within))
    last = torch.zeros(lens.shape[0], dtype=torch.int64, device=flat_pos.device).scatter_reduce(
        0, seg, score, reduce="amax", include_self=True
    )
    return flat_pos[ptr[:-1] + last]


def naive_last_token(sequence: Sequence[int] | np.ndarray, pad_token_id: int | None) -> int:
    """The index, within ``sequence`` alone, that HF's sequence classification pools at (loop reference).

    Args:
        sequence: the token ids.
        pad_token_id: the model's pad id, or None.

    Returns:
        The last index whose token is not ``pad_token_id`` (0 when there is none), or the
        last index when ``pad_token_id`` is None.
    """
    n = len(sequence)
    if pad_token_id is None:
        return n - 1
    for i in range(n - 1, -1, -1):
        if int(sequence[i]) != pad_token_id:
            return i
    return 0
