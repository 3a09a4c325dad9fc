"""Materialization: a plan plus the trainer's per-sequence data -> packed tensors (SPEC 7).

:func:`materialize` composes the floors of :mod:`treepack.trainer.data`: the token maps and
row tensors of :mod:`~treepack.trainer.data.rows` (index arithmetic in numpy over the plan's
segment table, then **one** vectorized gather of the token ids), the payloads of
:mod:`~treepack.trainer.data.payloads` (target-aligned per scored entry, token-aligned per
row position; one gather each), the images of :mod:`~treepack.trainer.data.images`, and
under context parallelism the shard of :mod:`~treepack.trainer.data.cp_shard`. Lazy
per-sequence inputs (a list-like whose ``__getitem__`` loads, or a callable ``s -> array``)
are only touched for the sequences of the materialized rows.

Unwritten slots are filled with NaN (floating), -1 (integer) or False (bool).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from treepack.proto.errors import RequestError
from treepack.proto.plan import Plan
from treepack.trainer.data.advice import warn_hidden_sharing, warn_no_sharing
from treepack.trainer.data.cp_shard import cp_shard
from treepack.trainer.data.images import batch_images
from treepack.trainer.data.packed_batch import PackedBatch
from treepack.trainer.data.payloads import pack_payloads
from treepack.trainer.data.rows import (
    RowIndex,
    check_row_tokens,
    check_shared_targets,
    row_index,
    row_tensors,
    scored_entries,
    token_ids,
)
from treepack.trainer.data.sequences import check_count, check_rows, plan_groups, plan_trainable
from treepack.trainer.kernels.index import index_tensor, scatter_filled

__all__ = ["materialize"]


def materialize(
    plan: Plan,
    sequences: Sequence[Any],
    payloads: Mapping[str, Any] | None = None,
    device: Any = None,
    *,
    trainable: Sequence[Any] | None = None,
    groups: Sequence[Any] | None = None,
    input_payloads: Mapping[str, Any] | None = None,
    rows: Any = None,
    pad_id: int = 0,
    check_tokens: bool = True,
    allow_empty_loss: bool = False,
    advise: bool = True,
    cp: Any = None,
    pixel_values: Sequence[Any] | None = None,
    image_grid_thw: Sequence[Any] | None = None,
    pixel_values_videos: Any = None,
) -> PackedBatch:
    """Build the packed tensors of ``plan`` (all rows, or the given ``rows``).

    Args:
        plan: the plan.
        sequences: the S planned sequences' token ids (list-like; only the sequences of
            the materialized rows are read), each of its submitted or placed length.
        payloads: target-aligned per-token arrays by name (:mod:`~treepack.trainer.data.payloads`).
        device: where the tensors live (default CPU).
        trainable: per sequence a bool array or a prompt length; default (None) the plan's
            flags (``plan.first_trainable`` / ``plan.trainable``: ``targets``, ``loss_mask``
            and the normalizations' counts). Given, they must equal the plan's.
        groups: per sequence an int/str/None; default (None) the plan's group codes (per-group
            normalization). Given, they must give the plan's groups.
        input_payloads: token-aligned per-token arrays by name (as ``payloads``).
        rows: [K] global rows to materialize, -1 for an empty padding row (a rank's
            ``plan.ranks.rank_rows[rank]``); default all rows.
        pad_id: token id at padding positions.
        check_tokens: verify that each materialized sequence read back from the rows is its
            tokens (one gather; catches sequences that differ from the planned ones in content).
        allow_empty_loss: accept a plan that scores no token (a forward only; by default
            refused: every loss would be a silent 0).
        advise: warn (:class:`~treepack.trainer.data.advice.TreepackWarning`) when the plan
            shares nothing, or when ``min_shared_len`` hides sharing (:mod:`~treepack.trainer.data.advice`).
        cp: a :class:`~treepack.trainer.kernels.cp.ContextParallel` group: this rank's shard
            of every row (plan with ``cp_size`` the group's size; see :class:`PackedBatch`).
        pixel_values: per sequence its image inputs as the HF processor gives them for it
            alone (None: no image), kept per distinct image in ``batch.images``
            (:mod:`~treepack.trainer.data.images`); plan with ``image_keys``.
        image_grid_thw: per sequence its ``[m, 3]`` image grids (Qwen-VL families), or None.
        pixel_values_videos: refused: video inputs have no tree path yet.

    Returns:
        The :class:`PackedBatch`.

    Raises:
        RequestError: (or a subclass) for inputs that do not match the plan, naming them.
    """
    dev = torch.device("cpu") if device is None else torch.device(device)
    _check_modes(plan, cp, pixel_values, pixel_values_videos)
    rows_arr, flags, counts, codes = _plan_inputs(plan, sequences, rows, trainable, groups, allow_empty_loss)
    ix = row_index(plan, rows_arr)
    tokens = token_ids(sequences, plan, ix, dev)
    if advise:
        warn_no_sharing(plan)
        warn_hidden_sharing(plan, tokens.cpu().numpy(), ix.ptr, ix.local_seqs)
    full = _whole_rows(
        plan,
        rows_arr,
        ix,
        tokens,
        flags,
        dev=dev,
        counts=counts,
        codes=codes,
        pad_id=pad_id,
        check_tokens=check_tokens,
        payloads=payloads,
        input_payloads=input_payloads,
        images=(pixel_values, image_grid_thw),
    )
    return full if cp is None else cp_shard(full, cp, pad_id)


def _check_modes(plan: Plan, cp: Any, pixel_values: Any, pixel_values_videos: Any) -> None:
    """Refuse a CP group that does not match the plan's split, videos, and images under CP."""
    if cp is not None and getattr(cp, "size", None) != plan.ranks.cp_size:
        raise RequestError(
            f"the plan splits rows over {plan.ranks.cp_size} context-parallel ranks, "
            f"the group has {getattr(cp, 'size', None)}: plan with cp_size equal to the CP group size",
            path="$.cp",
            rule="cp_size",
        )
    if cp is None and plan.ranks.cp_size > 1:
        raise RequestError(
            f"the plan splits rows over {plan.ranks.cp_size} context-parallel ranks: pass cp=ContextParallel(group)",
            path="$.cp",
            rule="cp_size",
        )
    if pixel_values_videos is not None:
        raise RequestError(
            "video inputs are not supported on tree rows (only images are)",
            path="$.pixel_values_videos",
            rule="unsupported",
        )
    if cp is not None and pixel_values is not None:
        raise RequestError(
            "image inputs are not supported under context parallelism", path="$.pixel_values", rule="unsupported"
        )


def _plan_inputs(
    plan: Plan, sequences: Sequence[Any], rows: Any, trainable: Any, groups: Any, allow_empty_loss: bool
) -> tuple[np.ndarray, Any, np.ndarray, np.ndarray]:
    """The per-sequence inputs checked against the plan.

    Args:
        plan, sequences, rows, trainable, groups, allow_empty_loss: as :func:`materialize`.

    Returns:
        ([K] int64 rows, ``flags(s)`` -> [seq_lens[s]] bool, [S] int64 scored entries per
        sequence, [S] int64 dense group codes).

    Raises:
        RequestError: a count, a row, flags or groups that do not match the plan, or a plan
            that scores no token without ``allow_empty_loss``.
    """
    check_count(sequences, plan.num_sequences)
    rows_arr = check_rows(rows, plan)
    flags, counts = plan_trainable(plan, trainable)
    if not allow_empty_loss and not counts.any():
        raise RequestError(
            "the plan scores no token (no sequence has a trainable token after its first): the loss mask would be "
            "empty and the loss silently 0; plan with trainable= (or pass allow_empty_loss=True for a forward only)",
            path="$.trainable",
            rule="empty_loss_mask",
        )
    return rows_arr, flags, counts, plan_groups(plan, groups)


def _whole_rows(
    plan: Plan,
    rows: np.ndarray,
    ix: RowIndex,
    tokens: torch.Tensor,
    flags: Any,
    *,
    dev: torch.device,
    counts: np.ndarray,
    codes: np.ndarray,
    pad_id: int,
    check_tokens: bool,
    payloads: Mapping[str, Any] | None,
    input_payloads: Mapping[str, Any] | None,
    images: tuple[Any, Any],
) -> PackedBatch:
    """The :class:`PackedBatch` of whole rows (before any CP shard).

    Args:
        plan: the plan.
        rows: [K] int64 global row of each local row (-1: an empty padding row).
        ix: the rows' :class:`~treepack.trainer.data.rows.RowIndex`.
        tokens: [ix.ptr[-1]] int64 token ids of the local sequences, concatenated.
        flags: ``flags(s)`` -> [seq_lens[s]] bool, the trainable flags (read by
            :func:`~treepack.trainer.data.rows.scored_entries`).
        dev: where the tensors live.
        counts: [S] scored entries of every sequence. codes: [S] dense group codes.
        pad_id, check_tokens, payloads, input_payloads: as :func:`materialize`.
        images: ``(pixel_values, image_grid_thw)`` as :func:`materialize` takes them.

    Returns:
        The batch, its loss positions and largest target already cached.
    """
    c_sel, seq_of_c = scored_entries(flags, ix)
    S, C, K = plan.num_sequences, plan.seq_len, rows.shape[0]
    size = K * C
    score_seq = ix.local_seqs[seq_of_c[c_sel]]
    score_flat = ix.seq_flat[c_sel]
    t = lambda a: index_tensor(a, dev)  # noqa: E731
    tok_flat, seq_flat, entry_src, score_flat_t = t(ix.tok_flat), t(ix.seq_flat), t(c_sel + 1), t(score_flat)
    gather_src = t(ix.gather_src)
    input_ids, position_ids, subtree_end = row_tensors(tokens, ix, tok_flat, gather_src, (K, C), pad_id)
    if check_tokens and tokens.shape[0]:
        check_row_tokens(input_ids, tokens, ix, seq_of_c, seq_flat)
    score_target = tokens[entry_src]
    check_shared_targets(score_flat, score_target, score_seq)
    loss_mask = torch.zeros(size, dtype=torch.bool, device=dev)
    loss_mask[score_flat_t] = True
    index = dict(
        entry_src=entry_src, score_flat=score_flat_t, tok_flat=tok_flat, gather_src=gather_src, seq_flat=seq_flat
    )
    packed, entries = pack_payloads(plan, ix, payloads, input_payloads, index, (K, C), dev)
    full = PackedBatch(
        plan=plan,
        rows=rows,
        input_ids=input_ids.view(K, C),
        position_ids=position_ids.view(K, C),
        subtree_end=subtree_end.view(K, C),
        targets=scatter_filled(score_target, score_flat_t, size).view(K, C),
        loss_mask=loss_mask.view(K, C),
        owner=scatter_filled(t(score_seq), score_flat_t, size).view(K, C),
        payloads=packed,
        entry_payloads=entries,
        local_seqs=ix.local_seqs,
        seq_ptr=ix.ptr,
        seq_flat=seq_flat,
        score_seq=t(score_seq),
        score_pos=t(c_sel - ix.ptr[seq_of_c[c_sel]] + 1),
        score_flat=score_flat_t,
        score_target=score_target,
        score_counts=t(counts),
        groups=t(codes),
        device=dev,
        images=batch_images(*images, ix.local_seqs, S, dev),
    )
    # What the losses read, prepared here so that the forward and backward never wait on
    # the device: the scored positions from the host's index, the largest target now.
    full._cache["loss_positions"] = t(np.unique(score_flat))
    full._cache["max_target"] = int(score_target.max()) if score_target.numel() else -1
    return full
