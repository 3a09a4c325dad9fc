"""Gated DeltaNet (Qwen3-Next, Qwen3.5): the kind ``gdn``.

The stock forward scans each row as one sequence; on tree rows the same projections run,
then :func:`~treepack.trainer.kernels.gdn.tree_causal_conv1d` and
:func:`~treepack.trainer.kernels.gdn.tree_gated_delta_rule` over the batch's tree
schedule. The stock classes are patched by name; a renamed copy or subclass that keeps the
stock forward is found by mechanism.

Under context parallelism (:func:`gdn_shard_forward`) the projections, gates and the
gated RMSNorm run on this rank's shard of every row (they are per token); q/k/v (before
the conv), ``g`` and ``beta`` go to whole rows of ``H / cp`` heads (an all-to-all), where
the conv (this rank's channels of its weight) and the delta rule run unchanged, and the
output comes back (one all-to-all). Key heads that do not divide over the ranks are
replicated to one per value head (value head ``j`` reads key head ``j // (Hv / Hk)``, as
the stock layer); value heads that do not divide are refused.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from treepack.trainer.hf.layers.spec import ContextShard, TreeLayer, check_rows, check_shard_rows, conv1d_width
from treepack.trainer.hf.layers.stock import depthwise_conv, has_attrs
from treepack.trainer.kernels.cp import divide_refusal, rows_of_heads, shards_of_heads, tree_conv_heads
from treepack.trainer.kernels.gdn import tree_causal_conv1d, tree_gated_delta_rule
from treepack.trainer.kernels.tree_scan import TreeSchedule

__all__ = [
    "LAYERS",
    "GDN",
    "gdn_layer_tree_forward",
    "gdn_shard_forward",
    "gdn_params",
    "gated_delta_shard",
    "gdn_shard_refusal",
]


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
        has_attrs(module, "in_proj_qkvz", "in_proj_ba", "norm", "out_proj")
        or has_attrs(module, "in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "norm", "out_proj")
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


def gdn_shard_refusal(layer: torch.nn.Module, cp_size: int) -> str | None:
    """Why a Gated DeltaNet layer cannot run over ``cp_size`` ranks: its value heads do not divide."""
    return divide_refusal("value heads", layer.value_dim // layer.head_v_dim, cp_size)


def gated_delta_shard(
    layer: torch.nn.Module,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    schedule: TreeSchedule,
    batch: Any,
) -> torch.Tensor:
    """Conv and gated delta rule of a GDN layer on whole rows of this rank's heads (module docstring).

    Args:
        layer: the GDN layer (``conv1d`` over concatenated q/k/v channels, ``activation``).
        q, k: [K, Ls, Hk, dk] this rank's shard, before the conv. v: [K, Ls, Hv, dv].
        g, beta: [K, Ls, Hv] log decay and write strength.
        schedule: the whole rows' tree schedule. batch: the CP shard.

    Returns:
        [K, Ls, Hv, dv] the delta rule's output on this rank's shard, every head.
    """
    cp, C = batch.cp, batch.plan.seq_len
    K, Ls, Hk, dk = q.shape
    Hv, dv = v.shape[2:]
    weight, bias = layer.conv1d.weight.squeeze(1), layer.conv1d.bias
    if Hk % cp.size:  # one key head per value head (channels and taps alike), so the heads deal out evenly
        rep = Hv // Hk
        q, k = q.repeat_interleave(rep, dim=2), k.repeat_interleave(rep, dim=2)
        weight, bias = (None if t is None else _repeat_qk(t, Hk, dk, rep) for t in (weight, bias))
    q, k, v = tree_conv_heads([q, k, v], weight, bias, schedule, cp, C, layer.activation)
    g, beta = (rows_of_heads(x[..., None], cp, C)[..., 0] for x in (g, beta))
    o = tree_gated_delta_rule(q, k, v, g, beta, schedule, use_qk_l2norm_in_kernel=True)
    return shards_of_heads(o, cp, K, Ls)


def _repeat_qk(t: torch.Tensor, Hk: int, dk: int, rep: int) -> torch.Tensor:
    """The conv's q and k channels (``t``'s first ``2 * Hk * dk`` rows) repeated ``rep`` times per head."""
    qk, rest = t[: 2 * Hk * dk], t[2 * Hk * dk :]
    qk = qk.reshape(2, Hk, dk, *t.shape[1:]).repeat_interleave(rep, dim=1).reshape(-1, *t.shape[1:])
    return torch.cat([qk, rest])


def gdn_shard_forward(
    layer: torch.nn.Module, hidden_states: torch.Tensor, schedule: TreeSchedule, batch: Any
) -> torch.Tensor:
    """A stock HF Gated DeltaNet layer on one context-parallel shard (:func:`gated_delta_shard`).

    Args:
        layer: a Qwen3-Next / Qwen3.5 GatedDeltaNet module.
        hidden_states: [K, Ls, hidden] this rank's shard of every row.
        schedule: the whole rows' tree schedule. batch: the CP shard.

    Returns:
        [K, Ls, hidden].
    """
    K, Ls = check_shard_rows(hidden_states, batch)
    mixed, z, b, a = _project(layer, hidden_states)
    q, k, v = torch.split(mixed, [layer.key_dim, layer.key_dim, layer.value_dim], dim=-1)
    beta = b.sigmoid().reshape(K, Ls, -1)
    g = (-layer.A_log.float().exp() * F.softplus(a.float() + layer.dt_bias)).reshape(K, Ls, -1)
    shape = lambda x, d: x.reshape(K, Ls, -1, d)  # noqa: E731
    core = gated_delta_shard(
        layer,
        shape(q, layer.head_k_dim),
        shape(k, layer.head_k_dim),
        shape(v, layer.head_v_dim),
        g,
        beta,
        schedule,
        batch,
    )
    core = layer.norm(core.reshape(-1, layer.head_v_dim), z.reshape(-1, layer.head_v_dim))
    return layer.out_proj(core.reshape(K, Ls, -1))


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
    shard=ContextShard(forward=gdn_shard_forward, refusal=gdn_shard_refusal),
)
LAYERS = (GDN,)
