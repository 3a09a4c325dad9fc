"""The registered ``"treepack"`` attention implementation of HF transformers.

HF dispatches every attention layer through ``AttentionInterface``; under the name
:data:`ATTN_IMPLEMENTATION` it finds :func:`treepack_attention`, which takes the packed
batch from the layer call (:mod:`treepack.trainer.hf.context`) and runs
:func:`~treepack.trainer.kernels.attention.tree_attention` over the tree mask.
transformers is imported only by :func:`register_tree_attention`.

Attention variants the layer call carries are run exactly, not dropped:

- attention sinks: the ``s_aux`` keyword (GPT-OSS passes its per-head ``sinks``);
- chunked attention: a layer whose ``config.layer_types[layer_idx]`` is
  ``"chunked_attention"`` (Llama4) attends within ``config.attention_chunk_size``
  positions of its own sequence (HF builds that mask only in its own mask function, which
  the tree mask replaces, so it is read from the config here);
- sliding windows applied only by HF's mask builders (Qwen2-MoE with
  ``use_sliding_window``, PhiMoE: their attention passes no ``sliding_window=``): the
  window is read from the config as HF's builders read it (:func:`mask_builder_window`),
  per layer from ``config.layer_types`` where the config has them.

The ``attention_mask`` a layer passes must be the tree mask ``packed_forward`` handed the
model (or None): a mask or bias the model built itself (Doge's learned dynamic mask) would
be replaced by the tree mask, so such a call is refused at run time, naming the layer.

Under context parallelism (a batch that is one rank's shard of every row, ``batch.cp``)
attention runs one of two strategies (``batch.cp_strategy``; ``"auto"`` picks per layer:
Ulysses where the query heads divide by the CP size, all-gather where they do not):

- **Ulysses**: query, key and value go from sequence shards of every head to whole rows
  of ``H / cp`` heads (one all-to-all each), the tree attention above runs on the whole
  rows (``batch.cp_full``) for those heads, and the output goes back (one all-to-all).
  Every variant above is per head, so it runs as it does on one rank (sinks sliced to the
  rank's heads). With grouped-query attention, key/value heads are replicated to one per
  query head when there are fewer of them than CP ranks' worth; with
  ``cp_strategy="ulysses"`` a layer whose query heads do not divide by the CP size is
  refused by name (:class:`~treepack.proto.errors.UnsupportedModelError`).
- **all-gather** (:func:`~treepack.trainer.kernels.cp_attention.allgather_attention`):
  each rank keeps its queries; keys and values are gathered over the group and the tree
  mask is applied on the whole key axis. Every variant runs unchanged (all heads local).
"""

from __future__ import annotations

import functools
import inspect
import sys
from typing import Any

import torch

from treepack.proto.errors import RequestError, UnsupportedModelError
from treepack.trainer.hf.context import resolve_packed
from treepack.trainer.kernels.attention import tree_attention
from treepack.trainer.kernels.cp import heads_to_seq, seq_to_heads
from treepack.trainer.kernels.cp_attention import allgather_attention

__all__ = [
    "ATTN_IMPLEMENTATION",
    "treepack_attention",
    "register_tree_attention",
    "attention_chunk_size",
    "mask_builder_window",
    "TREE_MASK_OPTION",
    "REFUSED_KEYWORDS",
]

# PackedContext.options key of the mask packed_forward handed the model (None for flash).
TREE_MASK_OPTION = "tree_mask"

#: Keywords of an attention call that carry a bias, sinks or a sparsity pattern built by
#: the model, which tree attention does not apply: a call that sets one is refused.
REFUSED_KEYWORDS = ("position_bias", "sinks", "block_indices")

ATTN_IMPLEMENTATION = "treepack"


def treepack_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: Any,
    scaling: float | None = None,
    dropout: float = 0.0,
    sliding_window: int | None = None,
    softcap: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """HF attention function (``AttentionInterface`` signature) over the tree mask.

    Args:
        module: the calling attention layer.
        query: [K, H, L, D]; key, value: [K, Hkv, L, D].
        attention_mask: whatever the model passed down (ignored: the mask comes from the
            packed batch, so no position-inferred packing can sneak in).
        scaling: softmax scale.
        dropout: must be 0 (attention dropout is not supported on tree rows).
        sliding_window: the layer's window (None for full attention).
        softcap: logit soft-capping (Gemma 2 style), if any.
        **kwargs: may hold ``treepack_context`` and ``s_aux`` ([H] attention-sink logits).

    Returns:
        ([K, L, H, D] output, None).
    """
    ctx = resolve_packed(kwargs, who=f"attention implementation {ATTN_IMPLEMENTATION!r}")
    opts = dict(ctx.options)
    _refuse_inputs(module, attention_mask, dropout, kwargs, opts)
    if sliding_window is None:
        sliding_window = mask_builder_window(module)
    if ctx.batch.cp is not None:
        if cp_layer_strategy(ctx.batch, query.shape[1]) == "allgather":
            out = allgather_attention(
                query, key, value, ctx.batch, backend=ctx.backend, scale=scaling, sliding_window=sliding_window,
                softcap=softcap, varlen_fn=opts.get("varlen_fn"), compile=opts.get("compile"),
                sinks=kwargs.get("s_aux"), chunk_size=attention_chunk_size(module),
            )  # fmt: skip
            return out.transpose(1, 2).contiguous(), None
        return _ulysses(
            module, query, key, value, ctx, opts, scaling, sliding_window, softcap, kwargs.get("s_aux")
        ), None
    out = _tree(module, query, key, value, ctx.batch, ctx, opts, scaling, sliding_window, softcap, kwargs.get("s_aux"))
    return out.transpose(1, 2).contiguous(), None


def _refuse_inputs(module: torch.nn.Module, attention_mask: Any, dropout: float, kwargs: dict, opts: dict) -> None:
    """Refuse what a layer hands its attention function that tree attention would not apply.

    Attention dropout, sparse top-k indices of an unpatched DSA layer, a bias or selection
    keyword the model built (:data:`REFUSED_KEYWORDS`), and any mask but the one
    ``packed_forward`` built (checked by identity when the context carries it).

    Raises:
        RequestError: dropout, or sparse indices on the dense path.
        UnsupportedModelError: a mask, bias or selection built by the model (``model_built_mask``).
    """
    if dropout:
        raise RequestError(
            f"attention dropout {dropout} is not supported on packed rows; set attention_dropout=0",
            path="$.model.config.attention_dropout",
            rule="unsupported",
        )
    if kwargs.get("indices") is not None:
        # A sparse (DSA) layer that reached the dense path: its top-k selection would be
        # silently ignored. Patched DSA layers never get here.
        raise RequestError(
            f"{type(module).__name__} passes sparse top-k indices; its layer must be patched for tree rows "
            "(packed_forward(..., patch_layers=True) or treepack.trainer.hf.layers.patch_layers)",
            path="$.model",
            rule="unpatched_sparse_layer",
        )
    foreign = [k for k in REFUSED_KEYWORDS if kwargs.get(k) is not None]
    if foreign:
        why = (
            f"passes its attention function {', '.join(k + '=' for k in foreign)} (a bias or selection the "
            "model built), which tree attention does not apply"
        )
        raise UnsupportedModelError(
            f"{type(module).__name__} (layer {getattr(module, 'layer_idx', '?')}) {why}, so the layer is refused",
            path="$.model",
            rule="model_built_mask",
            refusals=(("", type(module).__name__, why),),
        )
    if (
        TREE_MASK_OPTION in opts
        and attention_mask is not None
        and not _is_tree_mask(attention_mask, opts[TREE_MASK_OPTION])
    ):
        what = (
            f"{type(attention_mask).__name__}{tuple(attention_mask.shape) if hasattr(attention_mask, 'shape') else ''}"
        )
        raise UnsupportedModelError(
            f"{type(module).__name__} (layer {getattr(module, 'layer_idx', '?')}) passes its attention function "
            f"a mask or bias that treepack did not build ({what}; e.g. a learned dynamic mask): tree attention "
            "would replace it, so the layer is refused",
            path="$.model",
            rule="model_built_mask",
            refusals=(("", type(module).__name__, "attention mask or bias built by the model"),),
        )


def _is_tree_mask(mask: Any, tree: Any) -> bool:
    """``mask`` is the mask packed_forward built, or a detached alias of it (same storage,
    shape, strides and dtype): reentrant checkpointing detaches a layer's tensor inputs
    before the replay (GPT-2 passes its mask positionally)."""
    if mask is tree:
        return True
    return (
        isinstance(mask, torch.Tensor)
        and isinstance(tree, torch.Tensor)
        and mask.data_ptr() == tree.data_ptr()
        and mask.shape == tree.shape
        and mask.stride() == tree.stride()
        and mask.dtype == tree.dtype
    )


def _tree(module, query, key, value, batch, ctx, opts, scaling, sliding_window, softcap, sinks) -> torch.Tensor:
    """[K, H, L, D] tree attention over ``batch``'s whole rows, with the layer's variants."""
    return tree_attention(
        query,
        key,
        value,
        batch,
        backend=ctx.backend,
        scale=scaling,
        sliding_window=sliding_window,
        softcap=softcap,
        varlen_fn=opts.get("varlen_fn"),
        compile=opts.get("compile"),
        sinks=sinks,
        chunk_size=attention_chunk_size(module),
    )


def cp_layer_strategy(batch: Any, num_heads: int) -> str:
    """The strategy a layer with ``num_heads`` query heads runs on CP shard ``batch``:
    the batch's (``cp_strategy``), and for ``"auto"`` Ulysses where the heads divide by the
    CP size, else all-gather."""
    s = batch.cp_strategy
    if s == "auto":
        return "ulysses" if ulysses_refusal(num_heads, batch.cp.size) is None else "allgather"
    return s


def ulysses_refusal(num_heads: int, cp_size: int) -> str | None:
    """Why a layer with ``num_heads`` query heads cannot run Ulysses over ``cp_size`` ranks, or None."""
    if num_heads % cp_size:
        return (
            f"{num_heads} query heads do not divide over {cp_size} context-parallel ranks (Ulysses gives each "
            "rank H / cp heads)"
        )
    return None


def _ulysses(module, query, key, value, ctx, opts, scaling, sliding_window, softcap, sinks) -> torch.Tensor:
    """Ulysses attention on a CP shard: [K, H, Ls, D] in, [K, Ls, H, D] out (module docstring)."""
    batch = ctx.batch
    cp = batch.cp
    H, Hkv, P = query.shape[1], key.shape[1], cp.size
    reason = ulysses_refusal(H, P)
    if reason is not None:
        name = f"layer {getattr(module, 'layer_idx', '?')}"
        raise UnsupportedModelError(
            f"context parallelism: {name} ({type(module).__name__}): {reason}",
            rule="cp_heads",
            refusals=((name, type(module).__name__, reason),),
        )
    if Hkv % P:
        # Fewer key/value heads than ranks' worth: one per query head (GQA replicated).
        key = key.repeat_interleave(H // Hkv, dim=1)
        value = value.repeat_interleave(H // Hkv, dim=1)
    q, k, v = (seq_to_heads(x, cp) for x in (query, key, value))
    C = batch.plan.seq_len
    heads = slice(cp.rank * (H // P), (cp.rank + 1) * (H // P))
    out = _tree(
        module,
        q[:, :, :C],
        k[:, :, :C],
        v[:, :, :C],
        batch.cp_full,
        ctx,
        opts,
        scaling,
        sliding_window,
        softcap,
        None if sinks is None else sinks[heads],
    )
    if q.shape[2] > C:
        # Positions past seq_len are CP padding: nothing attends them and nothing reads them.
        out = torch.cat([out, out.new_zeros(*out.shape[:2], q.shape[2] - C, out.shape[3])], dim=2)
    return heads_to_seq(out, cp).transpose(1, 2).contiguous()


def attention_chunk_size(module: torch.nn.Module) -> int | None:
    """The chunk size of a chunked-attention layer (Llama4 ``layer_types``), else None.

    Raises:
        RequestError: a chunked layer without a positive ``attention_chunk_size``.
    """
    cfg = getattr(module, "config", None)
    types_ = getattr(cfg, "layer_types", None)
    idx = getattr(module, "layer_idx", None)
    if not types_ or idx is None or idx >= len(types_) or types_[idx] != "chunked_attention":
        return None
    c = getattr(cfg, "attention_chunk_size", None)
    if isinstance(c, bool) or not isinstance(c, int) or c < 1:
        raise RequestError(
            f"{type(module).__name__} (layer {idx}) is chunked but attention_chunk_size is {c!r}",
            path="$.model.config.attention_chunk_size",
            rule="range",
        )
    return c


@functools.cache
def _builds_sliding_mask(module_name: str) -> bool:
    mod = sys.modules.get(module_name)
    try:
        return mod is not None and "create_sliding_window_causal_mask" in inspect.getsource(mod)
    except (OSError, TypeError):
        return False


def mask_builder_window(module: torch.nn.Module) -> int | None:
    """The sliding window HF's mask builders would give ``module``'s layer, else None.

    With ``config.layer_types``: ``config.sliding_window`` for a ``"sliding_attention"``
    layer, None for the others. Without: ``config.sliding_window`` (when set, > 0) where
    the model's code builds sliding-window masks (``create_sliding_window_causal_mask``).
    """
    cfg = getattr(module, "config", None)
    w = getattr(cfg, "sliding_window", None)
    if isinstance(w, bool) or not isinstance(w, int) or w <= 0:
        return None
    types_ = getattr(cfg, "layer_types", None)
    idx = getattr(module, "layer_idx", None)
    if isinstance(types_, (list, tuple)) and types_:
        if idx is None or not 0 <= idx < len(types_):
            return None
        return w if types_[idx] == "sliding_attention" else None
    return w if _builds_sliding_mask(type(module).__module__) else None


def register_tree_attention() -> str:
    """Register :func:`treepack_attention` under :data:`ATTN_IMPLEMENTATION` (idempotent)."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTN_IMPLEMENTATION, treepack_attention)
    return ATTN_IMPLEMENTATION
