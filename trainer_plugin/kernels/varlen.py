"""A varlen attention kernel for the CPU: :func:`varlen_attention`, ``flash_attn_varlen_func``'s signature.

The ``flash`` backend runs one varlen sequence per segment (queries = the segment, keys =
its ancestor chain, causal aligned bottom-right). :func:`~treepack.trainer.kernels.attention.naive_varlen_attention`
is the loop reference: one set of small ops per sequence, and each slice's backward
zero-fills a full-size gradient, so on a CPU its cost says more about the loop than about
the plan. This kernel gathers the sequences into buckets of similar (query, key) lengths
(each padded to at most ~25% more than its longest member, per dimension), runs one
batched ``scaled_dot_product_attention`` per bucket under a [b, 1, q, k] mask that holds
the causal alignment and the padding, and scatters the results back in one index pass.
Soft-capping and the log-sum-exp output (sinks) run the same buckets through plain
batched ops. Equal to the reference within float tolerance (tests compare them).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from treepack.proto.errors import RequestError

__all__ = ["varlen_attention", "length_buckets"]


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
