"""Depthwise causal 1-D convolutions with causal-conv1d's ``causal_conv1d_fn`` signature.

The short convolution in front of every recurrent mixer (Mamba, Mamba2, GDN, KDA) and the
gated short convolution of LFM2 are depthwise and causal: ``y[d, t] = bias[d] +
sum_j weight[d, j] * x[d, t - (W-1) + j]``, inputs before a sequence's start being its
``initial_states`` (zeros by default). With ``seq_idx`` (mamba_ssm / causal-conv1d's
varlen convention: the sequence number of every column) no window reaches into another
sequence.

- :func:`torch_causal_conv1d`: vectorized, W shifted multiply-adds (the CPU path of
  :func:`~treepack.trainer.kernels.tree_scan.tree_conv`).
- :func:`naive_causal_conv1d`: one output at a time, walking back along the sequence.

Both compute in at least fp32 (fp64 stays fp64) and differentiate with respect to every
input. :func:`torch_gated_short_conv` is LFM2's operator (``C * conv(B * x)``) on ``[B, D, L]``.
"""

from __future__ import annotations

from typing import Literal, overload

import torch
import torch.nn.functional as F

from treepack.proto.errors import InputTypeError, RequestError
from treepack.trainer.kernels.gpu import load_kernel
from treepack.trainer.kernels.gpu_varlen import causal_conv1d_varlen

__all__ = [
    "select_causal_conv1d",
    "gpu_kernel_available",
    "torch_causal_conv1d",
    "naive_causal_conv1d",
    "torch_gated_short_conv",
    "check_conv_args",
]

ACTIVATIONS = (None, "silu", "swish")


def check_conv_args(
    ok_shape: bool, weight: torch.Tensor, D: int, bias: torch.Tensor | None, activation: str | None
) -> None:
    """Validate a depthwise conv's weight, bias and activation against D channels.

    Raises:
        InputTypeError: a non-tensor weight.
        RequestError: a wrong shape or an unknown activation, naming the argument.
    """
    if not isinstance(weight, torch.Tensor):
        raise InputTypeError(f"expected a torch.Tensor, got {type(weight).__name__}", path="$.weight", rule="type")
    if not ok_shape:
        raise RequestError("x has the wrong number of dimensions", path="$.x", rule="shape")
    if weight.dim() != 2 or weight.shape[0] != D or weight.shape[1] < 1:
        raise RequestError(
            f"weight must be [D, W] with D = {D}, got {tuple(weight.shape)}", path="$.weight", rule="shape"
        )
    if bias is not None and tuple(bias.shape) != (D,):
        raise RequestError(f"bias must be [D] = ({D},), got {tuple(bias.shape)}", path="$.bias", rule="shape")
    if activation not in ACTIVATIONS:
        raise RequestError(
            f"activation must be None, 'silu' or 'swish', got {activation!r}", path="$.activation", rule="enum"
        )


def _activate(y: torch.Tensor, activation: str | None) -> torch.Tensor:
    return y if activation is None else F.silu(y)


def _prepare(x, weight, bias, seq_idx, initial_states, activation):
    check_conv_args(x.dim() == 3, weight, x.shape[1] if x.dim() == 3 else -1, bias, activation)
    Bsz, D, L = x.shape
    W = weight.shape[1]
    if seq_idx is not None and tuple(seq_idx.shape) != (Bsz, L):
        raise RequestError(
            f"seq_idx must be [B, L] = {(Bsz, L)}, got {tuple(seq_idx.shape)}", path="$.seq_idx", rule="shape"
        )
    if initial_states is not None:
        if seq_idx is not None:
            raise RequestError(
                "initial_states and seq_idx cannot be combined (as in causal-conv1d)",
                path="$.initial_states",
                rule="unsupported",
            )
        if tuple(initial_states.shape) != (Bsz, D, W - 1):
            raise RequestError(
                f"initial_states must be [B, D, W-1] = {(Bsz, D, W - 1)}, got {tuple(initial_states.shape)}",
                path="$.initial_states",
                rule="shape",
            )
    dt = torch.promote_types(torch.promote_types(x.dtype, weight.dtype), torch.float32)
    front = x.new_zeros(Bsz, D, W - 1, dtype=dt) if initial_states is None else initial_states.to(dt)
    return torch.cat([front, x.to(dt)], dim=-1), weight.to(dt), dt


@overload
def torch_causal_conv1d(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = ...,
    seq_idx: torch.Tensor | None = ...,
    initial_states: torch.Tensor | None = ...,
    return_final_states: Literal[False] = ...,
    activation: str | None = ...,
) -> torch.Tensor: ...
@overload
def torch_causal_conv1d(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = ...,
    seq_idx: torch.Tensor | None = ...,
    initial_states: torch.Tensor | None = ...,
    *,
    return_final_states: Literal[True],
    activation: str | None = ...,
) -> tuple[torch.Tensor, torch.Tensor]: ...
@overload
def torch_causal_conv1d(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = ...,
    seq_idx: torch.Tensor | None = ...,
    initial_states: torch.Tensor | None = ...,
    return_final_states: bool = ...,
    activation: str | None = ...,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]: ...
def torch_causal_conv1d(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    seq_idx: torch.Tensor | None = None,
    initial_states: torch.Tensor | None = None,
    return_final_states: bool = False,
    activation: str | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Depthwise causal conv, vectorized over taps.

    Args:
        x: [B, D, L] inputs.
        weight: [D, W] taps, oldest first.
        bias: [D] or None.
        seq_idx: [B, L] int sequence number of every column (varlen), or None.
        initial_states: [B, D, W-1] inputs before column 0 (not with ``seq_idx``), or None.
        return_final_states: also return the last W-1 inputs of each batch row.
        activation: None, ``silu`` or ``swish``.

    Returns:
        y [B, D, L] in x's dtype, or (y, final_states [B, D, W-1]).
    """
    xp, w, _ = _prepare(x, weight, bias, seq_idx, initial_states, activation)
    L, W = x.shape[-1], weight.shape[1]
    y = xp[:, :, W - 1 :] * w[:, W - 1, None]
    for j in range(W - 1):
        tap = xp[:, :, j : j + L] * w[:, j, None]
        if seq_idx is not None:  # column t reads t - (W-1) + j: same sequence only
            back = W - 1 - j
            same = torch.zeros_like(seq_idx, dtype=torch.bool)
            same[:, back:] = seq_idx[:, back:] == seq_idx[:, :-back]
            tap = tap * same[:, None, :].to(tap.dtype)
        y = y + tap
    if bias is not None:
        y = y + bias.to(y.dtype)[:, None]
    y = _activate(y, activation).to(x.dtype)
    return (y, xp[:, :, xp.shape[-1] - (W - 1) :]) if return_final_states else y


def naive_causal_conv1d(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    seq_idx: torch.Tensor | None = None,
    initial_states: torch.Tensor | None = None,
    return_final_states: bool = False,
    activation: str | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Reference for :func:`torch_causal_conv1d`: every output from its own window, token by token."""
    xp, w, dt = _prepare(x, weight, bias, seq_idx, initial_states, activation)
    Bsz, D, L = x.shape
    W = weight.shape[1]
    cols = []
    for b in range(Bsz):
        row = []
        for t in range(L):
            acc = torch.zeros(D, dtype=dt, device=x.device) if bias is None else bias.to(dt).clone()
            for j in range(W):
                src = t - (W - 1) + j
                if seq_idx is not None and (src < 0 or int(seq_idx[b, src]) != int(seq_idx[b, t])):
                    continue
                acc = acc + w[:, j] * xp[b, :, src + W - 1]
            row.append(_activate(acc, activation))
        cols.append(torch.stack(row, dim=-1) if row else xp.new_zeros(D, 0))
    y = torch.stack(cols).to(x.dtype)
    return (y, xp[:, :, xp.shape[-1] - (W - 1) :]) if return_final_states else y


def torch_gated_short_conv(
    BCx: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, seq_idx: torch.Tensor | None = None
) -> torch.Tensor:
    """LFM2's gated short convolution: ``C * conv(B * x)`` with ``B, C, x = BCx.chunk(3, dim=1)``.

    Args:
        BCx: [B, 3D, L] the in-projection, channels first.
        weight: [D, W]; bias: [D] or None; seq_idx: as :func:`torch_causal_conv1d`.

    Returns:
        [B, D, L].
    """
    Bg, Cg, x = BCx.chunk(3, dim=-2)
    return Cg * torch_causal_conv1d(Bg * x, weight, bias, seq_idx=seq_idx)


def gpu_kernel_available(*names: str) -> bool:
    """True when one of the GPU kernels ``names`` (:data:`~treepack.trainer.kernels.gpu.KERNELS`) imports here."""
    for n in names:
        try:
            load_kernel(n)
            return True
        except ImportError:
            continue
    return False


def select_causal_conv1d(x: torch.Tensor):
    """The conv kernel for tensors like ``x``, with ``causal_conv1d_fn``'s signature.

    CUDA with causal-conv1d (or fla's Triton conv) importable:
    :func:`~treepack.trainer.kernels.gpu_varlen.causal_conv1d_varlen`; else
    :func:`torch_causal_conv1d`.
    """
    if x.is_cuda and gpu_kernel_available("causal_conv1d.causal_conv1d_fn", "fla.causal_conv1d"):
        return causal_conv1d_varlen
    return torch_causal_conv1d
