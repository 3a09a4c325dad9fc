"""Mamba2 mixers (grouped B/C, gated RMSNorm, the SSD scan): the kind ``mamba2``.

Bamba (``BambaMixer``), Nemotron-H (``NemotronHMamba2Mixer``), Granite-4
(``GraniteMoeHybridMambaLayer``), Falcon-H1 (``FalconH1Mixer``: ``ssm_in_multiplier``, the
muP vector on the projection, optional gated norm); also the pure Mamba2 model's
``Mamba2Mixer`` and Zamba2's ``Zamba2MambaMixer``, whose forward and helpers are the same
code as a stock one (recognised by code, not listed by name).

Under context parallelism (:func:`mamba2_shard_forward`) the projections and the gated norm
(over all heads: after the output comes back) run on this rank's shard of every row; x,
B and C before the conv and ``dt`` go to whole rows of ``H / cp`` heads, where conv and
SSD scan run unchanged with this rank's slices of ``A``, ``D`` and ``dt_bias``. B/C groups
that do not divide over the ranks are replicated to one per head (head ``h`` reads group
``h // (H / G)``, as the stock layer); heads that do not divide are refused.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from treepack.trainer.hf.layers.spec import ContextShard, TreeLayer, check_rows, check_shard_rows, conv1d_width
from treepack.trainer.hf.layers.stock import depthwise_conv, has_attrs, stock_class
from treepack.trainer.kernels.cp import divide_refusal, head_slice, rows_of_heads, shards_of_heads, tree_conv_heads
from treepack.trainer.kernels.mamba2 import tree_ssd_scan
from treepack.trainer.kernels.tree_scan import TreeSchedule, tree_conv

__all__ = ["LAYERS", "MAMBA2", "mamba2_tree_forward", "mamba2_shard_forward"]


def _structure(module: torch.nn.Module) -> bool:
    A_log = getattr(module, "A_log", None)
    return (
        has_attrs(
            module,
            "in_proj",
            "out_proj",
            "D",
            "dt_bias",
            "norm",
            "num_heads",
            "head_dim",
            "n_groups",
            "ssm_state_size",
            "chunk_size",
            "conv_dim",
            "intermediate_size",
        )
        and depthwise_conv(getattr(module, "conv1d", None))
        and isinstance(A_log, torch.Tensor)
        and A_log.dim() == 1
        and not has_attrs(module, "x_proj", "dt_proj")
    )


def mamba2_tree_forward(
    layer: torch.nn.Module, hidden_states: torch.Tensor, schedule: TreeSchedule, *, falcon: bool | None = None
) -> torch.Tensor:
    """A stock HF Mamba2 mixer's torch forward on tree rows.

    Same projections (Falcon-H1: ``ssm_in_multiplier`` and the muP vector), conv
    activation, ``A = -exp(A_log)``, softplus ``dt`` with ``dt_bias`` clamped to
    ``time_step_limit``, D skip, gated RMSNorm (Falcon-H1 without it: ``y * silu(gate)``)
    and output projection as the stock layer; conv and scan follow the tree.

    Args:
        layer: a Mamba2 mixer.
        hidden_states: [K, L, hidden] packed rows.
        schedule: the batch's tree schedule.
        falcon: whether the layer runs Falcon-H1's forward (the one stock Mamba2 forward
            with multipliers); None: look it up from the layer's code.

    Returns:
        [K, L, hidden].
    """
    K, L = check_rows(hidden_states, schedule)
    N, dtype = K * L, hidden_states.dtype
    falcon = stock_class(layer, MAMBA2.stock) == "FalconH1Mixer" if falcon is None else falcon
    h = hidden_states * layer.ssm_in_multiplier if falcon else hidden_states
    proj = layer.in_proj(h)
    if falcon:
        proj = proj * layer.mup_vector
    A = -torch.exp(layer.A_log.float())
    gate, xBC, dt = proj.split([layer.intermediate_size, layer.conv_dim, layer.num_heads], dim=-1)
    xBC = tree_conv(
        xBC.reshape(N, -1), layer.conv1d.weight.squeeze(1), layer.conv1d.bias, schedule, activation=layer.activation
    )
    xBC = xBC.to(proj.dtype)
    G, S = layer.n_groups, layer.ssm_state_size
    x, B, C = torch.split(xBC, [layer.intermediate_size, G * S, G * S], dim=-1)
    y = tree_ssd_scan(
        x.reshape(N, layer.num_heads, layer.head_dim),
        dt.reshape(N, layer.num_heads),
        A,
        B.reshape(N, G, S),
        C.reshape(N, G, S),
        schedule,
        chunk_size=layer.chunk_size,
        D=layer.D,
        dt_bias=layer.dt_bias,
        dt_softplus=True,
        dt_limit=tuple(layer.time_step_limit),
    )
    y = y.float().reshape(K, L, -1)  # the stock scan returns fp32
    if not falcon or layer.mamba_rms_norm:
        y = layer.norm(y, gate)
    else:
        y = y * F.silu(gate)
    return layer.out_proj(y.to(dtype))


def mamba2_shard_forward(
    layer: torch.nn.Module, hidden_states: torch.Tensor, schedule: TreeSchedule, batch: Any
) -> torch.Tensor:
    """A stock HF Mamba2 mixer on one context-parallel shard (module docstring).

    Args:
        layer: a Mamba2 mixer.
        hidden_states: [K, Ls, hidden] this rank's shard of every row.
        schedule: the whole rows' tree schedule. batch: the CP shard.

    Returns:
        [K, Ls, hidden].
    """
    K, Ls = check_shard_rows(hidden_states, batch)
    cp, Cl, dtype = batch.cp, batch.plan.seq_len, hidden_states.dtype
    falcon = stock_class(layer, MAMBA2.stock) == "FalconH1Mixer"
    h = hidden_states * layer.ssm_in_multiplier if falcon else hidden_states
    proj = layer.in_proj(h)
    if falcon:
        proj = proj * layer.mup_vector
    gate, xBC, dt = proj.split([layer.intermediate_size, layer.conv_dim, layer.num_heads], dim=-1)
    H, G, S, I = layer.num_heads, layer.n_groups, layer.ssm_state_size, layer.intermediate_size
    x, B, C = torch.split(xBC, [I, G * S, G * S], dim=-1)
    x, B, C = x.reshape(K, Ls, H, -1), B.reshape(K, Ls, G, S), C.reshape(K, Ls, G, S)
    weight, bias = layer.conv1d.weight.squeeze(1), layer.conv1d.bias
    if G % cp.size:  # one B/C group per head (channels and taps alike), so the groups deal out with the heads
        rep = H // G
        B, C = B.repeat_interleave(rep, dim=2), C.repeat_interleave(rep, dim=2)
        weight, bias = (None if t is None else _repeat_groups(t, I, G, S, rep) for t in (weight, bias))
    x, B, C = tree_conv_heads([x, B, C], weight, bias, schedule, cp, Cl, layer.activation)
    dt = rows_of_heads(dt.reshape(K, Ls, H, 1), cp, Cl)[..., 0]
    mine = head_slice(H, cp)
    y = tree_ssd_scan(
        x, dt, -torch.exp(layer.A_log.float())[mine], B, C, schedule,
        chunk_size=layer.chunk_size, D=layer.D[mine], dt_bias=layer.dt_bias[mine], dt_softplus=True,
        dt_limit=tuple(layer.time_step_limit),
    )  # fmt: skip
    y = shards_of_heads(y.float(), cp, K, Ls).reshape(K, Ls, -1)  # the stock scan returns fp32
    if not falcon or layer.mamba_rms_norm:
        y = layer.norm(y, gate)
    else:
        y = y * F.silu(gate)
    return layer.out_proj(y.to(dtype))


def _repeat_groups(t: torch.Tensor, I: int, G: int, S: int, rep: int) -> torch.Tensor:
    """The conv's B and C channels (``t``'s rows after the first ``I``) repeated ``rep`` times per group."""
    x, bc = t[:I], t[I:]
    bc = bc.reshape(2, G, S, *t.shape[1:]).repeat_interleave(rep, dim=1).reshape(-1, *t.shape[1:])
    return torch.cat([x, bc])


MAMBA2 = TreeLayer(
    kind="mamba2",
    structure=_structure,
    stock=(
        ("transformers.models.bamba.modeling_bamba", "BambaMixer"),
        ("transformers.models.nemotron_h.modeling_nemotron_h", "NemotronHMamba2Mixer"),
        ("transformers.models.granitemoehybrid.modeling_granitemoehybrid", "GraniteMoeHybridMambaLayer"),
        ("transformers.models.falcon_h1.modeling_falcon_h1", "FalconH1Mixer"),
    ),
    tree_forward=mamba2_tree_forward,
    conv_width=conv1d_width,
    chunk_size=lambda layer: int(layer.chunk_size),
    shard=ContextShard(
        forward=mamba2_shard_forward, refusal=lambda layer, cp_size: divide_refusal("heads", layer.num_heads, cp_size)
    ),
)
LAYERS = (MAMBA2,)
