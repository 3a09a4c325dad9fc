"""Pure-torch stand-ins of flash-attn's private varlen pair, with its signatures and conventions.

``_flash_attn_varlen_forward`` / ``_flash_attn_varlen_backward`` as flash-attn 2.7+ declares
them (``window_size_left`` / ``_right``, ``softcap``; the forward returns
``(out, softmax_lse, S_dmask, rng_state)``, the backward fills ``dq``, ``dk``, ``dv`` and
returns ``softmax_d``), and the 2.5-era pair (``window_size`` tuple, no ``softcap``, an
8-value forward, a backward returning the gradients too). Conventions kept: ``cu_seqlens``
int32; bottom-right causal alignment when a sequence's query and key counts differ; LSE
``[heads, total_q]`` float32; a row that sees no key gets output 0 and LSE +inf; GQA by
head groups. ``poison=True`` writes NaN into every row of a sequence without queries or
keys, and into the whole buffers first, so a caller that read them back would show it.
"""

from __future__ import annotations

import math
from typing import Optional

import torch


def _scores(q, k, scale, causal, softcap, window):
    s = torch.einsum("qhd,khd->hqk", q.float(), k.float()) * scale
    t = None
    if softcap:
        t = torch.tanh(s / softcap)
        s = softcap * t
    nq, nk = q.shape[0], k.shape[0]
    at = torch.arange(nq)[:, None] + (nk - nq)  # bottom-right: query a sits at key index nk - nq + a
    j = torch.arange(nk)[None, :]
    ok = torch.ones(nq, nk, dtype=torch.bool)
    left, right = window
    if causal:
        ok &= j <= at
    elif right >= 0:
        ok &= j <= at + right
    if left >= 0:
        ok &= j >= at - left
    return s.masked_fill(~ok, -math.inf), t, ok


def _forward(q, k, v, cu_q, cu_k, scale, causal, softcap, window, poison):
    H, n_rep = q.shape[1], q.shape[1] // k.shape[1]
    fill = math.nan if poison else 0.0
    out = torch.full((q.shape[0], H, v.shape[-1]), fill, dtype=q.dtype)
    lse = torch.full((H, q.shape[0]), math.nan if poison else math.inf, dtype=torch.float32)
    cq, ck = cu_q.tolist(), cu_k.tolist()
    for b in range(len(cq) - 1):
        qa, qb, ka, kb = cq[b], cq[b + 1], ck[b], ck[b + 1]
        if qa == qb or (ka == kb and poison):
            continue
        if ka == kb:  # flash-attn's early exit: no key, output 0 and LSE +inf
            out[qa:qb], lse[:, qa:qb] = 0, math.inf
            continue
        ks, vs = k[ka:kb].repeat_interleave(n_rep, 1), v[ka:kb].repeat_interleave(n_rep, 1)
        s, _, ok = _scores(q[qa:qb], ks, scale, causal, softcap, window)
        m = torch.logsumexp(s, -1)  # [H, nq]; -inf where a row sees nothing
        p = torch.exp(s - m[..., None]).nan_to_num(0.0)
        out[qa:qb] = torch.einsum("hqk,khd->qhd", p, vs.float()).to(q.dtype)
        lse[:, qa:qb] = torch.where(ok.any(-1)[None], m, math.inf)
    return out, lse


def _backward(dout, q, k, v, out, lse, dq, dk, dv, cu_q, cu_k, scale, causal, softcap, window, poison):
    H, Hkv = q.shape[1], k.shape[1]
    n_rep = H // Hkv
    gq = torch.zeros(q.shape, dtype=torch.float32)
    gk = torch.zeros(k.shape[0], H, k.shape[-1], dtype=torch.float32)
    gv = torch.zeros(v.shape[0], H, v.shape[-1], dtype=torch.float32)
    cq, ck = cu_q.tolist(), cu_k.tolist()
    for b in range(len(cq) - 1):
        qa, qb, ka, kb = cq[b], cq[b + 1], ck[b], ck[b + 1]
        if qa == qb or ka == kb:
            if poison:
                gq[qa:qb], gk[ka:kb], gv[ka:kb] = math.nan, math.nan, math.nan
            continue
        ks, vs = k[ka:kb].repeat_interleave(n_rep, 1).float(), v[ka:kb].repeat_interleave(n_rep, 1).float()
        s, t, _ = _scores(q[qa:qb], ks, scale, causal, softcap, window)
        p = torch.exp(s - lse[:, qa:qb, None])
        do = dout[qa:qb].float()
        gv[ka:kb] += torch.einsum("hqk,qhd->khd", p, do)
        d = (do * out[qa:qb].float()).sum(-1).T
        ds = p * (torch.einsum("qhd,khd->hqk", do, vs) - d[..., None])
        if t is not None:
            ds = ds * (1 - t * t)
        gq[qa:qb] += torch.einsum("hqk,khd->qhd", ds, ks) * scale
        gk[ka:kb] += torch.einsum("hqk,qhd->khd", ds, q[qa:qb].float()) * scale
    fold = lambda g: g.view(g.shape[0], Hkv, n_rep, g.shape[-1]).sum(2)  # noqa: E731
    dq.copy_(gq.to(dq.dtype))
    dk.copy_(fold(gk).to(dk.dtype))
    dv.copy_(fold(gv).to(dv.dtype))
    return torch.zeros(H, q.shape[0])


def make_pair(poison: bool = False):
    """flash-attn 2.7+'s ``(_flash_attn_varlen_forward, _flash_attn_varlen_backward)`` in torch."""

    def _flash_attn_varlen_forward(
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        cu_seqlens_q: torch.Tensor,
        cu_seqlens_k: torch.Tensor,
        max_seqlen_q: int,
        max_seqlen_k: int,
        dropout_p: float,
        softmax_scale: float,
        causal: bool,
        window_size_left: int = -1,
        window_size_right: int = -1,
        softcap: float = 0.0,
        alibi_slopes: Optional[torch.Tensor] = None,
        return_softmax: bool = False,
        block_table: Optional[torch.Tensor] = None,
        leftpad_k: Optional[torch.Tensor] = None,
        seqused_k: Optional[torch.Tensor] = None,
    ):
        assert cu_seqlens_q.dtype == torch.int32 and cu_seqlens_k.dtype == torch.int32
        assert int(cu_seqlens_q[-1]) == q.shape[0] and int(cu_seqlens_k[-1]) == k.shape[0]
        assert dropout_p == 0.0 and alibi_slopes is None and not return_softmax
        win = (window_size_left, window_size_right)
        out, lse = _forward(q, k, v, cu_seqlens_q, cu_seqlens_k, softmax_scale, causal, softcap, win, poison)
        return out, lse, torch.empty(0), torch.empty(2, dtype=torch.int64)

    def _flash_attn_varlen_backward(
        dout: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        out: torch.Tensor,
        softmax_lse: torch.Tensor,
        dq: Optional[torch.Tensor],
        dk: Optional[torch.Tensor],
        dv: Optional[torch.Tensor],
        cu_seqlens_q: torch.Tensor,
        cu_seqlens_k: torch.Tensor,
        max_seqlen_q: int,
        max_seqlen_k: int,
        dropout_p: float,
        softmax_scale: float,
        causal: bool,
        window_size_left: int,
        window_size_right: int,
        softcap: float,
        alibi_slopes: Optional[torch.Tensor],
        deterministic: bool,
        rng_state: Optional[torch.Tensor] = None,
    ):
        assert softmax_lse.shape == (q.shape[1], q.shape[0]) and softmax_lse.dtype == torch.float32
        if poison:
            for t in (dq, dk, dv):
                t.fill_(math.nan)
        win = (window_size_left, window_size_right)
        args = (cu_seqlens_q, cu_seqlens_k, softmax_scale, causal, softcap, win, poison)
        return _backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, *args)

    return _flash_attn_varlen_forward, _flash_attn_varlen_backward


def make_old_pair():
    """The 2.5-era pair: ``window_size`` tuple, no ``softcap``, 8-value forward, gradients returned."""

    def _flash_attn_varlen_forward(
        q,
        k,
        v,
        cu_seqlens_q,
        cu_seqlens_k,
        max_seqlen_q,
        max_seqlen_k,
        dropout_p,
        softmax_scale,
        causal,
        window_size,
        alibi_slopes,
        return_softmax,
        block_table=None,
    ):
        out, lse = _forward(q, k, v, cu_seqlens_q, cu_seqlens_k, softmax_scale, causal, 0.0, window_size, False)
        return out, q, k, v, out, lse, None, torch.empty(2, dtype=torch.int64)

    def _flash_attn_varlen_backward(
        dout,
        q,
        k,
        v,
        out,
        softmax_lse,
        dq,
        dk,
        dv,
        cu_seqlens_q,
        cu_seqlens_k,
        max_seqlen_q,
        max_seqlen_k,
        dropout_p,
        softmax_scale,
        causal,
        window_size,
        alibi_slopes,
        deterministic,
        rng_state=None,
    ):
        args = (cu_seqlens_q, cu_seqlens_k, softmax_scale, causal, 0.0, window_size, False)
        d = _backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, *args)
        return dq, dk, dv, d

    return _flash_attn_varlen_forward, _flash_attn_varlen_backward
