"""Layer patches so that stock HF hybrids run tree-packed rows (SPEC 7).

:func:`~treepack.trainer.hf.packed_forward` switches attention to the registered tree
implementation; layers that are not attention need their own patch:

- Gated DeltaNet layers (Qwen3-Next ``Qwen3NextGatedDeltaNet``, Qwen3.5
  ``Qwen3_5GatedDeltaNet`` / ``Qwen3_5MoeGatedDeltaNet``): the stock forward scans each row
  as one sequence; the patch runs the same projections, then
  :func:`~treepack.trainer.kernels.gdn.tree_causal_conv1d` and
  :func:`~treepack.trainer.kernels.gdn.tree_gated_delta_rule` over the batch's GDN schedule.
- DeepSeek-V3.2 and GLM-MoE-DSA sparse attention (``DeepseekV32Attention``,
  ``GlmMoeDsaAttention``, and their indexers for unpacked calls): see
  :mod:`treepack.trainer.hf.dsa`.

:func:`patch_hybrid_layers` installs the patches on a model's modules (idempotent). A
patched layer finds the packed batch the same way the tree attention function does
(:func:`treepack.trainer.hf.context.resolve_packed`: the ``treepack_context`` keyword argument
first, else the context variable); with neither it runs its stock forward, so an unpacked
call of a patched model is unchanged (except that DSA indexers then break exact score ties
towards lower positions, as the packed path does; see :mod:`treepack.trainer.hf.dsa`). The GDN schedule is built once per batch and cached
in the batch.
"""

from __future__ import annotations

import types
from typing import Any, Callable

import torch
import torch.nn.functional as F

from treepack.proto.errors import RequestError
from treepack.trainer.kernels.gdn import GdnSchedule, gdn_schedule, tree_causal_conv1d, tree_gated_delta_rule
from treepack.trainer.hf.dsa import STOCK_ATTR, dsa_forward, glm_dsa_forward, packed_context, position_tiebreak_indexer_forward
from treepack.trainer.hf.mixers import is_handled, mixer_kind, patch_mixer_layers

__all__ = ["patch_hybrid_layers", "unpatch_hybrid_layers", "gdn_layer_tree_forward", "batch_gdn_schedule", "packed_context"]

GDN_CLASSES = ("Qwen3NextGatedDeltaNet", "Qwen3_5GatedDeltaNet", "Qwen3_5MoeGatedDeltaNet")
DSA_CLASSES = ("DeepseekV32Attention",)
GLM_DSA_CLASSES = ("GlmMoeDsaAttention",)
DSA_INDEXER_CLASSES = ("DeepseekV32Indexer", "GlmMoeDsaIndexer")


def batch_gdn_schedule(batch: Any, conv_width: int, who: str) -> GdnSchedule:
    """The batch's GDN schedule (built on first use, cached in the batch).

    Raises:
        RequestError: when the plan's conv width differs from the layer's conv kernel.
    """
    W = batch.plan.gdn.conv_width
    if W != conv_width:
        raise RequestError(
            f"{who} has a conv kernel of {conv_width} but the plan was made with conv_width={W}; "
            f"plan with conv_width={conv_width}",
            path="$.plan.gdn.conv_width",
            rule="conv_width",
        )
    key = "gdn_schedule"
    if key not in batch._cache:
        batch._cache[key] = gdn_schedule(batch.plan, device=batch.device, rows=batch.rows)
    return batch._cache[key]


def _project(layer: torch.nn.Module, h: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """(mixed_qkv [K, L, conv_dim], z [K, L, Hv, dv], b [K, L, Hv], a [K, L, Hv]) as the stock forward."""
    K, L = h.shape[:2]
    if hasattr(layer, "in_proj_qkvz"):  # Qwen3-Next: interleaved per key-head group
        q, k, v, z, b, a = layer.fix_query_key_value_ordering(layer.in_proj_qkvz(h), layer.in_proj_ba(h))
        mixed = torch.cat([x.reshape(K, L, -1) for x in (q, k, v)], dim=-1)
        return mixed, z, b, a
    z = layer.in_proj_z(h).reshape(K, L, -1, layer.head_v_dim)  # Qwen3.5: separate projections
    return layer.in_proj_qkv(h), z, layer.in_proj_b(h), layer.in_proj_a(h)


def gdn_layer_tree_forward(layer: torch.nn.Module, hidden_states: torch.Tensor, schedule: GdnSchedule) -> torch.Tensor:
    """A stock HF Gated DeltaNet layer's forward on tree rows.

    Same projections, gating (``beta = sigmoid(b)``, ``g = -exp(A_log) * softplus(a +
    dt_bias)``), in-kernel q/k L2 norm and gated RMSNorm as the stock layer; the conv and
    the delta rule follow the tree instead of the row.

    Args:
        layer: a Qwen3-Next / Qwen3.5 GatedDeltaNet module.
        hidden_states: [K, L, hidden] packed rows.
        schedule: the batch's :class:`~treepack.trainer.kernels.gdn.GdnSchedule`.

    Returns:
        [K, L, hidden] the layer's output.
    """
    K, L, _ = hidden_states.shape
    if K * L != schedule.num_positions:
        raise RequestError(
            f"hidden_states has {K} rows of {L}, the schedule {schedule.num_rows} rows of {schedule.seq_len}",
            path="$.hidden_states",
            rule="shape",
        )
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


def _gdn_forward(self: torch.nn.Module, hidden_states: torch.Tensor, cache: Any = None, attention_mask: Any = None, **kwargs: Any) -> torch.Tensor:
    ctx = packed_context(kwargs)
    if ctx is None:
        return getattr(self, STOCK_ATTR)(hidden_states, cache=cache, attention_mask=attention_mask, **kwargs)
    if cache is not None:
        raise RequestError("packed rows run without a cache: call the model with use_cache=False", path="$.use_cache", rule="unsupported")
    who = f"{type(self).__name__} (layer {getattr(self, 'layer_idx', '?')})"
    return gdn_layer_tree_forward(self, hidden_states, batch_gdn_schedule(ctx.batch, self.conv_kernel_size, who))


def _patches() -> dict[str, Callable]:
    out: dict[str, Callable] = {name: _gdn_forward for name in GDN_CLASSES}
    out.update({name: dsa_forward for name in DSA_CLASSES})
    out.update({name: glm_dsa_forward for name in GLM_DSA_CLASSES})
    # The indexers of patched DSA layers break ties by position on unpacked calls too.
    out.update({name: position_tiebreak_indexer_forward for name in DSA_INDEXER_CLASSES})
    return out


def patch_hybrid_layers(model: torch.nn.Module) -> list[str]:
    """Install the tree forwards on every GDN / DSA layer and handled mixer of ``model`` (idempotent).

    Returns:
        The qualified names of the patched modules (already patched ones included).
    """
    patches = _patches()
    names = []
    for name, mod in model.named_modules():
        fn = patches.get(type(mod).__name__)
        if fn is None and mixer_kind(mod) == "gdn" and is_handled(mod):
            fn = _gdn_forward  # a renamed copy or subclass of a stock GDN layer, found by mechanism
        if fn is None:
            continue
        if STOCK_ATTR not in mod.__dict__:
            mod.__dict__[STOCK_ATTR] = mod.forward  # bound stock forward, outside nn.Module's registries
            mod.forward = types.MethodType(fn, mod)
        names.append(name)
    # Recurrent / conv mixers found by mechanism (Mamba2, Mamba, short conv, KDA, GDN variants).
    names += [n for n in patch_mixer_layers(model) if n not in names]
    return names


def unpatch_hybrid_layers(model: torch.nn.Module) -> int:
    """Restore the stock forwards; returns how many modules were restored."""
    n = 0
    for mod in model.modules():
        if STOCK_ATTR in mod.__dict__:
            del mod.__dict__[STOCK_ATTR]
            del mod.__dict__["forward"]
            n += 1
    return n
