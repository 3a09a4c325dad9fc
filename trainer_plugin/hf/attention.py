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
  the tree mask replaces, so it is read from the config here).
"""

from __future__ import annotations

from typing import Any

import torch

from treepack.proto.errors import RequestError
from treepack.trainer.kernels.attention import tree_attention
from treepack.trainer.hf.context import resolve_packed

__all__ = ["ATTN_IMPLEMENTATION", "treepack_attention", "register_tree_attention", "attention_chunk_size"]

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
    if dropout:
        raise RequestError(f"attention dropout {dropout} is not supported on packed rows; set attention_dropout=0", path="$.model.config.attention_dropout", rule="unsupported")
    if kwargs.get("indices") is not None:
        # A sparse (DSA) layer that reached the dense path: its top-k selection would be
        # silently ignored. Patched DSA layers never get here.
        raise RequestError(
            f"{type(module).__name__} passes sparse top-k indices; its layer must be patched for tree rows "
            "(packed_forward(..., patch_layers=True) or treepack.trainer.hf.layers.patch_layers)",
            path="$.model",
            rule="unpatched_sparse_layer",
        )
    opts = dict(ctx.options)
    out = tree_attention(
        query,
        key,
        value,
        ctx.batch,
        backend=ctx.backend,
        scale=scaling,
        sliding_window=sliding_window,
        softcap=softcap,
        varlen_fn=opts.get("varlen_fn"),
        compile=opts.get("compile"),
        sinks=kwargs.get("s_aux"),
        chunk_size=attention_chunk_size(module),
    )
    return out.transpose(1, 2).contiguous(), None


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
        raise RequestError(f"{type(module).__name__} (layer {idx}) is chunked but attention_chunk_size is {c!r}", path="$.model.config.attention_chunk_size", rule="range")
    return c


def register_tree_attention() -> str:
    """Register :func:`treepack_attention` under :data:`ATTN_IMPLEMENTATION` (idempotent)."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTN_IMPLEMENTATION, treepack_attention)
    return ATTN_IMPLEMENTATION
