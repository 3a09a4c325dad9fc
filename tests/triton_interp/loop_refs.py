"""Token-by-token references of the recurrences the GPU wrappers run, and a tree walker.

Each ``loop_*`` runs ONE sequence from an initial state, one token at a time, in fp64
(inputs are upcast), and returns ``(out [T, ...], final state)``. :func:`naive_tree`
walks a plan's segments parents first (segment order), each from its parent's final state
read from a dict, with no level metadata: the oracle for :func:`scan_tree`. These are
slow and obviously right; they sit in the tests until the mixers' own naive references
(``treepack.trainer.kernels.{kda,mamba2,mamba}``) land on main.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

__all__ = ["loop_delta_rule", "loop_mamba2", "loop_selective_scan", "naive_tree", "mamba_dt"]


def _l2(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + 1e-6)


def loop_delta_rule(q, k, v, g, beta, h0=None, *, scale=None, use_qk_l2norm_in_kernel=False):
    """Gated delta rule (g [T, H]) or Kimi Delta Attention (g [T, H, K]), token by token.

    ``S <- exp(g_t) * S`` (per head, or per key channel for KDA);
    ``S <- S + k_t (beta_t (v_t - S^T k_t))^T``; ``o_t = scale * S^T q_t``.
    q, k: [T, Hk, K] (Hk divides Hv: grouped values); v: [T, Hv, V]; beta: [T, Hv];
    h0: [Hv, K, V] or None.
    """
    q, k, v, g, beta = (t.double() for t in (q, k, v, g, beta))
    Hv = v.shape[1]
    if q.shape[1] != Hv:
        q, k = (t.repeat_interleave(Hv // q.shape[1], dim=1) for t in (q, k))
    if use_qk_l2norm_in_kernel:
        q, k = _l2(q), _l2(k)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    S = q.new_zeros(Hv, q.shape[-1], v.shape[-1]) if h0 is None else h0.double()
    outs = []
    for t in range(q.shape[0]):
        decay = g[t].exp()
        S = S * (decay[:, :, None] if g.dim() == 3 else decay[:, None, None])
        err = v[t] - torch.einsum("hkv,hk->hv", S, k[t])
        S = S + k[t][:, :, None] * (beta[t][:, None] * err)[:, None, :]
        outs.append(scale * torch.einsum("hkv,hk->hv", S, q[t]))
    return torch.stack(outs), S


def mamba_dt(dt, dt_bias=None, dt_softplus=False, dt_limit=(0.0, math.inf)):
    """mamba_ssm's dt preprocessing: bias, softplus (threshold 20), clamp."""
    dt = dt.double()
    if dt_bias is not None:
        dt = dt + dt_bias.double()
    if dt_softplus:
        dt = F.softplus(dt, threshold=20.0)
    return dt.clamp(min=dt_limit[0], max=dt_limit[1])


def loop_mamba2(x, dt, A, B, C, h0=None, *, D=None, z=None, dt_bias=None, dt_softplus=False):
    """Mamba2's SSD recurrence token by token (mamba_ssm ``mamba_chunk_scan_combined``).

    ``h <- exp(dt_t A) h + dt_t x_t B_t^T`` per head ([P, N]); ``y_t = h C_t + D x_t``,
    times ``silu(z_t)`` when z is given. x: [T, H, P]; dt: [T, H]; A: [H]; B, C: [T, G, N]
    (head h uses group ``h // (H // G)``); h0: [H, P, N] or None.
    """
    H = x.shape[1]
    x, A, B, C = x.double(), A.double(), B.double(), C.double()
    dt = mamba_dt(dt, dt_bias, dt_softplus)
    rep = H // B.shape[1]
    B, C = B.repeat_interleave(rep, dim=1), C.repeat_interleave(rep, dim=1)  # [T, H, N]
    h = x.new_zeros(H, x.shape[2], B.shape[2]) if h0 is None else h0.double()
    ys = []
    for t in range(x.shape[0]):
        h = h * torch.exp(dt[t] * A)[:, None, None] + (dt[t][:, None] * x[t])[:, :, None] * B[t][:, None, :]
        y = torch.einsum("hpn,hn->hp", h, C[t])
        if D is not None:
            y = y + (D.double()[:, None] if D.dim() == 1 else D.double()) * x[t]
        if z is not None:
            y = y * F.silu(z[t].double())
        ys.append(y)
    return torch.stack(ys), h


def loop_selective_scan(u, delta, A, B, C, h0=None, *, D=None, z=None, delta_bias=None, delta_softplus=False):
    """Mamba1's selective scan token by token (mamba_ssm ``selective_scan_fn``).

    ``h <- exp(delta_t A) * h + delta_t u_t B_t`` ([Dm, N]); ``y_t = h C_t + D u_t``, times
    ``silu(z_t)``. u, delta: [T, Dm]; A: [Dm, N]; B, C: [T, N]; h0: [Dm, N] or None.
    """
    u, A, B, C = u.double(), A.double(), B.double(), C.double()
    delta = mamba_dt(delta, delta_bias, delta_softplus)
    h = u.new_zeros(A.shape) if h0 is None else h0.double()
    ys = []
    for t in range(u.shape[0]):
        h = torch.exp(delta[t][:, None] * A) * h + (delta[t] * u[t])[:, None] * B[t][None, :]
        y = h @ C[t]
        if D is not None:
            y = y + D.double() * u[t]
        if z is not None:
            y = y * F.silu(z[t].double())
        ys.append(y)
    return torch.stack(ys), h


def naive_tree(loop_fn, plan, tensors, **kw) -> torch.Tensor:
    """Every segment of ``plan`` through ``loop_fn`` from its parent's final state.

    Args:
        loop_fn: one of the ``loop_*`` functions.
        plan: the plan (segments in parent-first order).
        tensors: per-token inputs flat over rows ([N, ...] each).
        **kw: passed to ``loop_fn``.

    Returns:
        [N, ...] fp64 outputs; NaN-free: padding positions are zero.
    """
    C, seg = plan.seq_len, plan.segments
    out = None
    states: dict[int, torch.Tensor] = {}
    for s in range(seg.num_segments):
        b = int(seg.row[s]) * C + int(seg.row_start[s])
        t = torch.arange(b, b + int(seg.length[s]), device=tensors[0].device)
        p = int(seg.parent[s])
        assert p < s, "segments must come parents first"
        o, states[s] = loop_fn(*(x[t] for x in tensors), None if p < 0 else states[p], **kw)
        if out is None:
            out = o.new_zeros(plan.num_rows * C, *o.shape[1:])
        out[t] = o
    return out
