"""All-gather K/V tree attention under context parallelism (Llama-3-style CP).

Each CP rank keeps the queries of its shard; keys and values are all-gathered over the
group (:func:`~treepack.trainer.kernels.cp.gather_seq`, backward a reduce-scatter), in rank
order, and each local query attends the gathered keys its tree mask allows. Softmax does
not depend on the order of the keys, so they are never put back in row order: the mask
is evaluated on row positions instead, query i at ``qpos[i]`` (this rank's shard of the
row) and key j at ``kpos[j]`` (every rank's shard, in rank order), with the contract of
:mod:`~treepack.trainer.kernels.masks` (``j <= i < subtree_end[j]``, windows and chunks on
``position_ids``) over the row padded to ``cp * shard_len`` (padding sees itself).

Unlike Ulysses this runs with any head count (nothing is split by heads), and it runs on
whatever split the plan made: the all-gather plan splits rows into 16-token tiles, held
in a few runs per rank and balanced by attention work (``Ranks.cp_tiles``), so a shard's
positions need not be contiguous.

Per backend, the mask in that kernel's form, over [shard_len] queries x [cp * shard_len] keys:

- ``sdpa``: :func:`cp_dense_mask` ([K, 1, Ls, cp*Ls] bool; reference: the whole padded
  row's :func:`~treepack.trainer.kernels.masks.dense_mask` at those rows and columns);
- ``flex``: :func:`cp_block_mask`, FlexAttention's ``create_block_mask`` over a
  ``mask_mod`` that reads the positions (every pair evaluated once when built);
- ``flash``: :func:`cp_varlen_meta`, the whole rows' varlen sequences cut to runs of this
  rank's queries; a run keeps its sequence's keys up to its last query, so causal
  attention aligned bottom-right stays the tree mask.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from treepack.proto.index import ragged_arange
from treepack.trainer.kernels.attention import _flash, _flex, _sdpa
from treepack.trainer.kernels.cp import gather_seq
from treepack.trainer.kernels.masks import VarlenMeta, _meta, tree_mask_mod

__all__ = ["allgather_attention", "shard_mask", "cp_dense_mask", "cp_block_mask", "cp_varlen_meta", "padded_rows"]


def padded_rows(
    subtree_end: torch.Tensor, position_ids: torch.Tensor, length: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Whole-row ``subtree_end`` and ``position_ids`` [K, C] padded to [K, length]: a padding
    position sees only itself (subtree end i + 1), at position id 0."""
    K, C = subtree_end.shape
    dev = subtree_end.device
    se = torch.cat([subtree_end, torch.arange(C + 1, length + 1, device=dev).repeat(K, 1)], dim=1)
    pos = torch.cat([position_ids, position_ids.new_zeros(K, length - C)], dim=1)
    return se, pos


def cp_dense_mask(
    subtree_end: torch.Tensor,
    position_ids: torch.Tensor,
    qpos: torch.Tensor,
    kpos: torch.Tensor,
    sliding_window: int | None = None,
    chunk_size: int | None = None,
) -> torch.Tensor:
    """[K, 1, Lq, Lk] bool: may the query at row position ``qpos[k, i]`` see the key at
    ``kpos[k, j]`` (the mask contract, module docstring).

    Args:
        subtree_end, position_ids: [K, Lp] the padded rows (:func:`padded_rows`).
        qpos: [K, Lq] int64 row positions of the queries. kpos: [K, Lk] of the keys.
        sliding_window, chunk_size: as :func:`~treepack.trainer.kernels.masks.dense_mask`.
    """
    i, j = qpos[:, :, None], kpos[:, None, :]
    m = (j <= i) & (i < subtree_end.gather(1, kpos)[:, None, :])
    if sliding_window is not None or chunk_size is not None:
        pq, pk = position_ids.gather(1, qpos), position_ids.gather(1, kpos)
        if sliding_window is not None:
            m &= (pq[:, :, None] - pk[:, None, :]) < sliding_window
        if chunk_size is not None:
            m &= (pq // chunk_size)[:, :, None] == (pk // chunk_size)[:, None, :]
    return m[:, None]


def cp_block_mask(
    subtree_end: torch.Tensor,
    position_ids: torch.Tensor,
    qpos: torch.Tensor,
    kpos: torch.Tensor,
    sliding_window: int | None = None,
    chunk_size: int | None = None,
    block_size: int = 128,
) -> Any:
    """FlexAttention ``BlockMask`` of :func:`cp_dense_mask` (same arguments)."""
    from torch.nn.attention.flex_attention import create_block_mask

    on_rows = tree_mask_mod(subtree_end, position_ids, sliding_window, chunk_size)

    def mask_mod(b, h, q_idx, kv_idx):
        return on_rows(b, h, qpos[b, q_idx], kpos[b, kv_idx])  # the contract on row positions

    K, Lq = qpos.shape
    return create_block_mask(mask_mod, K, None, Lq, kpos.shape[1], device=qpos.device, BLOCK_SIZE=block_size)


def cp_varlen_meta(
    meta: VarlenMeta, seq_len: int, qpos: np.ndarray, kpos: np.ndarray, device: Any = None
) -> VarlenMeta:
    """The whole rows' varlen metadata cut to this rank's queries (module docstring).

    Args:
        meta: :class:`VarlenMeta` of the whole rows (flat positions in [K * seq_len]).
        seq_len: C, the whole rows' length.
        qpos: [K, Lq] int64 row positions of this rank's queries.
        kpos: [K, Lk] int64 row positions of the gathered keys.
        device: where the index tensors go.

    Returns:
        :class:`VarlenMeta` with queries flat in [K * Lq] and keys flat in [K * Lk];
        ``pad_index`` the local positions no run holds (padding: they see themselves).
    """
    K, Lq = qpos.shape
    Lk = kpos.shape[1]
    Lp = max(int(qpos.max(initial=0)), int(kpos.max(initial=0)), seq_len - 1) + 1
    rows = np.arange(K)[:, None]
    qcol = np.full((K, Lp), -1, dtype=np.int64)
    qcol[rows, qpos] = np.arange(Lq)
    kcol = np.full((K, Lp), -1, dtype=np.int64)
    kcol[rows, kpos] = np.arange(Lk)
    qi, ki = meta.q_index.cpu().numpy(), meta.k_index.cpu().numpy()
    cu_q, cu_k = meta.cu_seqlens_q.cpu().numpy().astype(np.int64), meta.cu_seqlens_k.cpu().numpy().astype(np.int64)
    qlen, klen = np.diff(cu_q), np.diff(cu_k)
    loc = qcol[qi // seq_len, qi % seq_len]
    local = loc >= 0
    sid = np.repeat(np.arange(qlen.shape[0]), qlen)
    rel = ragged_arange(qlen)
    # A run: consecutive local queries of one varlen sequence.
    prev_local = np.concatenate([[False], local[:-1]])
    prev_sid = np.concatenate([[-1], sid[:-1]])
    start = local & (~prev_local | (sid != prev_sid))
    run_of = np.cumsum(start) - 1
    starts = np.flatnonzero(start)
    nq = np.bincount(run_of[local], minlength=starts.shape[0])
    b = sid[starts]
    end = rel[starts] + nq  # one past the run's last query, within its sequence
    nk = klen[b] - qlen[b] + end
    q_flat = (qi[local] // seq_len) * Lq + loc[local]
    kk = ki[np.repeat(cu_k[b], nk) + ragged_arange(nk)]
    k_flat = (kk // seq_len) * Lk + kcol[kk // seq_len, kk % seq_len]
    assert np.all(kcol[kk // seq_len, kk % seq_len] >= 0), "a key position is held by no rank"
    return _meta(K * Lq, device, meta.segments[b], q_flat, k_flat, nq, nk)


def _positions(batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """(qpos [K, Ls] this rank's row positions, kpos [K, cp*Ls] every rank's, in rank order)."""
    pos = batch.cp_positions
    return pos[batch.cp.rank], pos.permute(1, 0, 2).reshape(pos.shape[1], -1)


def _padded(batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
    if "cp_padded_rows" not in batch._cache:
        full = batch.cp_full
        batch._cache["cp_padded_rows"] = padded_rows(full.subtree_end, full.position_ids, batch.cp.size * batch.seq_len)
    return batch._cache["cp_padded_rows"]


def shard_mask(batch: Any, backend: str, sliding_window: int | None = None, chunk_size: int | None = None) -> Any:
    """The all-gather mask of CP shard ``batch`` in ``backend``'s form (cached on the batch):
    [K, 1, Ls, cp*Ls] bool (``sdpa``), a ``BlockMask`` (``flex``), or None for ``flash``
    (whose :class:`VarlenMeta` is built and cached all the same)."""
    m = _mask_of(batch, backend, sliding_window, chunk_size)
    return None if backend == "flash" else m


def _mask_of(batch: Any, backend: str, sliding_window: int | None, chunk_size: int | None) -> Any:
    key = ("cp_mask", backend, sliding_window, chunk_size)
    if key not in batch._cache:
        qpos, kpos = _positions(batch)
        m: Any  # by backend: a VarlenMeta (flash), a dense bool mask (sdpa) or a BlockMask (flex)
        if backend == "flash":
            full = batch.cp_full
            m = cp_varlen_meta(
                full.varlen_meta(chunk_size=chunk_size),
                full.plan.seq_len,
                qpos.cpu().numpy(),
                kpos.cpu().numpy(),
                batch.device,
            )
        else:
            se, pos = _padded(batch)
            build = cp_dense_mask if backend == "sdpa" else cp_block_mask
            m = build(se, pos, qpos, kpos, sliding_window, chunk_size)
        batch._cache[key] = m
    return batch._cache[key]


def allgather_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    batch: Any,
    *,
    backend: str = "sdpa",
    scale: float | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    varlen_fn: Callable | None = None,
    compile: bool | None = None,
    sinks: torch.Tensor | None = None,
    chunk_size: int | None = None,
) -> torch.Tensor:
    """Tree attention of one CP shard's queries over keys and values gathered from the group.

    Args:
        q: [K, H, Ls, D] this rank's queries; k, v: [K, Hkv, Ls, D] its keys and values.
        batch: the rank's CP shard (``PackedBatch`` with ``cp``, ``cp_full``, ``cp_positions``).
        backend, scale, sliding_window, softcap, varlen_fn, compile, sinks, chunk_size: as
            :func:`~treepack.trainer.kernels.attention.tree_attention`.

    Returns:
        [K, H, Ls, Dv] the output at this rank's queries.
    """
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    kg = gather_seq(k.transpose(1, 2), batch.cp).transpose(1, 2)
    vg = gather_seq(v.transpose(1, 2), batch.cp).transpose(1, 2)
    mask = _mask_of(batch, backend, sliding_window, chunk_size)
    if backend == "sdpa":
        return _sdpa(q, kg, vg, mask, scale, softcap, sinks)
    if backend == "flex":
        return _flex(q, kg, vg, mask, scale, softcap, compile, sinks)
    return _flash(q, kg, vg, mask, scale, sliding_window, softcap, varlen_fn, sinks, k_self=k, v_self=v)
