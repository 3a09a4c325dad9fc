"""Jamba's Mamba (S6) mixer (``JambaMambaMixer``: RMS norms on dt, B and C): the kind ``mamba``.

A structure match whose code differs (the pure ``MambaMixer`` and ``FalconMambaMixer``:
no dt/B/C norms) has this kind and is not handled.

Under context parallelism (:func:`mamba_shard_forward`) channels are independent in the
conv and the scan, but ``x_proj`` (dt, B and C) reads every channel of a token: the
projections run on this rank's shard of every row, the conv on whole rows of
``channels / cp`` channels (an all-to-all), its output goes back to the shard for
``x_proj`` and the dt/B/C norms, then dt and the gate go to the rank's channels again,
B and C (shared by every channel) are gathered whole, and the scan runs there with this
rank's slices of ``A``, ``D`` and the dt bias. Channels that do not divide are refused.
"""

from __future__ import annotations

from typing import Any

import torch

from treepack.trainer.hf.layers.spec import ContextShard, TreeLayer, check_rows, check_shard_rows, conv1d_width
from treepack.trainer.hf.layers.stock import depthwise_conv, has_attrs
from treepack.trainer.kernels.cp import (
    divide_refusal,
    gather_seq,
    head_slice,
    rows_of_heads,
    shards_of_heads,
    tree_conv_heads,
)
from treepack.trainer.kernels.mamba import tree_selective_scan
from treepack.trainer.kernels.tree_scan import TreeSchedule, tree_conv

__all__ = ["LAYERS", "MAMBA", "mamba_tree_forward", "mamba_shard_forward"]


def _structure(module: torch.nn.Module) -> bool:
    A_log = getattr(module, "A_log", None)
    return (
        has_attrs(
            module,
            "in_proj",
            "x_proj",
            "dt_proj",
            "out_proj",
            "D",
            "time_step_rank",
            "ssm_state_size",
            "intermediate_size",
        )
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
    x = tree_conv(xBC, layer.conv1d.weight.squeeze(1), layer.conv1d.bias, schedule, activation=layer.activation).to(
        xBC.dtype
    )
    ts, B, C = torch.split(layer.x_proj(x), [layer.time_step_rank, layer.ssm_state_size, layer.ssm_state_size], dim=-1)
    ts, B, C = layer.dt_layernorm(ts), layer.b_layernorm(B), layer.c_layernorm(C)
    dt = ts @ layer.dt_proj.weight.T
    bias = layer.dt_proj.bias.float() if layer.dt_proj.bias is not None else None
    A = -torch.exp(layer.A_log.float())
    y = tree_selective_scan(x, dt, A, B, C, schedule, D=layer.D.float(), z=gate, delta_bias=bias, delta_softplus=True)
    return layer.out_proj(y.reshape(K, L, -1).to(dtype))


def mamba_shard_forward(
    layer: torch.nn.Module, hidden_states: torch.Tensor, schedule: TreeSchedule, batch: Any
) -> torch.Tensor:
    """Jamba's Mamba mixer on one context-parallel shard (module docstring).

    Args:
        layer: a ``JambaMambaMixer``.
        hidden_states: [K, Ls, hidden] this rank's shard of every row.
        schedule: the whole rows' tree schedule. batch: the CP shard.

    Returns:
        [K, Ls, hidden].
    """
    K, Ls = check_shard_rows(hidden_states, batch)
    cp, Cl, dtype = batch.cp, batch.plan.seq_len, hidden_states.dtype
    P, N = cp.size, K * Cl
    xBC, gate = layer.in_proj(hidden_states).chunk(2, dim=-1)
    (x,) = tree_conv_heads(
        [xBC.reshape(K, Ls, P, -1)],
        layer.conv1d.weight.squeeze(1),
        layer.conv1d.bias,
        schedule,
        cp,
        Cl,
        layer.activation,
    )
    xs = shards_of_heads(x, cp, K, Ls).reshape(K, Ls, -1)  # x_proj reads every channel of a token
    ts, B, C = torch.split(layer.x_proj(xs), [layer.time_step_rank, layer.ssm_state_size, layer.ssm_state_size], dim=-1)
    ts, B, C = layer.dt_layernorm(ts), layer.b_layernorm(B), layer.c_layernorm(C)
    dt = rows_of_heads((ts @ layer.dt_proj.weight.T).reshape(K, Ls, P, -1), cp, Cl).reshape(N, -1)
    z = rows_of_heads(gate.reshape(K, Ls, P, -1), cp, Cl).reshape(N, -1)
    B, C = (gather_seq(t, cp)[:, :Cl].reshape(N, -1) for t in (B, C))
    mine = head_slice(layer.intermediate_size, cp)
    bias = layer.dt_proj.bias.float()[mine] if layer.dt_proj.bias is not None else None
    A = -torch.exp(layer.A_log.float())[mine]
    y = tree_selective_scan(
        x.reshape(N, -1), dt, A, B, C, schedule, D=layer.D.float()[mine], z=z, delta_bias=bias, delta_softplus=True
    )
    y = shards_of_heads(y.reshape(N, 1, -1), cp, K, Ls).reshape(K, Ls, -1)
    return layer.out_proj(y.to(dtype))


MAMBA = TreeLayer(
    kind="mamba",
    structure=_structure,
    stock=(("transformers.models.jamba.modeling_jamba", "JambaMambaMixer"),),
    tree_forward=mamba_tree_forward,
    conv_width=conv1d_width,
    shard=ContextShard(
        forward=mamba_shard_forward,
        refusal=lambda layer, cp_size: divide_refusal("channels", layer.intermediate_size, cp_size),
    ),
)
LAYERS = (MAMBA,)
