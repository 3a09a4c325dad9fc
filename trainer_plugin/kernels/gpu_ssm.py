"""GPU kernels of the state-space mixers on one tree level: Mamba2's SSD and Mamba1's selective scan.

mamba_ssm's kernels take what a tree level lacks only in part; the wrappers here make up
for it exactly:

- ``mamba_chunk_scan_combined`` (Triton): initial states are per *batch row*, not per
  varlen sequence, and varlen final states have no backward. The level is run as a batch
  of segments, each LEFT-padded to its bucket's longest segment with ``dt = 0`` and
  ``x = B = C = 0`` (decay ``exp(0 * A) = 1``, no write), so the state reaches every
  segment's last token untouched; ``dt_bias`` / softplus / ``dt_limit`` are applied in
  torch first (the kernel's own order). Segments are bucketed by length so that padding
  stays below the real tokens of each bucket (:func:`length_buckets`).
- ``selective_scan_fn`` (Mamba1, CUDA only): no initial state and a final state without
  gradient. Same padded batches; the initial state's contribution to the outputs and the
  final state are added in torch (the scan is linear in its state), at
  ``O(n * D * N * L)`` memory per bucket.

Each ``*_level`` has the contract of :mod:`~treepack.trainer.kernels.gpu`'s wrappers
(``(out [1, T, ...], final_state [n, ...])``, usable by
:func:`~treepack.trainer.kernels.gpu.scan_tree`); kernels are loaded lazily through
:func:`~treepack.trainer.kernels.gpu.load_kernel`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from treepack.trainer.kernels.gpu import load_kernel

__all__ = ["length_buckets", "mamba2_level", "selective_scan_level"]


def length_buckets(lens: list[int], max_pad_ratio: float = 1.0) -> list[list[int]]:
    """Group segment indices, longest first, so each group pads to its first length.

    A segment joins the open group while the group's padding (``count * longest - real``)
    stays at most ``max_pad_ratio`` times its real tokens. Returns index lists covering
    every segment once.
    """
    order = sorted(range(len(lens)), key=lambda i: -lens[i])
    out: list[list[int]] = []
    real = 0
    for i in order:
        if out and (len(out[-1]) + 1) * lens[out[-1][0]] - (real + lens[i]) <= max_pad_ratio * (real + lens[i]):
            out[-1].append(i)
            real += lens[i]
        else:
            out.append([i])
            real = lens[i]
    return out


def _left_pad_index(cu: list[int], group: list[int], device: torch.device) -> torch.Tensor:
    """[b, Lmax] flat token index of each segment of ``group``, left-padded with -1."""
    lens = torch.tensor([cu[i + 1] - cu[i] for i in group], dtype=torch.int64)
    starts = torch.tensor([cu[i] for i in group], dtype=torch.int64)
    L = int(lens.max())
    j = torch.arange(L)[None, :] - (L - lens)[:, None]  # offset inside the segment
    return torch.where(j >= 0, starts[:, None] + j, -1).to(device)


def _gather_padded(x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """x [T, ...] -> [b, L, ...] with zeros where ``idx`` is -1."""
    xe = torch.cat([x, x.new_zeros(1, *x.shape[1:])])
    return xe[torch.where(idx < 0, x.shape[0], idx)]


def _f32(dtype: torch.dtype) -> torch.dtype:
    """At least fp32 (fp64 stays fp64): the precision the kernels keep states in."""
    return torch.promote_types(dtype, torch.float32)


def _mamba_dt(dt, dt_bias, dt_softplus, dt_limit):
    """mamba_ssm's dt preprocessing (bias, softplus with threshold 20, clamp), in >= fp32."""
    dt = dt.to(_f32(dt.dtype))
    if dt_bias is not None:
        dt = dt + dt_bias
    if dt_softplus:
        dt = F.softplus(dt, threshold=20.0)
    if dt_limit != (0.0, float("inf")):
        dt = dt.clamp(min=dt_limit[0], max=dt_limit[1])
    return dt


def mamba2_level(
    x,
    dt,
    A,
    B,
    C,
    chunk_size=256,
    D=None,
    z=None,
    dt_bias=None,
    dt_softplus=False,
    dt_limit=(0.0, float("inf")),
    initial_state=None,
    output_final_state=True,
    cu_seqlens=None,
    max_pad_ratio=1.0,
    kernel=None,
):
    """mamba_ssm's ``mamba_chunk_scan_combined`` on one tree level (module docstring).

    Args:
        x: [1, T, H, P]. dt: [1, T, H] (raw; bias/softplus/limit applied here). A: [H].
        B, C: [1, T, G, N]. D: [H] or [H, P]. z: [1, T, H, P] gate or None.
        initial_state: [n, H, P, N] per segment, or None (zeros).
        cu_seqlens: [n+1] segment boundaries in T.

    Returns:
        (y [1, T, H, P] in x's dtype, final state [n, H, P, N] fp32).
    """
    fn = kernel or load_kernel("mamba_ssm.mamba_chunk_scan_combined")
    T, H, P = x.shape[1:]
    N = B.shape[-1]
    cu = [0, T] if cu_seqlens is None else [int(c) for c in cu_seqlens.tolist()]
    n = len(cu) - 1
    dt = _mamba_dt(dt[0], dt_bias, dt_softplus, dt_limit).to(x.dtype)
    y = x.new_zeros(T, H, P)
    finals = [None] * n
    for group in length_buckets([cu[i + 1] - cu[i] for i in range(n)], max_pad_ratio):
        idx = _left_pad_index(cu, group, x.device)
        xs, dts, Bs, Cs = (_gather_padded(t, idx) for t in (x[0], dt, B[0], C[0]))
        zs = None if z is None else _gather_padded(z[0], idx)
        h0 = None if initial_state is None else initial_state[group].to(_f32(x.dtype)).contiguous()
        out, fin = fn(xs, dts, A, Bs, Cs, chunk_size, D=D, z=zs, initial_states=h0, return_final_states=True)
        keep = idx >= 0
        y = y.index_put((idx[keep],), out[keep].to(y.dtype))
        for r, i in enumerate(group):
            finals[i] = fin[r]
    final = torch.stack(finals) if n else x.new_zeros(0, H, P, N, dtype=torch.float32)
    return y[None], final.to(_f32(final.dtype))


def selective_scan_level(
    u,
    delta,
    A,
    B,
    C,
    D=None,
    z=None,
    delta_bias=None,
    delta_softplus=False,
    initial_state=None,
    output_final_state=True,
    cu_seqlens=None,
    max_pad_ratio=1.0,
    kernel=None,
):
    """mamba_ssm's ``selective_scan_fn`` (Mamba1) on one tree level (module docstring).

    Args:
        u, delta: [1, T, Dm] (token-major; the kernel's [b, Dm, L] layout is made here).
        A: [Dm, N]. B, C: [1, T, N]. D: [Dm]. z: [1, T, Dm] or None. delta_bias: [Dm].
        initial_state: [n, Dm, N] or None. cu_seqlens: [n+1].

    Returns:
        (y [1, T, Dm] in u's dtype, final state [n, Dm, N] fp32).
    """
    fn = kernel or load_kernel("mamba_ssm.selective_scan_fn")
    T, Dm = u.shape[1:]
    N = A.shape[-1]
    cu = [0, T] if cu_seqlens is None else [int(c) for c in cu_seqlens.tolist()]
    n = len(cu) - 1
    delta = _mamba_dt(delta[0], delta_bias, delta_softplus, (0.0, float("inf")))
    f32 = _f32(u.dtype)
    y = u.new_zeros(T, Dm, dtype=f32)
    finals = [None] * n
    Af = A.to(f32)
    for group in length_buckets([cu[i + 1] - cu[i] for i in range(n)], max_pad_ratio):
        idx = _left_pad_index(cu, group, u.device)
        us, ds, Bs, Cs = (_gather_padded(t, idx).transpose(1, 2) for t in (u[0], delta, B[0], C[0]))
        out = fn(us.to(u.dtype).contiguous(), ds.to(u.dtype).contiguous(), A, Bs.contiguous(), Cs.contiguous(), D=D).to(
            f32
        )
        us, ds, Bs, Cs = (t.to(f32) for t in (us, ds, Bs, Cs))
        cum = ds.cumsum(-1)  # [b, Dm, L]
        decay_in = torch.exp(Af[None, :, :, None] * cum[:, :, None, :])  # [b, Dm, N, L]
        if initial_state is not None:
            h0 = initial_state[group].to(f32)
            out = out + torch.einsum("bdn,bnl,bdnl->bdl", h0, Cs, decay_in)
        tail = torch.exp(Af[None, :, :, None] * (cum[:, :, None, -1:] - cum[:, :, None, :]))  # [b, Dm, N, L]
        fin = torch.einsum("bdnl,bdl,bnl->bdn", tail, ds * us, Bs)
        if initial_state is not None:
            fin = fin + h0 * decay_in[..., -1]
        keep = idx >= 0
        y = y.index_put((idx[keep],), out.transpose(1, 2)[keep])
        for r, i in enumerate(group):
            finals[i] = fin[r]
    if z is not None:
        y = y * F.silu(z[0].to(f32))
    final = torch.stack(finals) if n else u.new_zeros(0, Dm, N, dtype=f32)
    return y.to(u.dtype)[None], final
