"""A layer kind added from outside treepack's registry: this one module, plus its test.

``TinyConvMixer`` is a gated depthwise causal conv over time (``conv(x) * sigmoid(gate(x))``);
:data:`TINY_CONV` says how to recognise it (by structure), how it runs on tree rows
(:func:`~treepack.trainer.kernels.tree_scan.tree_conv` over the batch's tree schedule) and
which conv width it needs from the plan. ``register(TINY_CONV)`` is all it takes for
``check_model`` and ``patch_layers`` to take it.
"""

from __future__ import annotations

import torch

from treepack.trainer.hf.layers import TreeLayer
from treepack.trainer.hf.layers.spec import check_rows, conv1d_width
from treepack.trainer.hf.layers.stock import depthwise_conv
from treepack.trainer.kernels.tree_scan import TreeSchedule, tree_conv


class TinyConvMixer(torch.nn.Module):
    """Gated depthwise causal conv of width ``width`` over [B, L, hidden]."""

    def __init__(self, hidden: int, width: int) -> None:
        super().__init__()
        self.conv = torch.nn.Conv1d(hidden, hidden, width, groups=hidden, padding=width - 1)
        self.gate = torch.nn.Linear(hidden, hidden)

    def forward(self, hidden_states: torch.Tensor, **kwargs) -> torch.Tensor:
        L = hidden_states.shape[1]
        y = self.conv(hidden_states.transpose(1, 2))[..., :L].transpose(1, 2)
        return y * torch.sigmoid(self.gate(hidden_states))


def _structure(module: torch.nn.Module) -> bool:
    return (
        depthwise_conv(getattr(module, "conv", None))
        and isinstance(getattr(module, "gate", None), torch.nn.Linear)
        and not hasattr(module, "in_proj")
    )


def tiny_conv_tree_forward(layer: torch.nn.Module, hidden_states: torch.Tensor, schedule: TreeSchedule) -> torch.Tensor:
    """``TinyConvMixer`` on tree rows: the conv follows each token's ancestor chain."""
    K, L = check_rows(hidden_states, schedule)
    y = tree_conv(hidden_states.reshape(K * L, -1), layer.conv.weight.squeeze(1), layer.conv.bias, schedule).to(
        hidden_states.dtype
    )
    return y.reshape(K, L, -1) * torch.sigmoid(layer.gate(hidden_states))


TINY_CONV = TreeLayer(
    kind="tiny_conv",
    structure=_structure,
    stock=(("helpers.tiny_conv", "TinyConvMixer"),),
    tree_forward=tiny_conv_tree_forward,
    conv_width=conv1d_width,
)
