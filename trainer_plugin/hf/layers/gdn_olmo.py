"""OLMo-hybrid's Gated DeltaNet variant (``OlmoHybridGatedDeltaNet``): the kind ``gdn_olmo``.

Separate q/k/v/a/b/g projections, a ``g_proj`` output gate and optional negative
eigenvalues; conv and delta rule follow the tree (:mod:`treepack.trainer.kernels.gdn`).
Under context parallelism the projections and the output norm run on the rank's shard and
the conv and delta rule on whole rows of its heads (:func:`~treepack.trainer.hf.layers.gdn.gated_delta_shard`).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from treepack.trainer.hf.layers.gdn import gated_delta_shard, gdn_params, gdn_shard_refusal
from treepack.trainer.hf.layers.spec import ContextShard, TreeLayer, check_rows, check_shard_rows, conv1d_width
from treepack.trainer.hf.layers.stock import has_attrs
from treepack.trainer.kernels.gdn import tree_causal_conv1d, tree_gated_delta_rule
from treepack.trainer.kernels.tree_scan import TreeSchedule

__all__ = ["LAYERS", "GDN_OLMO", "olmo_gdn_tree_forward", "olmo_gdn_shard_forward"]


def _structure(module: torch.nn.Module) -> bool:
    return gdn_params(module) and has_attrs(
        module, "q_proj", "k_proj", "v_proj", "a_proj", "b_proj", "g_proj", "o_norm", "o_proj"
    )


def olmo_gdn_tree_forward(layer: torch.nn.Module, hidden_states: torch.Tensor, schedule: TreeSchedule) -> torch.Tensor:
    """OLMo-hybrid's Gated DeltaNet variant on tree rows.

    Separate q/k/v/a/b/g projections, ``beta = sigmoid(b)`` (times 2 with
    ``allow_neg_eigval``), ``g = -exp(A_log) * softplus(a + dt_bias)``, in-kernel q/k L2
    norm, norm-before-gate RMSNorm with the ``g_proj`` gate, as the stock layer; conv and
    delta rule follow the tree.

    Args:
        layer: an ``OlmoHybridGatedDeltaNet``.
        hidden_states: [K, L, hidden] packed rows.
        schedule: the batch's tree schedule.

    Returns:
        [K, L, hidden].
    """
    K, L = check_rows(hidden_states, schedule)
    N = K * L
    mixed = torch.cat([layer.q_proj(hidden_states), layer.k_proj(hidden_states), layer.v_proj(hidden_states)], dim=-1)
    conv = tree_causal_conv1d(
        mixed.reshape(N, -1), layer.conv1d.weight.squeeze(1), layer.conv1d.bias, schedule, activation=layer.activation
    )
    q, k, v = torch.split(conv.to(mixed.dtype), [layer.key_dim, layer.key_dim, layer.value_dim], dim=-1)
    beta = layer.b_proj(hidden_states).sigmoid()
    if layer.allow_neg_eigval:
        beta = beta * 2.0
    g = -layer.A_log.float().exp() * F.softplus(layer.a_proj(hidden_states).float() + layer.dt_bias)
    o = tree_gated_delta_rule(
        q.reshape(N, -1, layer.head_k_dim),
        k.reshape(N, -1, layer.head_k_dim),
        v.reshape(N, -1, layer.head_v_dim),
        g.reshape(N, -1),
        beta.reshape(N, -1),
        schedule,
        use_qk_l2norm_in_kernel=True,
    )
    gate = layer.g_proj(hidden_states).reshape(-1, layer.head_v_dim)
    o = layer.o_norm(o.reshape(-1, layer.head_v_dim), gate).reshape(K, L, -1)
    return layer.o_proj(o)


def olmo_gdn_shard_forward(
    layer: torch.nn.Module, hidden_states: torch.Tensor, schedule: TreeSchedule, batch: Any
) -> torch.Tensor:
    """OLMo-hybrid's Gated DeltaNet variant on one context-parallel shard.

    Args:
        layer: an ``OlmoHybridGatedDeltaNet``.
        hidden_states: [K, Ls, hidden] this rank's shard of every row.
        schedule: the whole rows' tree schedule. batch: the CP shard.

    Returns:
        [K, Ls, hidden].
    """
    K, Ls = check_shard_rows(hidden_states, batch)
    hk, hv = layer.head_k_dim, layer.head_v_dim
    q, k, v = (
        proj(hidden_states).reshape(K, Ls, -1, d)
        for proj, d in ((layer.q_proj, hk), (layer.k_proj, hk), (layer.v_proj, hv))
    )
    beta = layer.b_proj(hidden_states).sigmoid()
    if layer.allow_neg_eigval:
        beta = beta * 2.0
    g = -layer.A_log.float().exp() * F.softplus(layer.a_proj(hidden_states).float() + layer.dt_bias)
    o = gated_delta_shard(layer, q, k, v, g.reshape(K, Ls, -1), beta.reshape(K, Ls, -1), schedule, batch)
    gate = layer.g_proj(hidden_states).reshape(-1, hv)
    return layer.o_proj(layer.o_norm(o.reshape(-1, hv), gate).reshape(K, Ls, -1))


GDN_OLMO = TreeLayer(
    kind="gdn_olmo",
    structure=_structure,
    stock=(("transformers.models.olmo_hybrid.modeling_olmo_hybrid", "OlmoHybridGatedDeltaNet"),),
    tree_forward=olmo_gdn_tree_forward,
    conv_width=conv1d_width,
    shard=ContextShard(forward=olmo_gdn_shard_forward, refusal=gdn_shard_refusal),
)
LAYERS = (GDN_OLMO,)
