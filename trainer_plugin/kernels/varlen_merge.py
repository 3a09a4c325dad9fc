"""Tree attention as log-sum-exp merged varlen calls over keys read in place (SPEC 8).

:func:`levels_attention` runs the calls of :class:`~treepack.trainer.kernels.varlen_levels.VarlenLevels`
(the own level, then one call per tree depth) and merges each query's partial results by
their log-sum-exp: for partial outputs ``o_l`` with log-sum-exps ``lse_l`` over disjoint key
sets, ``LSE = logsumexp_l(lse_l)`` and ``O = sum_l exp(lse_l - LSE) o_l`` is attention over
their union. Attention sinks (GPT-OSS) join the merge as one more term with log-sum-exp
``sink`` and a zero value.

The backward needs no gradient through any partial LSE: with ``P_ij = exp(s_ij - LSE_i)``
(the merged LSE) and ``D_i = dO_i . O_i`` (the merged output), each call's keys get
``dS_ij = P_ij (dO_i . v_j - D_i)``, exactly the flash backward of that call run with the
merged O and LSE in place of its own (the ring-attention identity). So a kernel is used
through a :class:`SplitVarlen` pair: a forward returning the LSE, and a backward taking the
output and LSE it is given. Pairs: :data:`NAIVE_SPLIT` (loop reference, here), the batched
CPU kernel (:mod:`~treepack.trainer.kernels.varlen`) and flash-attn's
(:mod:`~treepack.trainer.kernels.gpu_flash`). :func:`split_of` maps a stock-signature varlen
function to its pair.

Pair contract: ``forward(q, k, v, cu_q, cu_k, max_q, max_k, scale, causal, softcap)`` ->
``(out [Tq, H, Dv], lse [H, Tq] float32, float64 for float64 inputs)``; ``backward(dout, q, k, v, out, lse, cu_q, cu_k,
max_q, max_k, scale, causal, softcap)`` -> ``(dq, dk, dv)``, shaped as q, k, v. q [Tq, H, D],
k [Tk, Hkv, D], v [Tk, Hkv, Dv] (H a multiple of Hkv); a sequence with queries and keys is
causal aligned bottom-right when ``causal``; the rows of a sequence without queries or keys
may hold anything (the merge never reads them).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from treepack.trainer.kernels.varlen_levels import VarlenLevel, VarlenLevels

__all__ = ["SplitVarlen", "levels_attention", "split_of", "register_split", "NAIVE_SPLIT"]


@dataclass(frozen=True, slots=True)
class SplitVarlen:
    """A varlen attention kernel as a forward with LSE and a backward from given O and LSE (module docstring).

    Attributes:
        forward: ``(q, k, v, cu_q, cu_k, max_q, max_k, scale, causal, softcap) -> (out, lse)``.
        backward: ``(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, scale, causal, softcap) -> (dq, dk, dv)``.
        name: for messages.
    """

    forward: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    backward: Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]]
    name: str


_SPLITS: dict[Any, SplitVarlen] = {}


def register_split(fn: Callable, split: SplitVarlen) -> None:
    """Declare ``split`` the pair of the stock-signature varlen function ``fn``."""
    _SPLITS[fn] = split


def split_of(fn: Callable | None) -> SplitVarlen | None:
    """The :class:`SplitVarlen` registered for ``fn``, else None."""
    return _SPLITS.get(fn) if fn is not None else None


def _sl(start: int, end: int) -> slice:
    return slice(start, end)


def _merge(acc: torch.Tensor, lse: torch.Tensor, lv: VarlenLevel, o: torch.Tensor, lo: torch.Tensor) -> None:
    """Fold one ancestor level's (o [n, H, Dv], lo [H, n]) into acc [T, H, Dv] fp32 and lse [H, T] fp32 in place."""
    a, b = lv.q_start, lv.q_end
    lo = lo.to(lse.dtype)
    if lv.q_valid is not None:
        lo = torch.where(lv.q_valid[None], lo, -math.inf)
        o = torch.where(lv.q_valid[:, None, None], o, 0)
    old = lse[:, a:b]
    new = torch.logaddexp(old, lo)
    acc[a:b] = acc[a:b] * torch.exp(old - new).T[..., None] + o.to(acc.dtype) * torch.exp(lo - new).T[..., None]
    lse[:, a:b] = new


class _LevelsAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, sinks, levels, split, scale, softcap):
        acc = lse = None
        wide = torch.promote_types(q.dtype, torch.float32)
        for lv in levels.levels:
            qs, ks = _sl(lv.q_start, lv.q_end), _sl(lv.k_start, lv.k_end)
            args = (lv.cu_seqlens_q, lv.cu_seqlens_k, lv.max_seqlen_q, lv.max_seqlen_k, scale, lv.causal, softcap)
            o, lo = split.forward(q[qs], k[ks], v[ks], *args)
            if acc is None:  # the own level: every row, every query sees itself
                acc, lse = o.to(wide), lo.to(wide).clone()
            else:
                _merge(acc, lse, lv, o, lo)
        assert acc is not None and lse is not None, "the own level covers every row"
        if sinks is not None:
            new = torch.logaddexp(lse, sinks.to(wide)[:, None])
            acc = acc * torch.exp(lse - new).T[..., None]
            lse = new
        out = acc.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse, sinks)
        ctx.levels, ctx.split, ctx.scale, ctx.softcap = levels, split, scale, softcap
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, sinks = ctx.saved_tensors
        dout = dout.contiguous()
        wide = lse.dtype
        dq = torch.zeros(q.shape, dtype=wide, device=q.device)
        dk = torch.zeros(k.shape, dtype=wide, device=k.device)
        dv = torch.zeros(v.shape, dtype=wide, device=v.device)
        for lv in ctx.levels.levels:
            qs, ks = _sl(lv.q_start, lv.q_end), _sl(lv.k_start, lv.k_end)
            args = (lv.cu_seqlens_q, lv.cu_seqlens_k, lv.max_seqlen_q, lv.max_seqlen_k, ctx.scale, lv.causal)
            gq, gk, gv = ctx.split.backward(
                dout[qs], q[qs], k[ks], v[ks], out[qs], lse[:, qs].contiguous(), *args, ctx.softcap
            )
            if lv.q_valid is not None:
                gq = torch.where(lv.q_valid[:, None, None], gq, 0)
            if lv.k_valid is not None:
                gk = torch.where(lv.k_valid[:, None, None], gk, 0)
                gv = torch.where(lv.k_valid[:, None, None], gv, 0)
            dq[qs] += gq.to(wide)
            dk[ks] += gk.to(wide)
            dv[ks] += gv.to(wide)
        dsinks = None
        if sinks is not None and ctx.needs_input_grad[3]:
            # The sink is a key with logit `sink` and value 0: dsink = -sum_i P_sink,i D_i.
            d = (dout.to(wide) * out.to(wide)).sum(-1).T  # [H, T]
            dsinks = -(torch.exp(sinks.to(wide)[:, None] - lse) * d).sum(-1).to(sinks.dtype)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), dsinks, None, None, None, None


def levels_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    levels: VarlenLevels,
    split: SplitVarlen,
    *,
    scale: float,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Tree attention of flattened rows over :class:`VarlenLevels` (module docstring).

    Args:
        q: [T, H, D] queries of the flattened rows (T = K * L); k: [T, Hkv, D]; v: [T, Hkv, Dv].
        levels: the calls (:func:`~treepack.trainer.kernels.varlen_levels.varlen_levels`).
        split: the kernel pair.
        scale: softmax scale.
        softcap: optional logit soft-cap ``c * tanh(s / c)``.
        sinks: optional [H] attention-sink logits.

    Returns:
        [T, H, Dv] in q's dtype (merged in float32, float64 for float64 inputs).
    """
    cap = 0.0 if softcap is None else float(softcap)
    return _LevelsAttention.apply(q, k, v, sinks, levels, split, float(scale), cap)


def _masked_scores(qs, ks, scale, causal, softcap):
    """[H, nq, nk] logits (soft-capped) of one sequence, -inf where the causal alignment hides them,
    and the raw tanh for the soft-cap's derivative."""
    wide = torch.promote_types(qs.dtype, torch.float32)
    s = torch.einsum("qhd,khd->hqk", qs.to(wide), ks.to(wide)) * scale
    t = None
    if softcap:
        t = torch.tanh(s / softcap)
        s = softcap * t
    nq, nk = qs.shape[0], ks.shape[0]
    if causal:
        a = torch.arange(nq, device=qs.device)[:, None] + (nk - nq)
        s = s.masked_fill(torch.arange(nk, device=qs.device)[None, :] > a, -math.inf)
    return s, t


def _naive_forward(q, k, v, cu_q, cu_k, max_q, max_k, scale, causal, softcap):
    n_rep = q.shape[1] // k.shape[1]
    out = torch.zeros(q.shape[0], q.shape[1], v.shape[-1], dtype=q.dtype, device=q.device)
    wide = torch.promote_types(q.dtype, torch.float32)
    lse = torch.full((q.shape[1], q.shape[0]), -math.inf, dtype=wide, device=q.device)
    cq, ck = cu_q.tolist(), cu_k.tolist()
    for b in range(len(cq) - 1):
        if cq[b + 1] == cq[b] or ck[b + 1] == ck[b]:
            continue
        ks = k[ck[b] : ck[b + 1]].repeat_interleave(n_rep, 1)
        vs = v[ck[b] : ck[b + 1]].repeat_interleave(n_rep, 1)
        s, _ = _masked_scores(q[cq[b] : cq[b + 1]], ks, scale, causal, softcap)
        m = torch.logsumexp(s, -1)  # [H, nq]
        out[cq[b] : cq[b + 1]] = torch.einsum("hqk,khd->qhd", torch.exp(s - m[..., None]), vs.to(wide)).to(q.dtype)
        lse[:, cq[b] : cq[b + 1]] = m
    return out, lse


def _naive_backward(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, scale, causal, softcap):
    H, Hkv = q.shape[1], k.shape[1]
    n_rep = H // Hkv
    wide = torch.promote_types(q.dtype, torch.float32)
    dq = torch.zeros(q.shape, dtype=wide, device=q.device)
    dk = torch.zeros(k.shape[0], H, k.shape[-1], dtype=wide, device=q.device)
    dv = torch.zeros(v.shape[0], H, v.shape[-1], dtype=wide, device=q.device)
    cq, ck = cu_q.tolist(), cu_k.tolist()
    for b in range(len(cq) - 1):
        qa, qb, ka, kb = cq[b], cq[b + 1], ck[b], ck[b + 1]
        if qa == qb or ka == kb:
            continue
        ks = k[ka:kb].repeat_interleave(n_rep, 1).to(wide)
        vs = v[ka:kb].repeat_interleave(n_rep, 1).to(wide)
        s, t = _masked_scores(q[qa:qb], ks, scale, causal, softcap)
        p = torch.exp(s - lse[:, qa:qb, None].to(wide))  # [H, nq, nk], 0 where hidden
        do = dout[qa:qb].to(wide)
        dv[ka:kb] += torch.einsum("hqk,qhd->khd", p, do)
        dp = torch.einsum("qhd,khd->hqk", do, vs)
        d = (do * out[qa:qb].to(wide)).sum(-1).T  # [H, nq]
        ds = p * (dp - d[..., None])
        if t is not None:
            ds = ds * (1 - t * t)
        dq[qa:qb] += torch.einsum("hqk,khd->qhd", ds, ks) * scale
        dk[ka:kb] += torch.einsum("hqk,qhd->khd", ds, q[qa:qb].to(wide)) * scale
    fold = lambda g: g.view(g.shape[0], Hkv, n_rep, g.shape[-1]).sum(2)  # noqa: E731
    return dq.to(q.dtype), fold(dk).to(k.dtype), fold(dv).to(v.dtype)


#: The loop reference pair: one set of small ops per sequence, float32 (or float64) inside.
NAIVE_SPLIT = SplitVarlen(forward=_naive_forward, backward=_naive_backward, name="naive")
