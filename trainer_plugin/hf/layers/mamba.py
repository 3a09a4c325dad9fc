"""Jamba's Mamba (S6) mixer (``JambaMambaMixer``: RMS norms on dt, B and C): the kind ``mamba``.

A structure match whose code differs (the pure ``MambaMixer`` and ``FalconMambaMixer``:
no dt/B/C norms) has this kind and is not handled.
"""

from __future__ import annotations

import torch

from treepack.trainer.hf.layers.spec import TreeLayer, check_rows, conv1d_width
from treepack.trainer.hf.layers.stock import depthwise_conv, has_attrs
from treepack.trainer.kernels.mamba import tree_selective_scan
from treepack.trainer.kernels.tree_scan import TreeSchedule, tree_conv

__all__ = ["LAYERS", "MAMBA", "mamba_tree_forward"]


def _structure(module: torch.nn.Module) -> bool:
    A_log = getattr(module, "A_log", None)
    return (
        has_attrs(module, "in_proj", "x_proj", "dt_proj", "out_proj", "D", "time_step_rank", "ssm_state_size", "intermediate_size")
        and depthwise_conv(getattr(module, "conv1d", None))
        and isinstance(A_log, torch.Tensor)
        and A_log.dim() == 2
    )


def mamba_tree_forward(layer: torch.nn.Module, hidden_states: torch.Tensor, schedule: TreeSchedule) -> torch.Tensor:
    """Jamba's Mamba mixer (selective scan with RMS-normed dt, B, C) on tree rows.

    Same projections, conv activation, dt / B / C layer norms, ``dt_proj`` weight with its
    bias as the scan's ``delta_bias`` (softplus), D skip and z gate as the stock slow path;
    conv and scan follow the tree.

    Args:
        layer: a ``JambaMambaMixer``.
        hidden_states: [K, L, hidden] packed rows.
        schedule: the batch's tree schedule.

    Returns:
        [K, L, hidden].
    """
    K, L = check_rows(hidden_states, schedule)
    N, dtype = K * L, hidden_states.dtype
    xBC, gate = layer.in_proj(hidden_states).reshape(N, -1).chunk(2, dim=-1)
    x = tree_conv(xBC, layer.conv1d.weight.squeeze(1), layer.conv1d.bias, schedule, activation=layer.activation).to(xBC.dtype)
    ts, B, C = torch.split(layer.x_proj(x), [layer.time_step_rank, layer.ssm_state_size, layer.ssm_state_size], dim=-1)
    ts, B, C = layer.dt_layernorm(ts), layer.b_layernorm(B), layer.c_layernorm(C)
    dt = ts @ layer.dt_proj.weight.T
    bias = layer.dt_proj.bias.float() if layer.dt_proj.bias is not None else None
    A = -torch.exp(layer.A_log.float())
    y = tree_selective_scan(x, dt, A, B, C, schedule, D=layer.D.float(), z=gate, delta_bias=bias, delta_softplus=True)
    return layer.out_proj(y.reshape(K, L, -1).to(dtype))


MAMBA = TreeLayer(
    kind="mamba",
    structure=_structure,
    stock=(("transformers.models.jamba.modeling_jamba", "JambaMambaMixer"),),
    tree_forward=mamba_tree_forward,
    conv_width=conv1d_width,
)
LAYERS = (MAMBA,)
