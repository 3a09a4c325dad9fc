"""Megatron core attention under the tree mask: :class:`TreeDotProductAttention`.

Swapped into the local (non-Transformer-Engine) layer spec as
``self_attention.submodules.core_attention`` by
:func:`~treepack.trainer.megatron.spec.tree_layer_spec`, with the self-attention's
``attn_mask_type`` forced to ``arbitrary`` (asserted here and by the admission).

Why not Megatron's own cores: the local ``DotProductAttention`` takes an arbitrary
``[b, 1, s, s]`` mask, but the spec hard-codes ``attn_mask_type=causal``, and on a GPU in
bf16/fp16 with the default fused softmax the causal kernel ignores the mask for key
lengths 16..4096: tree rows would silently get plain causal attention. Transformer
Engine's cores take cu_seqlens (``thd``) for plain packing, which expresses no tree.

Masks: Megatron's convention, True = masked out. A mask handed in (``packed_forward``
with ``backend="sdpa"`` hands the tree mask, :func:`~treepack.trainer.megatron.forward.tree_attention_mask`)
runs through SDPA; with no mask, inside a packed forward, the rows' own masks run through
:func:`treepack.trainer.tree_attention` (``flex``: the BlockMask; ``flash``: varlen over
the ancestor chains). Grouped-query attention is native (no K/V copies).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType

from treepack.proto.errors import RequestError, UnsupportedModelError
from treepack.trainer.kernels.attention import tree_attention
from treepack.trainer.megatron.context import current_rows

__all__ = ["TreeDotProductAttention"]


class TreeDotProductAttention(DotProductAttention):
    """Megatron's local core attention (same constructor, scale and state) on tree rows.

    Inputs as Megatron's: query ``[sq, b, np, hn]``, key and value ``[sk, b, ng, hn]`` (np
    and ng this TP rank's heads and query groups); output ``[sq, b, np * hn]``.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if self.attn_mask_type != AttnMaskType.arbitrary:
            why = f"attn_mask_type is {self.attn_mask_type.name}; tree rows need arbitrary"
            raise UnsupportedModelError(
                f"TreeDotProductAttention: {why}", rule="mask_type", refusals=(("core_attention", "", why),)
            )

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        attn_mask_type: AttnMaskType | None = None,
        attention_bias: torch.Tensor | None = None,
        packed_seq_params: Any = None,
        **kwargs: Any,
    ) -> torch.Tensor:
        """Attention of ``query`` over ``key``/``value`` under the tree mask (module docstring)."""
        kind = self.attn_mask_type if attn_mask_type is None else attn_mask_type
        assert kind == AttnMaskType.arbitrary, f"tree attention runs mask type arbitrary, got {kind}"
        if attention_bias is not None or packed_seq_params is not None or kwargs:
            extra = sorted(kwargs) + (["attention_bias"] if attention_bias is not None else [])
            extra += ["packed_seq_params"] if packed_seq_params is not None else []
            raise RequestError(
                f"TreeDotProductAttention takes no {extra}: tree rows carry their mask",
                path="$.core_attention",
                rule="unsupported_argument",
            )
        if self.training and self.attention_dropout.p > 0:
            why = f"attention dropout {self.attention_dropout.p} draws random numbers"
            raise UnsupportedModelError(why, rule="dropout", refusals=(("core_attention", type(self).__name__, why),))
        q = query.permute(1, 2, 0, 3)  # [b, np, sq, hn]
        k = key.permute(1, 2, 0, 3)
        v = value.permute(1, 2, 0, 3)
        if attention_mask is not None:
            out = F.scaled_dot_product_attention(
                q, k, v, attn_mask=~attention_mask, scale=self.softmax_scale, enable_gqa=k.shape[1] != q.shape[1]
            )
        else:
            rows = current_rows()
            if rows is None:
                raise RequestError(
                    "TreeDotProductAttention got no attention mask outside packed_forward "
                    "(pass a [b, 1, s, s] mask, True = masked out)",
                    path="$.attention_mask",
                    rule="required",
                )
            out = tree_attention(
                q, k, v, rows.batch, backend=rows.backend, scale=self.softmax_scale, varlen_fn=rows.varlen_fn
            )
        sq, b = query.shape[0], query.shape[1]
        return out.permute(2, 0, 1, 3).reshape(sq, b, -1)
