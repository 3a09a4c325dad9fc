"""LFM2's gated short convolution (``Lfm2ShortConv``, ``Lfm2MoeShortConv``): the kind ``short_conv``."""

from __future__ import annotations

import torch

from treepack.trainer.hf.layers.spec import TreeLayer, check_rows, conv1d_width
from treepack.trainer.hf.layers.stock import depthwise_conv, has_attrs
from treepack.trainer.kernels.tree_scan import TreeSchedule, tree_conv

__all__ = ["LAYERS", "SHORT_CONV", "short_conv_tree_forward"]


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


def short_conv_tree_forward(layer: torch.nn.Module, hidden_states: torch.Tensor, schedule: TreeSchedule) -> torch.Tensor:
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


SHORT_CONV = TreeLayer(
    kind="short_conv",
    structure=_structure,
    stock=(
        ("transformers.models.lfm2.modeling_lfm2", "Lfm2ShortConv"),
        ("transformers.models.lfm2_moe.modeling_lfm2_moe", "Lfm2MoeShortConv"),
    ),
    tree_forward=short_conv_tree_forward,
    conv_width=conv1d_width,
)
LAYERS = (SHORT_CONV,)
