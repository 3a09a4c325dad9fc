"""Layer patches for HF's recurrent and convolutional mixers on tree rows (SPEC 7, issue 10).

Which modules are mixers, and which of them the tree path reproduces, is decided by
mechanism in :mod:`treepack.trainer.hf.mixer_kinds` (:func:`mixer_kind`,
:func:`is_handled`, :func:`unhandled_reason`, re-exported here). Per kind, the stock
layers whose torch slow path the tree forward reproduces exactly:

- ``gdn``: Qwen3-Next / Qwen3.5 Gated DeltaNet and any renamed copy or subclass that keeps
  its forward (patched by :mod:`treepack.trainer.hf.hybrid`, whose GDN forward they share).
- ``gdn_olmo``: OLMo-hybrid's GDN variant (``OlmoHybridGatedDeltaNet``: separate
  projections, a ``g_proj`` output gate, optional negative eigenvalues).
- ``mamba2``: Mamba2 mixers with grouped B/C, a gated RMSNorm and the SSD scan: Bamba
  (``BambaMixer``), Nemotron-H (``NemotronHMamba2Mixer``), Granite-4
  (``GraniteMoeHybridMambaLayer``), Falcon-H1 (``FalconH1Mixer``: ``ssm_in_multiplier``, the
  muP vector on the projection, optional gated norm); also the pure Mamba2 model's
  ``Mamba2Mixer`` and Zamba2's ``Zamba2MambaMixer``, whose forward and helpers are the
  same code as a stock one (recognised by :func:`stock_layer`, not listed by name).
- ``mamba``: Jamba's Mamba (S6) mixer (``JambaMambaMixer``: RMS norms on dt, B and C).
- ``kda``: Kimi-Linear's Kimi Delta Attention (``KimiLinearDeltaAttention``).
- ``short_conv``: LFM2's gated short convolution (``Lfm2ShortConv``, ``Lfm2MoeShortConv``).

Each patched forward runs the stock projections, then
:func:`~treepack.trainer.kernels.tree_scan.tree_conv` and the family's tree scan over the
batch's :class:`~treepack.trainer.kernels.tree_scan.TreeSchedule`. Outside
``packed_forward`` (no packed context) a patched layer runs its stock forward.
"""

from __future__ import annotations

import functools
import types
from typing import Any, Callable

import torch
import torch.nn.functional as F

from treepack.proto.errors import RequestError
from treepack.trainer.kernels.gdn import tree_causal_conv1d, tree_gated_delta_rule
from treepack.trainer.hf.dsa import STOCK_ATTR, packed_context
from treepack.trainer.hf.mixer_kinds import MIXER_KINDS, is_handled, mixer_kind, stock_layer, unhandled_reason
from treepack.trainer.kernels.kda import tree_kda
from treepack.trainer.kernels.mamba import tree_selective_scan
from treepack.trainer.kernels.mamba2 import tree_ssd_scan
from treepack.trainer.kernels.tree_scan import TreeSchedule, tree_conv, tree_schedule

__all__ = [
    "MIXER_KINDS",
    "mixer_kind",
    "is_handled",
    "unhandled_reason",
    "stock_layer",
    "mixer_tree_forward",
    "patch_mixer_layers",
    "batch_tree_schedule",
    "mamba2_tree_forward",
    "short_conv_tree_forward",
    "mamba_tree_forward",
    "kda_tree_forward",
    "olmo_gdn_tree_forward",
]


def batch_tree_schedule(batch: Any, conv_width: int, who: str) -> TreeSchedule:
    """The batch's tree schedule (built on first use, cached in the batch).

    Raises:
        RequestError: when the layer's conv kernel is wider than the plan's conv_width.
    """
    W = batch.plan.gdn.conv_width
    if conv_width > W:
        raise RequestError(
            f"{who} has a conv kernel of {conv_width} but the plan was made with conv_width={W}; "
            f"plan with conv_width >= {conv_width}",
            path="$.plan.gdn.conv_width",
            rule="conv_width",
        )
    key = "gdn_schedule"  # same schedule as the GDN layers'
    if key not in batch._cache:
        batch._cache[key] = tree_schedule(batch.plan, device=batch.device, rows=batch.rows)
    return batch._cache[key]


def _check_rows(hidden_states: torch.Tensor, schedule: TreeSchedule) -> tuple[int, int]:
    K, L = hidden_states.shape[:2]
    if K * L != schedule.num_positions:
        raise RequestError(
            f"hidden_states has {K} rows of {L}, the schedule {schedule.num_rows} rows of {schedule.seq_len}",
            path="$.hidden_states",
            rule="shape",
        )
    return K, L


def mamba2_tree_forward(layer: torch.nn.Module, hidden_states: torch.Tensor, schedule: TreeSchedule, *, falcon: bool | None = None) -> torch.Tensor:
    """A stock HF Mamba2 mixer's torch forward on tree rows.

    Same projections (Falcon-H1: ``ssm_in_multiplier`` and the muP vector), conv
    activation, ``A = -exp(A_log)``, softplus ``dt`` with ``dt_bias`` clamped to
    ``time_step_limit``, D skip, gated RMSNorm (Falcon-H1 without it: ``y * silu(gate)``)
    and output projection as the stock layer; conv and scan follow the tree.

    Args:
        layer: a Mamba2 mixer (:func:`mixer_kind` ``mamba2``).
        hidden_states: [K, L, hidden] packed rows.
        schedule: the batch's tree schedule.
        falcon: whether the layer runs Falcon-H1's forward (the one stock Mamba2 forward
            with multipliers); None: look it up (:func:`stock_layer`).

    Returns:
        [K, L, hidden].
    """
    K, L = _check_rows(hidden_states, schedule)
    N, dtype = K * L, hidden_states.dtype
    falcon = stock_layer(layer) == "FalconH1Mixer" if falcon is None else falcon
    h = hidden_states * layer.ssm_in_multiplier if falcon else hidden_states
    proj = layer.in_proj(h)
    if falcon:
        proj = proj * layer.mup_vector
    A = -torch.exp(layer.A_log.float())
    gate, xBC, dt = proj.split([layer.intermediate_size, layer.conv_dim, layer.num_heads], dim=-1)
    xBC = tree_conv(xBC.reshape(N, -1), layer.conv1d.weight.squeeze(1), layer.conv1d.bias, schedule, activation=layer.activation)
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


def mamba_tree_forward(layer: torch.nn.Module, hidden_states: torch.Tensor, schedule: TreeSchedule) -> torch.Tensor:
    """Jamba's Mamba mixer (selective scan with RMS-normed dt, B, C) on tree rows.

    Same projections, conv activation, dt / B / C layer norms, ``dt_proj`` weight with its
    bias as the scan's ``delta_bias`` (softplus), D skip and z gate as the stock slow path;
    conv and scan follow the tree.

    Args:
        layer: a ``JambaMambaMixer`` (:func:`mixer_kind` ``mamba``).
        hidden_states: [K, L, hidden] packed rows.
        schedule: the batch's tree schedule.

    Returns:
        [K, L, hidden].
    """
    K, L = _check_rows(hidden_states, schedule)
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


def kda_tree_forward(layer: torch.nn.Module, hidden_states: torch.Tensor, schedule: TreeSchedule) -> torch.Tensor:
    """Kimi-Linear's KDA layer on tree rows.

    Same q/k/v projections, conv activation, per-channel forget gate (``layer.forget_gate``,
    pointwise), ``beta = sigmoid(b_proj)``, in-kernel q/k L2 norm, sigmoid-gated RMSNorm and
    output projection as the stock layer; conv and the delta rule follow the tree.

    Args:
        layer: a ``KimiLinearDeltaAttention`` (:func:`mixer_kind` ``kda``).
        hidden_states: [K, L, hidden] packed rows.
        schedule: the batch's tree schedule.

    Returns:
        [K, L, hidden].
    """
    K, L = _check_rows(hidden_states, schedule)
    N, hd = K * L, layer.head_dim
    mixed = torch.cat([layer.q_proj(hidden_states), layer.k_proj(hidden_states), layer.v_proj(hidden_states)], dim=-1)
    conv = tree_conv(mixed.reshape(N, -1), layer.conv1d.weight.squeeze(1), layer.conv1d.bias, schedule, activation=layer.activation)
    q, k, v = (x.reshape(N, -1, hd) for x in torch.split(conv.to(mixed.dtype), [layer.qkv_dim] * 3, dim=-1))
    g = layer.forget_gate(hidden_states).reshape(N, -1, hd)
    beta = torch.sigmoid(layer.b_proj(hidden_states)).reshape(N, -1)
    o = tree_kda(q, k, v, g, beta, schedule, use_qk_l2norm_in_kernel=True)
    gate = layer.g_b_proj(layer.g_a_proj(hidden_states)).reshape(K, L, -1, hd)
    return layer.o_proj(layer.o_norm(o.reshape(K, L, -1, hd), gate).reshape(K, L, -1))


def olmo_gdn_tree_forward(layer: torch.nn.Module, hidden_states: torch.Tensor, schedule: TreeSchedule) -> torch.Tensor:
    """OLMo-hybrid's Gated DeltaNet variant on tree rows.

    Separate q/k/v/a/b/g projections, ``beta = sigmoid(b)`` (times 2 with
    ``allow_neg_eigval``), ``g = -exp(A_log) * softplus(a + dt_bias)``, in-kernel q/k L2
    norm, norm-before-gate RMSNorm with the ``g_proj`` gate, as the stock layer; conv and
    delta rule follow the tree (:mod:`treepack.trainer.kernels.gdn`).

    Args:
        layer: an ``OlmoHybridGatedDeltaNet`` (:func:`mixer_kind` ``gdn_olmo``).
        hidden_states: [K, L, hidden] packed rows.
        schedule: the batch's tree schedule.

    Returns:
        [K, L, hidden].
    """
    K, L = _check_rows(hidden_states, schedule)
    N = K * L
    mixed = torch.cat([layer.q_proj(hidden_states), layer.k_proj(hidden_states), layer.v_proj(hidden_states)], dim=-1)
    conv = tree_causal_conv1d(mixed.reshape(N, -1), layer.conv1d.weight.squeeze(1), layer.conv1d.bias, schedule, activation=layer.activation)
    q, k, v = torch.split(conv.to(mixed.dtype), [layer.key_dim, layer.key_dim, layer.value_dim], dim=-1)
    beta = layer.b_proj(hidden_states).sigmoid()
    if layer.allow_neg_eigval:
        beta = beta * 2.0
    g = -layer.A_log.float().exp() * F.softplus(layer.a_proj(hidden_states).float() + layer.dt_bias)
    o = tree_gated_delta_rule(
        q.reshape(N, -1, layer.head_k_dim), k.reshape(N, -1, layer.head_k_dim), v.reshape(N, -1, layer.head_v_dim),
        g.reshape(N, -1), beta.reshape(N, -1), schedule, use_qk_l2norm_in_kernel=True,
    )
    gate = layer.g_proj(hidden_states).reshape(-1, layer.head_v_dim)
    o = layer.o_norm(o.reshape(-1, layer.head_v_dim), gate).reshape(K, L, -1)
    return layer.o_proj(o)


def short_conv_tree_forward(layer: torch.nn.Module, hidden_states: torch.Tensor, schedule: TreeSchedule) -> torch.Tensor:
    """LFM2's gated short convolution (``out_proj(C * conv(B * x))``) on tree rows.

    Args:
        layer: an ``Lfm2ShortConv``-like module (:func:`mixer_kind` ``short_conv``).
        hidden_states: [K, L, hidden] packed rows.
        schedule: the batch's tree schedule (its conv_width >= the layer's kernel).

    Returns:
        [K, L, hidden].
    """
    K, L = _check_rows(hidden_states, schedule)
    B, C, x = layer.in_proj(hidden_states).chunk(3, dim=-1)
    Bx = (B * x).reshape(K * L, -1)
    conv = tree_conv(Bx, layer.conv.weight.squeeze(1), layer.conv.bias, schedule).to(Bx.dtype)
    return layer.out_proj(C * conv.reshape(K, L, -1))


_TREE_FORWARDS: dict[str, Callable[[torch.nn.Module, torch.Tensor, TreeSchedule], torch.Tensor]] = {
    "mamba2": mamba2_tree_forward,
    "mamba": mamba_tree_forward,
    "kda": kda_tree_forward,
    "gdn_olmo": olmo_gdn_tree_forward,
    "short_conv": short_conv_tree_forward,
}


def _conv_width(layer: torch.nn.Module) -> int:
    conv = getattr(layer, "conv1d", None) or getattr(layer, "conv")
    return int(conv.weight.shape[-1])


def _patched_forward(self: torch.nn.Module, hidden_states: torch.Tensor, *args: Any, tree_forward: Callable, **kwargs: Any) -> torch.Tensor:
    ctx = packed_context(kwargs)
    if ctx is None:
        return getattr(self, STOCK_ATTR)(hidden_states, *args, **kwargs)
    cache = kwargs.get("cache", kwargs.get("past_key_values", kwargs.get("cache_params", args[0] if args else None)))
    if cache is not None:
        raise RequestError("packed rows run without a cache: call the model with use_cache=False", path="$.use_cache", rule="unsupported")
    who = f"{type(self).__name__} (layer {getattr(self, 'layer_idx', '?')})"
    return tree_forward(self, hidden_states, batch_tree_schedule(ctx.batch, _conv_width(self), who))


def _tree_forward_for(layer: torch.nn.Module) -> Callable:
    """The tree forward of a handled layer, with its per-class choices made once."""
    kind = mixer_kind(layer)
    fn = _TREE_FORWARDS[kind]
    return functools.partial(fn, falcon=stock_layer(layer) == "FalconH1Mixer") if kind == "mamba2" else fn


def mixer_tree_forward(layer: torch.nn.Module, hidden_states: torch.Tensor, schedule: TreeSchedule) -> torch.Tensor:
    """Run a handled mixer on tree rows (dispatch on :func:`mixer_kind`).

    Raises:
        RequestError: when the layer is not handled (names the class and the reason).
    """
    reason = unhandled_reason(layer)
    kind = mixer_kind(layer)
    if kind is None or reason is not None:
        raise RequestError(f"{type(layer).__name__} cannot run on tree rows: {reason or 'not a known mixer'}", path="$.model", rule="unsupported_mixer")
    return _TREE_FORWARDS[kind](layer, hidden_states, schedule)


def patch_mixer_layers(model: torch.nn.Module) -> list[str]:
    """Install the tree forward on every handled mixer of ``model`` (idempotent).

    Returns:
        The qualified names of the patched modules (already patched ones included).
    """
    names = []
    for name, mod in model.named_modules():
        if mixer_kind(mod) not in _TREE_FORWARDS or not is_handled(mod):
            continue
        if STOCK_ATTR not in mod.__dict__:
            mod.__dict__[STOCK_ATTR] = mod.forward
            mod.forward = types.MethodType(functools.partial(_patched_forward, tree_forward=_tree_forward_for(mod)), mod)
        names.append(name)
    return names
