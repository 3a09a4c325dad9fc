"""Mamba (S6) selective scan in pure torch, with mamba_ssm's ``selective_scan_fn`` signature.

Per channel d (state size N) and token t::

    dt_t <- softplus(dt_t + delta_bias)           (each step optional)
    h    <- exp(dt_t A_d) * h + dt_t B_t u_t       h: [N]
    y_t  =  C_t . h + D_d u_t,   then  y_t * silu(z_t)  when z is given

- :func:`naive_selective_scan`: the recurrence above, token by token.
- :func:`torch_selective_scan`: chunked (log-space cumulative decays inside a chunk of
  ``CHUNK`` tokens, a state scan across chunks), vectorized over channels and batch.

Both take ``u, delta [B, D, L], A [D, N], B, C [B, N, L] (or [B, G, N, L]), D [D], z [B, D, L],
delta_bias [D]`` and return y [B, D, L] (and the last state [B, D, N] with
``return_last_state``); the scan starts from zeros, as mamba_ssm's.

:func:`tree_selective_scan` runs it on tree rows. mamba_ssm's kernel has neither varlen
nor initial states, so per depth level the segments are padded into a batch with dt = 0
after their end (exp(0) = 1 and a zero write: the state is unchanged, so the last state is
the segment's), and the parent's state enters by linearity: ``y_t += C_t . (exp(cumsum(dt
A))_t * h0)`` and ``h_last += exp(sum dt A) * h0``; the z gate is applied after that term.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from treepack.proto.errors import InputTypeError, RequestError
from treepack.trainer.kernels.gpu_varlen import selective_scan_with_state
from treepack.trainer.kernels.short_conv import gpu_kernel_available
from treepack.trainer.kernels.tree_scan import TreeSchedule, tree_scan

__all__ = ["select_selective_scan", "torch_selective_scan", "naive_selective_scan", "tree_selective_scan", "CHUNK"]

CHUNK = 8


def _prepare(u, delta, A, B, C, D, z, delta_bias, delta_softplus):
    for name, t in (("u", u), ("delta", delta), ("A", A), ("B", B), ("C", C)):
        if not isinstance(t, torch.Tensor):
            raise InputTypeError(f"expected a torch.Tensor, got {type(t).__name__}", path=f"$.{name}", rule="type")
    if u.dim() != 3 or delta.shape != u.shape or A.dim() != 2 or A.shape[0] != u.shape[1]:
        raise RequestError(
            f"u, delta must be [B, D, L] and A [D, N], got {tuple(u.shape)}, {tuple(delta.shape)}, {tuple(A.shape)}",
            path="$.u",
            rule="shape",
        )
    b, Dd, L = u.shape
    N = A.shape[1]
    ct = torch.promote_types(u.dtype, torch.float32)

    def per_channel(M, name):  # [B, N, L] or [B, G, N, L] -> [B, D, L, N]
        if M.dim() == 3 and M.shape == (b, N, L):
            return M.to(ct).transpose(1, 2)[:, None].expand(b, Dd, L, N)
        if M.dim() == 4 and M.shape[0] == b and M.shape[2:] == (N, L) and Dd % M.shape[1] == 0:
            return M.to(ct).transpose(2, 3).repeat_interleave(Dd // M.shape[1], dim=1)
        raise RequestError(
            f"{name} must be [B, N, L] or [B, G, N, L] with N = {N}, L = {L}, got {tuple(M.shape)}",
            path=f"$.{name}",
            rule="shape",
        )

    dt = delta.to(ct)
    if delta_bias is not None:
        dt = dt + delta_bias.to(ct)[:, None]
    if delta_softplus:
        dt = F.softplus(dt)
    return u.to(ct), dt, A.to(ct), per_channel(B, "B"), per_channel(C, "C"), ct


def _finish(y, u, D, z, out_dtype):
    if D is not None:
        y = y + u * D.to(y.dtype)[:, None]
    if z is not None:
        y = y * F.silu(z.to(y.dtype))
    return y.to(out_dtype)


def naive_selective_scan(
    u, delta, A, B, C, D=None, z=None, delta_bias=None, delta_softplus=False, return_last_state=False
):
    """The selective scan token by token (reference for :func:`torch_selective_scan`)."""
    uf, dt, Af, Bf, Cf, _ = _prepare(u, delta, A, B, C, D, z, delta_bias, delta_softplus)
    b, Dd, L = u.shape
    h = uf.new_zeros(b, Dd, A.shape[1])
    ys = []
    for t in range(L):
        h = (dt[:, :, t, None] * Af).exp() * h + (dt[:, :, t] * uf[:, :, t])[..., None] * Bf[:, :, t]
        ys.append((h * Cf[:, :, t]).sum(-1))
    y = torch.stack(ys, dim=-1) if ys else uf.new_zeros(b, Dd, 0)
    y = _finish(y, uf, D, z, u.dtype)
    return (y, h) if return_last_state else y


def torch_selective_scan(
    u, delta, A, B, C, D=None, z=None, delta_bias=None, delta_softplus=False, return_last_state=False
):
    """The chunked selective scan (same contract as :func:`naive_selective_scan`).

    Inside a chunk with ``a_t = cumsum(dt A)``: ``h_t = exp(a_t) h0 + sum_{s<=t} exp(a_t - a_s)
    dt_s B_s u_s``; the chunks' start states come from a scan over chunk index.
    """
    uf, dt, Af, Bf, Cf, _ = _prepare(u, delta, A, B, C, D, z, delta_bias, delta_softplus)
    b, Dd, L = u.shape
    N, T = A.shape[1], CHUNK
    pad = (-L) % T
    nc = (L + pad) // T
    padded = lambda x: F.pad(x, (0, 0, 0, pad)) if x.dim() == 4 else F.pad(x, (0, pad))  # noqa: E731
    dtc = padded(dt).reshape(b, Dd, nc, T)
    w = padded(dt * uf)[..., None] * padded(Bf)  # [B, D, L', N] writes
    w = w.reshape(b, Dd, nc, T, N)
    Cc = padded(Cf).reshape(b, Dd, nc, T, N)
    a = torch.cumsum(dtc[..., None] * Af[None, :, None, None, :], dim=3)  # [B, D, nc, T, N]
    lower = torch.ones(T, T, dtype=torch.bool, device=u.device).tril()
    diff = (a[:, :, :, :, None] - a[:, :, :, None, :]).masked_fill(~lower[:, :, None], float("-inf"))
    h_local = (diff.exp() * w[:, :, :, None]).sum(4)  # [B, D, nc, T(t), N]: from zero at chunk start
    h0 = uf.new_zeros(b, Dd, N)
    starts = []
    for c in range(nc):
        starts.append(h0)
        h0 = a[:, :, c, -1].exp() * h0 + h_local[:, :, c, -1]
    h_all = h_local + a.exp() * torch.stack(starts, dim=2)[:, :, :, None]
    y = (h_all * Cc).sum(-1).reshape(b, Dd, nc * T)[..., :L]
    y = _finish(y, uf, D, z, u.dtype)
    return (y, h0) if return_last_state else y


def tree_selective_scan(
    u: torch.Tensor,
    delta: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    schedule: TreeSchedule,
    *,
    D: torch.Tensor | None = None,
    z: torch.Tensor | None = None,
    delta_bias: torch.Tensor | None = None,
    delta_softplus: bool = False,
    scan_fn=None,
) -> torch.Tensor:
    """The selective scan over tree rows: one padded-batch ``scan_fn`` call per depth level.

    Args:
        u, delta: [N, D] flat row tokens. A: [D, N_state]. B, C: [N, N_state].
        D: [D] skip. z: [N, D] gate. delta_bias: [D]. delta_softplus: as mamba_ssm.
        schedule: from :func:`~treepack.trainer.kernels.tree_scan.tree_schedule`.
        scan_fn: a function with ``selective_scan_fn``'s signature; default
            :func:`select_selective_scan`.

    Returns:
        [N, D] in u's dtype; zeros at padding.
    """
    scan_fn = select_selective_scan(u) if scan_fn is None else scan_fn
    ct = torch.promote_types(u.dtype, torch.float32)
    dt = delta.to(ct) + (0 if delta_bias is None else delta_bias.to(ct))
    dt = F.softplus(dt) if delta_softplus else dt
    Af = A.to(ct)

    def step(sel, h0, lv):
        us, dts, Bs, Cs = sel
        n = lv.cu_seqlens.numel() - 1
        Lmax = int((lv.cu_seqlens[1:] - lv.cu_seqlens[:-1]).max())
        off = torch.arange(us.shape[0], device=us.device) - lv.cu_seqlens.long()[lv.seq_idx.long()]
        at = (lv.seq_idx.long(), off)

        def batch(x):  # [T_l, F] -> [n, F, Lmax], zeros after each segment's end
            return x.new_zeros(n, Lmax, x.shape[1]).index_put(at, x).transpose(1, 2)

        ub, dtb, Bb, Cb = (batch(x) for x in (us, dts, Bs, Cs))
        y, last = scan_fn(ub, dtb, A, Bb, Cb, D=D, return_last_state=True)
        y = y.to(ct)
        if h0 is not None:  # the parent's state, by linearity (module docstring)
            decay = torch.cumsum(dtb[..., None] * Af[:, None, :], dim=2).exp()  # [n, D, Lmax, N]
            h0 = h0.to(ct)
            y = y + torch.einsum("bdln,bnl->bdl", decay * h0[:, :, None, :], Cb.to(ct))
            last = last.to(ct) + decay[:, :, -1] * h0
        return y.transpose(1, 2)[at], last

    y = tree_scan(step, (u, dt, B, C), schedule, (u.shape[1],))
    return y if z is None else (y.to(ct) * F.silu(z.to(ct))).to(u.dtype)


def select_selective_scan(x: torch.Tensor):
    """The selective-scan kernel for tensors like ``x``, with ``selective_scan_fn``'s signature.

    CUDA with mamba_ssm importable:
    :func:`~treepack.trainer.kernels.gpu_varlen.selective_scan_with_state` (the CUDA
    kernel's own last state carries no gradient, and :func:`tree_selective_scan` forks the
    children from it); else :func:`torch_selective_scan`.
    """
    if x.is_cuda and gpu_kernel_available("mamba_ssm.selective_scan_fn"):
        return selective_scan_with_state
    return torch_selective_scan
