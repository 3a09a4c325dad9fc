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


# Stand-ins for the stock GPU kernels, with their signatures and semantics, built on the
# loops above: ``gpu_check --cpu-smoke`` and the main test run pass them as the wrappers'
# ``kernel=`` so every wrapper's own code (padding, buckets, state terms, context
# prefixes) runs on CPU without a kernel package.


def _varlen(loop_fn, q, *rest, initial_state, cu_seqlens, **kw):
    cu = [0, q.shape[1]] if cu_seqlens is None else cu_seqlens.tolist()
    outs, finals = [], []
    for i in range(len(cu) - 1):
        o, h = loop_fn(
            *(t[0, cu[i] : cu[i + 1]] for t in (q, *rest)), None if initial_state is None else initial_state[i], **kw
        )
        outs.append(o)
        finals.append(h)
    return torch.cat(outs)[None], torch.stack(finals)


def stock_chunk_gated_delta_rule(
    q,
    k,
    v,
    g,
    beta,
    scale=None,
    initial_state=None,
    output_final_state=False,
    use_qk_l2norm_in_kernel=False,
    cu_seqlens=None,
    **_,
):
    """fla's ``chunk_gated_delta_rule`` / ``chunk_kda`` contract (varlen, per-sequence states)."""
    o, h = _varlen(
        loop_delta_rule,
        q,
        k,
        v,
        g,
        beta,
        initial_state=initial_state,
        cu_seqlens=cu_seqlens,
        scale=scale,
        use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
    )
    return o.to(q.dtype), (h.float() if output_final_state else None)


def stock_mamba_chunk_scan_combined(
    x,
    dt,
    A,
    B,
    C,
    chunk_size,
    D=None,
    z=None,
    dt_bias=None,
    initial_states=None,
    seq_idx=None,
    cu_seqlens=None,
    dt_softplus=False,
    dt_limit=(0.0, math.inf),
    return_final_states=False,
    return_varlen_states=False,
):
    """mamba_ssm's contract: batch rows [b, L, ...], one initial state per ROW (no varlen states)."""
    assert seq_idx is None and not return_varlen_states, "the wrapper never uses varlen states"
    outs, finals = [], []
    for b in range(x.shape[0]):
        o, h = loop_mamba2(
            x[b],
            mamba_dt(dt[b], dt_bias, dt_softplus, dt_limit),
            A,
            B[b],
            C[b],
            None if initial_states is None else initial_states[b],
            D=D,
            z=None if z is None else z[b],
        )
        outs.append(o)
        finals.append(h)
    out = torch.stack(outs).to(x.dtype)
    return (out, torch.stack(finals).float()) if return_final_states else out


def stock_selective_scan_fn(
    u, delta, A, B, C, D=None, z=None, delta_bias=None, delta_softplus=False, return_last_state=False
):
    """mamba_ssm's contract: u, delta [b, Dm, L]; B, C [b, N, L]; zero initial state; the last
    state carries no gradient (as the CUDA kernel's)."""
    outs, lasts = [], []
    for b in range(u.shape[0]):
        o, h = loop_selective_scan(
            u[b].T,
            delta[b].T,
            A,
            B[b].T,
            C[b].T,
            None,
            D=D,
            z=None if z is None else z[b].T,
            delta_bias=delta_bias,
            delta_softplus=delta_softplus,
        )
        outs.append(o.T)
        lasts.append(h.detach())
    out = torch.stack(outs).to(u.dtype)
    return (out, torch.stack(lasts)) if return_last_state else out


def _conv_seq(x, weight, bias, activation):
    """x [D, L] -> [D, L]: depthwise causal conv, zeros before the start."""
    W = weight.shape[1]
    y = F.conv1d(F.pad(x[None], (W - 1, 0)), weight[:, None, :], bias, groups=x.shape[0])[0]
    return F.silu(y) if activation in ("silu", "swish") else y


def stock_causal_conv1d_fn(
    x,
    weight,
    bias=None,
    seq_idx=None,
    initial_states=None,
    return_final_states=False,
    final_states_out=None,
    activation=None,
):
    """causal-conv1d's contract: x [b, D, L]; ``seq_idx`` [b, L] restarts the conv at each change."""
    assert initial_states is None and not return_final_states
    xd, wd, bd = x.double(), weight.double(), None if bias is None else bias.double()
    out = torch.zeros_like(xd)
    for b in range(x.shape[0]):
        ids = seq_idx[b] if seq_idx is not None else torch.zeros(x.shape[2], dtype=torch.int32)
        starts = [0] + (torch.nonzero(ids[1:] != ids[:-1]).flatten() + 1).tolist() + [x.shape[2]]
        for a, e in zip(starts[:-1], starts[1:]):
            out[b, :, a:e] = _conv_seq(xd[b, :, a:e], wd, bd, activation)
    return out.to(x.dtype)


def stock_fla_causal_conv1d(
    x,
    weight=None,
    bias=None,
    residual=None,
    initial_state=None,
    output_final_state=False,
    activation=None,
    backend="triton",
    cu_seqlens=None,
    **_,
):
    """fla's ``causal_conv1d`` contract: x [1, T, D] with ``cu_seqlens``; returns (y, None)."""
    assert residual is None and initial_state is None and not output_final_state
    cu = [0, x.shape[1]] if cu_seqlens is None else cu_seqlens.tolist()
    xd, wd, bd = x.double(), weight.double(), None if bias is None else bias.double()
    parts = [_conv_seq(xd[0, a:e].T, wd, bd, activation).T for a, e in zip(cu[:-1], cu[1:])]
    return torch.cat(parts)[None].to(x.dtype), None
