"""Kimi-Linear's Kimi Delta Attention (``KimiLinearDeltaAttention``): the kind ``kda``.

Under context parallelism (:func:`kda_shard_forward`) the projections, the forget gate and
the gated output norm run on this rank's shard of every row (per token, per head); q/k/v
before the conv, the per-channel decay and ``beta`` go to whole rows of ``H / cp`` heads,
where conv and KDA run unchanged, and the output comes back. Heads that do not divide over
the ranks are refused.
"""

from __future__ import annotations

from typing import Any

import torch

from treepack.trainer.hf.layers.spec import ContextShard, TreeLayer, check_rows, check_shard_rows, conv1d_width
from treepack.trainer.hf.layers.stock import depthwise_conv, has_attrs
from treepack.trainer.kernels.cp import divide_refusal, rows_of_heads, shards_of_heads, tree_conv_heads
from treepack.trainer.kernels.kda import tree_kda
from treepack.trainer.kernels.tree_scan import TreeSchedule, tree_conv

__all__ = ["LAYERS", "KDA", "kda_tree_forward", "kda_shard_forward"]


def _structure(module: torch.nn.Module) -> bool:
    gate = getattr(module, "forget_gate", None)
    return (
        has_attrs(
            module,
            "q_proj",
            "k_proj",
            "v_proj",
            "b_proj",
            "g_a_proj",
            "g_b_proj",
            "o_norm",
            "o_proj",
            "head_dim",
            "qkv_dim",
        )
        and depthwise_conv(getattr(module, "conv1d", None))
        and isinstance(getattr(gate, "A_log", None), torch.Tensor)
    )


def kda_tree_forward(layer: torch.nn.Module, hidden_states: torch.Tensor, schedule: TreeSchedule) -> torch.Tensor:
    """Kimi-Linear's KDA layer on tree rows.

    Same q/k/v projections, conv activation, per-channel forget gate (``layer.forget_gate``,
    pointwise), ``beta = sigmoid(b_proj)``, in-kernel q/k L2 norm, sigmoid-gated RMSNorm and
    output projection as the stock layer; conv and the delta rule follow the tree.

    Args:
        layer: a ``KimiLinearDeltaAttention``.
        hidden_states: [K, L, hidden] packed rows.
        schedule: the batch's tree schedule.

    Returns:
        [K, L, hidden].
    """
    K, L = check_rows(hidden_states, schedule)
    N, hd = K * L, layer.head_dim
    mixed = torch.cat([layer.q_proj(hidden_states), layer.k_proj(hidden_states), layer.v_proj(hidden_states)], dim=-1)
    conv = tree_conv(
        mixed.reshape(N, -1), layer.conv1d.weight.squeeze(1), layer.conv1d.bias, schedule, activation=layer.activation
    )
    q, k, v = (x.reshape(N, -1, hd) for x in torch.split(conv.to(mixed.dtype), [layer.qkv_dim] * 3, dim=-1))
    g = layer.forget_gate(hidden_states).reshape(N, -1, hd)
    beta = torch.sigmoid(layer.b_proj(hidden_states)).reshape(N, -1)
    o = tree_kda(q, k, v, g, beta, schedule, use_qk_l2norm_in_kernel=True)
    gate = layer.g_b_proj(layer.g_a_proj(hidden_states)).reshape(K, L, -1, hd)
    return layer.o_proj(layer.o_norm(o.reshape(K, L, -1, hd), gate).reshape(K, L, -1))


def kda_shard_forward(
    layer: torch.nn.Module, hidden_states: torch.Tensor, schedule: TreeSchedule, batch: Any
) -> torch.Tensor:
    """Kimi-Linear's KDA layer on one context-parallel shard (module docstring).

    Args:
        layer: a ``KimiLinearDeltaAttention``.
        hidden_states: [K, Ls, hidden] this rank's shard of every row.
        schedule: the whole rows' tree schedule. batch: the CP shard.

    Returns:
        [K, Ls, hidden].
    """
    K, Ls = check_shard_rows(hidden_states, batch)
    cp, C, hd = batch.cp, batch.plan.seq_len, layer.head_dim
    parts = [proj(hidden_states).reshape(K, Ls, -1, hd) for proj in (layer.q_proj, layer.k_proj, layer.v_proj)]
    q, k, v = tree_conv_heads(
        parts, layer.conv1d.weight.squeeze(1), layer.conv1d.bias, schedule, cp, C, layer.activation
    )
    g = rows_of_heads(layer.forget_gate(hidden_states).reshape(K, Ls, -1, hd), cp, C)
    beta = rows_of_heads(torch.sigmoid(layer.b_proj(hidden_states)).reshape(K, Ls, -1, 1), cp, C)[..., 0]
    o = shards_of_heads(tree_kda(q, k, v, g, beta, schedule, use_qk_l2norm_in_kernel=True), cp, K, Ls)
    gate = layer.g_b_proj(layer.g_a_proj(hidden_states)).reshape(K, Ls, -1, hd)
    return layer.o_proj(layer.o_norm(o, gate).reshape(K, Ls, -1))


KDA = TreeLayer(
    kind="kda",
    structure=_structure,
    stock=(("transformers.models.kimi_linear.modeling_kimi_linear", "KimiLinearDeltaAttention"),),
    tree_forward=kda_tree_forward,
    conv_width=conv1d_width,
    shard=ContextShard(
        forward=kda_shard_forward, refusal=lambda layer, cp_size: divide_refusal("heads", layer.num_heads, cp_size)
    ),
)
LAYERS = (KDA,)
