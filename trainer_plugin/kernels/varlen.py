"""A varlen attention kernel for the CPU: :func:`varlen_attention`, ``flash_attn_varlen_func``'s signature.

The ``flash`` backend's gathered layout runs one varlen sequence per segment (queries = the
segment, keys = its ancestor chain, causal aligned bottom-right).
:func:`~treepack.trainer.kernels.attention.naive_varlen_attention` is the loop reference: one
set of small ops per sequence, and each slice's backward zero-fills a full-size gradient, so
on a CPU its cost says more about the loop than about the plan. This kernel gathers the
sequences into buckets of similar (query, key) lengths (each padded to at most ~25% more
than its longest member, per dimension), runs one batched ``scaled_dot_product_attention``
per bucket under a [b, 1, q, k] mask that holds the causal alignment and the padding, and
scatters the results back in one index pass. Soft-capping and the log-sum-exp output
(sinks) run the same buckets through plain batched ops. Equal to the reference within
float tolerance (tests compare them).

The copy-free layout (:mod:`~treepack.trainer.kernels.varlen_merge`) runs the same buckets
as a split pair, :data:`CPU_SPLIT` (registered as this kernel's): :func:`split_forward`
returns the LSE (PyTorch's CPU flash kernel, ``_scaled_dot_product_flash_attention_for_cpu``,
per bucket; plain ops under a soft-cap) and :func:`split_backward` runs that kernel's
backward from the merged output and LSE it is given.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from treepack.proto.errors import RequestError
from treepack.trainer.kernels.varlen_merge import SplitVarlen, register_split

__all__ = ["varlen_attention", "length_buckets", "split_forward", "split_backward", "CPU_SPLIT"]


def _size_class(n: np.ndarray) -> np.ndarray:
    """Round each length up to a multiple of 2**(floor(log2 n) - 2): at most 25% padding."""
    n = np.maximum(n, 1)
    step = np.maximum(1, 2 ** np.maximum(np.floor(np.log2(n)).astype(np.int64) - 2, 0))
    return -(-n // step) * step


def length_buckets(nq: np.ndarray, nk: np.ndarray) -> list[tuple[np.ndarray, int, int]]:
    """Group sequences of similar lengths: [(members, padded queries, padded keys)].

    Args:
        nq, nk: [N] int64 query and key counts of each sequence.
    """
    cq, ck = _size_class(nq), _size_class(nk)
    keys = ck * (int(cq.max(initial=1)) + 1) + cq
    order = np.argsort(keys, kind="stable")
    bounds = np.flatnonzero(np.diff(keys[order])) + 1
    return [(m, int(nq[m].max()), int(nk[m].max())) for m in np.split(order, bounds) if m.size]


def _bucket_mask(
    nq: np.ndarray, nk: np.ndarray, Q: int, K: int, causal: bool, window_size: tuple[int, int]
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Which (query, key) pairs a bucket computes.

    Args:
        nq, nk: [b] query and key counts of the bucket's members. Q, K: their padded counts.
        causal, window_size: as :func:`varlen_attention`.

    Returns:
        (q_ok [b, Q] real queries, k_ok [b, K] real keys, ok [b, Q, K] the visible pairs).
    """
    left, right = window_size
    a = np.arange(Q)
    b_ = np.arange(K)
    q_ok = a[None, :] < nq[:, None]  # [b, Q]
    k_ok = b_[None, :] < nk[:, None]  # [b, K]
    # Query a of a member sits at key index nk - nq + a (bottom-right alignment).
    at = (nk - nq)[:, None, None] + a[None, :, None]  # [b, Q, 1]
    j = b_[None, None, :]
    ok = k_ok[:, None, :] & q_ok[:, :, None]
    if causal:
        ok &= j <= at
    elif right >= 0:
        ok &= j <= at + right
    if left >= 0:
        ok &= j >= at - left
    # A padding query (or a query that sees nothing) gets one key so the softmax is finite; it is dropped.
    ok[:, :, 0] |= ~ok.any(-1)
    return q_ok, k_ok, ok


def _bucket_attention(
    qb: torch.Tensor,
    kb: torch.Tensor,
    vb: torch.Tensor,
    mask: torch.Tensor,
    scale: float,
    softcap: float,
    plain: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One bucket's attention: sdpa, or (soft-capping, log-sum-exp) plain batched ops.

    Args:
        qb: [b, H, Q, D]; kb, vb: [b, H, K, D|Dv]; mask: [b, 1, Q, K] bool.

    Returns:
        (out [b, H, Q, Dv], lse [H, b, Q] float32 or None without ``plain``).
    """
    if not plain:
        return F.scaled_dot_product_attention(qb, kb, vb, attn_mask=mask, scale=scale), None
    s = torch.matmul(qb, kb.transpose(-1, -2)) * scale
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    s = s.float().masked_fill(~mask, -math.inf)
    p = torch.softmax(s, dim=-1).to(vb.dtype)
    return torch.matmul(p, vb), torch.logsumexp(s, dim=-1).transpose(0, 1)


def varlen_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    return_attn_probs: bool = False,
    **unused: Any,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor, None]:
    """Batched varlen attention (module docstring); arguments and results as
    :func:`~treepack.trainer.kernels.attention.naive_varlen_attention`.

    Args:
        q: [Tq, H, D]; k: [Tk, Hkv, D]; v: [Tk, Hkv, Dv] (H a multiple of Hkv).
        cu_seqlens_q, cu_seqlens_k: [N+1] int32 from 0.

    Returns:
        [Tq, H, Dv], or (that, lse [H, Tq] float32, None).
    """
    if dropout_p:
        raise RequestError("varlen_attention has no dropout", path="$.dropout_p", rule="unsupported")
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else float(softmax_scale)
    H, Hkv = q.shape[1], k.shape[1]
    cq = cu_seqlens_q.detach().cpu().numpy().astype(np.int64)
    ck = cu_seqlens_k.detach().cpu().numpy().astype(np.int64)
    nq, nk = np.diff(cq), np.diff(ck)
    if nq.size and (nq.max() > max_seqlen_q or nk.max() > max_seqlen_k):
        raise RequestError("max_seqlen smaller than a sequence", path="$.max_seqlen_q", rule="range")
    plain = bool(softcap) or return_attn_probs
    q_pos, outs, lses = [], [], []
    dev = q.device
    for members, Q, K in length_buckets(nq, nk):
        a = np.arange(Q)
        q_ok, k_ok, ok = _bucket_mask(nq[members], nk[members], Q, K, causal, window_size)
        qi = torch.as_tensor(np.where(q_ok, cq[members, None] + a, 0), device=dev)
        ki = torch.as_tensor(np.where(k_ok, ck[members, None] + np.arange(K), 0), device=dev)
        mask = torch.as_tensor(ok, device=dev)[:, None]  # [b, 1, Q, K]
        qb = q[qi].transpose(1, 2)  # [b, H, Q, D]
        kb, vb = k[ki].transpose(1, 2), v[ki].transpose(1, 2)
        if H != Hkv:
            kb, vb = kb.repeat_interleave(H // Hkv, 1), vb.repeat_interleave(H // Hkv, 1)
        ob, lse = _bucket_attention(qb, kb, vb, mask, scale, softcap, plain)
        keep = torch.as_tensor(q_ok, device=dev)
        if lse is not None:
            lses.append(lse[:, keep])  # [H, n]
        outs.append(ob.transpose(1, 2)[keep])  # [n, H, Dv], members' real queries in order
        q_pos.append((cq[members, None] + a)[q_ok])
    if not outs:
        out = q.new_zeros(0, H, v.shape[-1])
        return (out, q.new_zeros(H, 0, dtype=torch.float32), None) if return_attn_probs else out
    where = np.concatenate(q_pos)
    inv = torch.as_tensor(np.argsort(where, kind="stable"), device=dev)
    out = torch.cat(outs)[inv]
    if not return_attn_probs:
        return out
    return out, torch.cat(lses, dim=1)[:, inv], None


def _bucket_rows(cq: np.ndarray, ck: np.ndarray, members: np.ndarray, Q: int, K: int, causal: bool, dev: Any):
    """Index tensors of one bucket: (q rows [b, Q], k rows [b, K], q_ok, k_ok, additive-mask maker).

    Padding slots index row 0 and are masked (keys) or zeroed and dropped (queries).
    """
    nq, nk = np.diff(cq)[members], np.diff(ck)[members]
    q_ok, k_ok, ok = _bucket_mask(nq, nk, Q, K, causal, (-1, -1))
    qi = torch.as_tensor(np.where(q_ok, cq[members, None] + np.arange(Q), 0), device=dev)
    ki = torch.as_tensor(np.where(k_ok, ck[members, None] + np.arange(K), 0), device=dev)
    return qi, ki, torch.as_tensor(q_ok, device=dev), torch.as_tensor(k_ok, device=dev), torch.as_tensor(ok, device=dev)


def _live_buckets(cu_q: torch.Tensor, cu_k: torch.Tensor) -> tuple[np.ndarray, np.ndarray, list]:
    """(cq, ck, buckets of the sequences that have queries and keys) for a split call."""
    cq = cu_q.detach().cpu().numpy().astype(np.int64)
    ck = cu_k.detach().cpu().numpy().astype(np.int64)
    nq, nk = np.diff(cq), np.diff(ck)
    live = np.flatnonzero((nq > 0) & (nk > 0))
    return cq, ck, [(live[m], Q, K) for m, Q, K in length_buckets(nq[live], nk[live])]


def _gathered(x: torch.Tensor, idx: torch.Tensor, ok: torch.Tensor, n_rep: int = 1) -> torch.Tensor:
    """x [T, h, d] rows idx [b, n] -> [b, h * n_rep, n, d], zero where not ok."""
    g = torch.where(ok[..., None, None], x[idx], 0).transpose(1, 2)
    return g.repeat_interleave(n_rep, 1) if n_rep > 1 else g


def _plain_scores(qb, kb, scale, softcap, ok):
    wide = torch.promote_types(qb.dtype, torch.float32)
    s = torch.matmul(qb.to(wide), kb.to(wide).transpose(-1, -2)) * scale
    t = None
    if softcap:
        t = torch.tanh(s / softcap)
        s = softcap * t
    return s.masked_fill(~ok[:, None], -math.inf), t


def split_forward(q, k, v, cu_q, cu_k, max_q, max_k, scale, causal, softcap):
    """Forward of the batched CPU pair (:mod:`~treepack.trainer.kernels.varlen_merge` contract):
    per bucket, PyTorch's CPU flash kernel (``_scaled_dot_product_flash_attention_for_cpu``,
    which returns the LSE), or plain ops under a soft-cap."""
    H, n_rep = q.shape[1], q.shape[1] // k.shape[1]
    wide = torch.promote_types(q.dtype, torch.float32)
    out = torch.zeros(q.shape[0], H, v.shape[-1], dtype=q.dtype, device=q.device)
    lse = torch.full((H, q.shape[0]), -math.inf, dtype=wide, device=q.device)
    cq, ck, buckets = _live_buckets(cu_q, cu_k)
    for members, Q, K in buckets:
        qi, ki, q_ok, k_ok, ok = _bucket_rows(cq, ck, members, Q, K, causal, q.device)
        qb, kb, vb = _gathered(q, qi, q_ok), _gathered(k, ki, k_ok, n_rep), _gathered(v, ki, k_ok, n_rep)
        if softcap:
            s, _ = _plain_scores(qb, kb, scale, softcap, ok)
            lb = torch.logsumexp(s, -1)
            ob = torch.matmul(torch.exp(s - lb[..., None]), vb.to(wide)).to(q.dtype)
        else:
            mask = torch.zeros(ok.shape, dtype=q.dtype, device=q.device).masked_fill(~ok, -math.inf)[:, None]
            ob, lb = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(qb, kb, vb, attn_mask=mask, scale=scale)
        out[qi[q_ok]] = ob.transpose(1, 2)[q_ok]
        lse[:, qi[q_ok]] = lb.to(wide).permute(1, 0, 2)[:, q_ok]
    return out, lse


def split_backward(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, scale, causal, softcap):
    """Backward of the batched CPU pair from the output and LSE it is given (the merged ones)."""
    H, Hkv = q.shape[1], k.shape[1]
    n_rep = H // Hkv
    wide = torch.promote_types(q.dtype, torch.float32)
    dq = torch.zeros(q.shape, dtype=wide, device=q.device)
    dk = torch.zeros(k.shape, dtype=wide, device=q.device)
    dv = torch.zeros(v.shape, dtype=wide, device=q.device)
    cq, ck, buckets = _live_buckets(cu_q, cu_k)
    for members, Q, K in buckets:
        qi, ki, q_ok, k_ok, ok = _bucket_rows(cq, ck, members, Q, K, causal, q.device)
        qb, kb, vb = _gathered(q, qi, q_ok), _gathered(k, ki, k_ok, n_rep), _gathered(v, ki, k_ok, n_rep)
        dob, ob = _gathered(dout, qi, q_ok), _gathered(out, qi, q_ok)
        # Padding query slots: q = dout = out = 0 and lse 0, so their one visible key gets P = 1, dS = 0.
        lb = torch.where(q_ok[:, None], lse[:, qi].permute(1, 0, 2), 0).to(wide).contiguous()
        if softcap:
            s, t = _plain_scores(qb, kb, scale, softcap, ok)
            p = torch.exp(s - lb[..., None])
            dvb = torch.matmul(p.transpose(-1, -2), dob.to(wide))
            ds = p * (
                torch.matmul(dob.to(wide), vb.to(wide).transpose(-1, -2))
                - (dob.to(wide) * ob.to(wide)).sum(-1)[..., None]
            )
            ds = ds * (1 - t * t)
            dqb, dkb = torch.matmul(ds, kb.to(wide)) * scale, torch.matmul(ds.transpose(-1, -2), qb.to(wide)) * scale
        else:
            mask = torch.zeros(ok.shape, dtype=q.dtype, device=q.device).masked_fill(~ok, -math.inf)[:, None]
            dqb, dkb, dvb = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
                dob, qb, kb, vb, ob, lb, 0.0, False, attn_mask=mask, scale=scale
            )
        b = dkb.shape[0]
        fold = lambda g: g.reshape(b, Hkv, n_rep, *g.shape[2:]).sum(2) if n_rep > 1 else g  # noqa: E731
        dq.index_add_(0, qi[q_ok], dqb.to(wide).transpose(1, 2)[q_ok])
        dk.index_add_(0, ki[k_ok], fold(dkb.to(wide)).transpose(1, 2)[k_ok])
        dv.index_add_(0, ki[k_ok], fold(dvb.to(wide)).transpose(1, 2)[k_ok])
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


#: The batched CPU pair, registered as :func:`varlen_attention`'s.
CPU_SPLIT = SplitVarlen(forward=split_forward, backward=split_backward, name="cpu")
register_split(varlen_attention, CPU_SPLIT)
