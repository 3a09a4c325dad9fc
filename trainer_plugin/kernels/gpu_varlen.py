"""GPU kernels behind the stock signatures that the per-mixer tree paths call.

The mixers' tree paths (``tree_ssd_scan``, ``tree_selective_scan``, ``tree_conv``, ...) call
one function per depth level with the stock kernel's signature, extended where the tree
needs it; their ``select_*`` dispatch points can return these on CUDA tensors:

- :func:`mamba_chunk_scan_varlen`: ``mamba_chunk_scan_combined``'s signature with one
  initial state per varlen sequence (``cu_seqlens`` or ``seq_idx``) and
  ``return_varlen_states`` differentiable; runs :func:`~treepack.trainer.kernels.gpu_ssm.mamba2_level`.
- :func:`selective_scan_with_state`: ``selective_scan_fn``'s signature whose
  ``last_state`` carries gradients. The CUDA kernel's does not ("the gradient of the
  last state is not considered in the backward pass"), so a tree path that forks the
  parent's last state through it would drop every child's gradient into the parent; here
  the last state is recomputed in torch from the padded batch (dt = 0 pads write nothing).
- :func:`causal_conv1d_varlen`: ``causal_conv1d_fn``'s signature; causal-conv1d's CUDA
  kernel where it imports, else fla's Triton ``causal_conv1d`` over the same ``seq_idx``
  runs (a lent GPU machine may have fla but no causal-conv1d build).

fla's ``chunk_gated_delta_rule`` and ``chunk_kda`` already take per-sequence states:
:func:`~treepack.trainer.kernels.gpu.gated_delta_rule_level` and
:func:`~treepack.trainer.kernels.gpu.kda_level` are their drop-ins. Every function takes
``kernel=`` (a stand-in with the stock signature, for CPU tests).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from treepack.trainer.kernels.gpu import load_kernel
from treepack.trainer.kernels.gpu_ssm import mamba2_level

__all__ = ["mamba_chunk_scan_varlen", "selective_scan_with_state", "causal_conv1d_varlen", "seq_idx_to_cu_seqlens"]


def seq_idx_to_cu_seqlens(seq_idx: torch.Tensor) -> torch.Tensor:
    """[1, L] non-decreasing sequence ids -> [n+1] int64 boundaries (a run of one id = one sequence)."""
    ids = seq_idx.reshape(-1)
    if ids.numel() == 0:
        return torch.zeros(1, dtype=torch.int64, device=ids.device)
    cut = torch.nonzero(ids[1:] != ids[:-1]).flatten() + 1
    edge = torch.tensor([0], device=ids.device)
    return torch.cat([edge, cut, edge + ids.numel()]).long()


def mamba_chunk_scan_varlen(
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
    kernel=None,
):
    """``mamba_chunk_scan_combined`` with per-sequence ``initial_states [n, H, P, N]``.

    Args: as mamba_ssm's (batch 1 with ``cu_seqlens`` or ``seq_idx``; else each batch row
    is one sequence). Returns: as mamba_ssm's: ``out``, then the last sequence's final state
    when ``return_final_states``, then every sequence's ``[n, H, P, N]`` when
    ``return_varlen_states`` (both differentiable).
    """
    b, L = x.shape[:2]
    if cu_seqlens is None and seq_idx is not None:
        cu_seqlens = seq_idx_to_cu_seqlens(seq_idx)
    if cu_seqlens is None:  # batch rows are the sequences
        cu_seqlens = torch.arange(b + 1, device=x.device) * L
        flat = [t.reshape(1, b * L, *t.shape[2:]) if t is not None else None for t in (x, dt, B, C, z)]
    else:
        if b != 1:
            raise ValueError(f"varlen input must have batch 1, got x of shape {tuple(x.shape)}")
        flat = [x, dt, B, C, z]
    xs, dts, Bs, Cs, zs = flat
    y, finals = mamba2_level(
        xs,
        dts,
        A,
        Bs,
        Cs,
        chunk_size=chunk_size,
        D=D,
        z=zs,
        dt_bias=dt_bias,
        dt_softplus=dt_softplus,
        dt_limit=dt_limit,
        initial_state=initial_states,
        cu_seqlens=cu_seqlens,
        kernel=kernel,
    )
    out = y.reshape(x.shape)
    rest = ([finals[-1:] if b == 1 else finals] if return_final_states else []) + (
        [finals] if return_varlen_states else []
    )
    return (out, *rest) if rest else out


def selective_scan_with_state(
    u, delta, A, B, C, D=None, z=None, delta_bias=None, delta_softplus=False, return_last_state=False, kernel=None
):
    """``selective_scan_fn`` whose last state is differentiable (module docstring).

    Args: as mamba_ssm's: u, delta [b, Dm, L]; A [Dm, N]; B, C [b, N, L]; D [Dm];
    z [b, Dm, L]; delta_bias [Dm]. Returns ``out`` or ``(out, last_state [b, Dm, N])``; the
    last state is computed in at least fp32 with ``O(b * Dm * N * L)`` memory.
    """
    fn = kernel or load_kernel("mamba_ssm.selective_scan_fn")
    out = fn(u, delta, A, B, C, D=D, z=z, delta_bias=delta_bias, delta_softplus=delta_softplus)
    if not return_last_state:
        return out
    ct = torch.promote_types(u.dtype, torch.float32)
    dt = delta.to(ct) + (0 if delta_bias is None else delta_bias.to(ct)[:, None])
    dt = F.softplus(dt) if delta_softplus else dt
    if B.dim() != 3:
        raise ValueError(f"B must be [b, N, L] (one group), got {tuple(B.shape)}")
    cum = dt.cumsum(-1)  # [b, Dm, L]
    tail = torch.exp(A.to(ct)[None, :, :, None] * (cum[:, :, None, -1:] - cum[:, :, None, :]))  # [b, Dm, N, L]
    last = torch.einsum("bdnl,bdl,bnl->bdn", tail, dt * u.to(ct), B.to(ct))
    return out, last


def causal_conv1d_varlen(
    x,
    weight,
    bias=None,
    seq_idx=None,
    initial_states=None,
    return_final_states=False,
    final_states_out=None,
    activation=None,
    kernel=None,
    backend="auto",
):
    """``causal_conv1d_fn`` (x [b, D, L] -> [b, D, L]); fla's Triton conv when causal-conv1d is absent.

    ``backend``: ``causal_conv1d``, ``fla`` or ``auto``. The fla path takes no
    ``initial_states`` / final states (the tree path prefixes the context instead).
    """
    if backend == "auto":
        try:
            load_kernel("causal_conv1d.causal_conv1d_fn")
            backend = "causal_conv1d"
        except ImportError:
            backend = "fla"
    if backend == "causal_conv1d":
        fn = kernel or load_kernel("causal_conv1d.causal_conv1d_fn")
        return fn(
            x,
            weight,
            bias,
            seq_idx=seq_idx,
            initial_states=initial_states,
            return_final_states=return_final_states,
            final_states_out=final_states_out,
            activation=activation,
        )
    if initial_states is not None or return_final_states:
        raise ValueError("the fla conv path takes no initial_states / final states: prefix the context tokens")
    fn = kernel or load_kernel("fla.causal_conv1d")
    b, Dc, L = x.shape
    if seq_idx is None:
        cu = torch.arange(b + 1, device=x.device) * L
    elif b == 1:
        cu = seq_idx_to_cu_seqlens(seq_idx)
    else:
        raise ValueError(f"seq_idx needs batch 1, got x of shape {tuple(x.shape)}")
    y, _ = fn(x.transpose(1, 2).reshape(1, b * L, Dc), weight, bias, activation=activation, cu_seqlens=cu.long())
    return y.reshape(b, L, Dc).transpose(1, 2)
