"""LFM2's gated short convolution (``Lfm2ShortConv``, ``Lfm2MoeShortConv``): the kind ``short_conv``.

Under context parallelism (:func:`short_conv_shard_forward`) the projections and gates run
on this rank's shard of every row; ``B * x`` goes to whole rows of ``channels / cp``
channels, the tree conv runs there, and the result comes back. Channels that do not divide
over the ranks are refused.
"""

from __future__ import annotations

from typing import Any

import torch

from treepack.trainer.hf.layers.spec import ContextShard, TreeLayer, check_rows, check_shard_rows, conv1d_width
from treepack.trainer.hf.layers.stock import depthwise_conv, has_attrs
from treepack.trainer.kernels.cp import divide_refusal, shards_of_heads, tree_conv_heads
from treepack.trainer.kernels.tree_scan import TreeSchedule, tree_conv

__all__ = ["LAYERS", "SHORT_CONV", "short_conv_tree_forward", "short_conv_shard_forward"]


def _structure(module: torch.nn.Module) -> bool:
    conv = getattr(module, "conv", None)
    in_proj = getattr(module, "in_proj", None)
    return (
        depthwise_conv(conv)
        and isinstance(in_proj, torch.nn.Linear)
        and in_proj.out_features == 3 * conv.in_channels
        and has_attrs(module, "out_proj")
        and getattr(module, "A_log", None) is None
    )


def short_conv_tree_forward(
    layer: torch.nn.Module, hidden_states: torch.Tensor, schedule: TreeSchedule
) -> torch.Tensor:
    """LFM2's gated short convolution (``out_proj(C * conv(B * x))``) on tree rows.

    Args:
        layer: an ``Lfm2ShortConv``-like module.
        hidden_states: [K, L, hidden] packed rows.
        schedule: the batch's tree schedule (its conv_width >= the layer's kernel).

    Returns:
        [K, L, hidden].
    """
    K, L = check_rows(hidden_states, schedule)
    B, C, x = layer.in_proj(hidden_states).chunk(3, dim=-1)
    Bx = (B * x).reshape(K * L, -1)
    conv = tree_conv(Bx, layer.conv.weight.squeeze(1), layer.conv.bias, schedule).to(Bx.dtype)
    return layer.out_proj(C * conv.reshape(K, L, -1))


def short_conv_shard_forward(
    layer: torch.nn.Module, hidden_states: torch.Tensor, schedule: TreeSchedule, batch: Any
) -> torch.Tensor:
    """LFM2's gated short convolution on one context-parallel shard (module docstring).

    Args:
        layer: an ``Lfm2ShortConv``-like module.
        hidden_states: [K, Ls, hidden] this rank's shard of every row.
        schedule: the whole rows' tree schedule. batch: the CP shard.

    Returns:
        [K, Ls, hidden].
    """
    K, Ls = check_shard_rows(hidden_states, batch)
    B, C, x = layer.in_proj(hidden_states).chunk(3, dim=-1)
    Bx = (B * x).reshape(K, Ls, batch.cp.size, -1)  # rank r's channels as its one "head"
    (conv,) = tree_conv_heads(
        [Bx], layer.conv.weight.squeeze(1), layer.conv.bias, schedule, batch.cp, batch.plan.seq_len
    )
    conv = shards_of_heads(conv, batch.cp, K, Ls).reshape(K, Ls, -1)
    return layer.out_proj(C * conv)


SHORT_CONV = TreeLayer(
    kind="short_conv",
    structure=_structure,
    stock=(
        ("transformers.models.lfm2.modeling_lfm2", "Lfm2ShortConv"),
        ("transformers.models.lfm2_moe.modeling_lfm2_moe", "Lfm2MoeShortConv"),
    ),
    tree_forward=short_conv_tree_forward,
    conv_width=conv1d_width,
    shard=ContextShard(
        forward=short_conv_shard_forward,
        refusal=lambda layer, cp_size: divide_refusal("conv channels", layer.conv.in_channels, cp_size),
    ),
)
LAYERS = (SHORT_CONV,)
