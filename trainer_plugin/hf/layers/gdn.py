"""Gated DeltaNet (Qwen3-Next, Qwen3.5): the kind ``gdn``.

The stock forward scans each row as one sequence; on tree rows the same projections run,
then :func:`~treepack.trainer.kernels.gdn.tree_causal_conv1d` and
:func:`~treepack.trainer.kernels.gdn.tree_gated_delta_rule` over the batch's tree
schedule. The stock classes are patched by name; a renamed copy or subclass that keeps the
stock forward is found by mechanism.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from treepack.trainer.hf.layers.spec import TreeLayer, check_rows, conv1d_width
from treepack.trainer.hf.layers.stock import depthwise_conv, has_attrs
from treepack.trainer.kernels.gdn import tree_causal_conv1d, tree_gated_delta_rule
from treepack.trainer.kernels.tree_scan import TreeSchedule

__all__ = ["LAYERS", "GDN", "gdn_layer_tree_forward", "gdn_params"]


def gdn_params(module: torch.nn.Module) -> bool:
    """The parameters every Gated DeltaNet layer has: a 1-D ``A_log``, ``dt_bias``, head sizes, a depthwise conv."""
    A_log = getattr(module, "A_log", None)
    return (
        isinstance(A_log, torch.Tensor)
        and A_log.dim() == 1
        and has_attrs(module, "dt_bias", "head_k_dim", "head_v_dim", "key_dim", "value_dim")
        and depthwise_conv(getattr(module, "conv1d", None))
    )


def _structure(module: torch.nn.Module) -> bool:
    return gdn_params(module) and (
        has_attrs(module, "in_proj_qkvz", "in_proj_ba", "norm", "out_proj") or has_attrs(module, "in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "norm", "out_proj")
    )


def _project(layer: torch.nn.Module, h: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """(mixed_qkv [K, L, conv_dim], z [K, L, Hv, dv], b [K, L, Hv], a [K, L, Hv]) as the stock forward."""
    K, L = h.shape[:2]
    if hasattr(layer, "in_proj_qkvz"):  # Qwen3-Next: interleaved per key-head group
        q, k, v, z, b, a = layer.fix_query_key_value_ordering(layer.in_proj_qkvz(h), layer.in_proj_ba(h))
        mixed = torch.cat([x.reshape(K, L, -1) for x in (q, k, v)], dim=-1)
        return mixed, z, b, a
    z = layer.in_proj_z(h).reshape(K, L, -1, layer.head_v_dim)  # Qwen3.5: separate projections
    return layer.in_proj_qkv(h), z, layer.in_proj_b(h), layer.in_proj_a(h)


def gdn_layer_tree_forward(layer: torch.nn.Module, hidden_states: torch.Tensor, schedule: TreeSchedule) -> torch.Tensor:
    """A stock HF Gated DeltaNet layer's forward on tree rows.

    Same projections, gating (``beta = sigmoid(b)``, ``g = -exp(A_log) * softplus(a +
    dt_bias)``), in-kernel q/k L2 norm and gated RMSNorm as the stock layer; the conv and
    the delta rule follow the tree instead of the row.

    Args:
        layer: a Qwen3-Next / Qwen3.5 GatedDeltaNet module.
        hidden_states: [K, L, hidden] packed rows.
        schedule: the batch's :class:`~treepack.trainer.kernels.tree_scan.TreeSchedule`.

    Returns:
        [K, L, hidden] the layer's output.
    """
    K, L = check_rows(hidden_states, schedule)
    N = K * L
    mixed, z, b, a = _project(layer, hidden_states)
    conv = tree_causal_conv1d(
        mixed.reshape(N, -1), layer.conv1d.weight.squeeze(1), layer.conv1d.bias, schedule, activation=layer.activation
    ).to(mixed.dtype)
    q, k, v = torch.split(conv, [layer.key_dim, layer.key_dim, layer.value_dim], dim=-1)
    q = q.reshape(N, -1, layer.head_k_dim)
    k = k.reshape(N, -1, layer.head_k_dim)
    v = v.reshape(N, -1, layer.head_v_dim)
    beta = b.sigmoid().reshape(N, -1)
    g = (-layer.A_log.float().exp() * F.softplus(a.float() + layer.dt_bias)).reshape(N, -1)
    core = tree_gated_delta_rule(q, k, v, g, beta, schedule, use_qk_l2norm_in_kernel=True)
    core = layer.norm(core.reshape(-1, layer.head_v_dim), z.reshape(-1, layer.head_v_dim))
    return layer.out_proj(core.reshape(K, L, -1))


GDN = TreeLayer(
    kind="gdn",
    structure=_structure,
    stock=(
        ("transformers.models.qwen3_next.modeling_qwen3_next", "Qwen3NextGatedDeltaNet"),
        ("transformers.models.qwen3_5.modeling_qwen3_5", "Qwen3_5GatedDeltaNet"),
        ("transformers.models.qwen3_5_moe.modeling_qwen3_5_moe", "Qwen3_5MoeGatedDeltaNet"),
    ),
    classes=("Qwen3NextGatedDeltaNet", "Qwen3_5GatedDeltaNet", "Qwen3_5MoeGatedDeltaNet"),
    tree_forward=gdn_layer_tree_forward,
    conv_width=conv1d_width,
)
LAYERS = (GDN,)
