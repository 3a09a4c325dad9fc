"""Stock HF DeepSeek-V3.2 sparse attention (DSA) on tree rows.

HF's ``DeepseekV32Attention`` is MLA (low-rank q and kv, a shared RoPE key) plus a
lightning indexer that picks ``index_topk`` keys per query; the eager path folds the picks
into a dense [L, L] mask. On tree rows the patched forward (:func:`dsa_forward`, installed
by :func:`~treepack.trainer.hf.hybrid.patch_hybrid_layers`) keeps every projection of the
stock layer and replaces the selection and the attention:

- indexer scores exactly as the stock indexer (no gradient, as in HF), then
  :func:`~treepack.trainer.kernels.sparse.tree_topk`: visible keys only, ties to the lower
  in-sequence position, invisible picks dropped;
- :func:`~treepack.trainer.kernels.sparse.sparse_attention` over the picked keys (a gather of
  ``index_topk`` keys per query, no [L, L] mask).

Ties: the stock indexer ends in ``torch.topk``, whose order among equal scores is
unspecified (on CPU it differs between a row and the same sequence alone), and ReLU-sum
scores tie at exactly 0 often. So a patched model also gives its indexers, for unpacked
calls, the same rule (:func:`position_tiebreak_indexer_forward`: a stable sort, lower
position first). That only reorders equal scores: the picked score values are those of
``torch.topk``. With it, the packed run of a sequence equals its unpacked run.
"""

from __future__ import annotations

import sys
import types
from typing import Any

import torch

from treepack.proto.errors import RequestError
from treepack.trainer.hf.context import BATCH_KWARG, current_packed
from treepack.trainer.kernels.sparse import indexer_scores, sparse_attention, tree_topk

__all__ = [
    "dsa_indexer_scores",
    "dsa_tree_attention",
    "dsa_forward",
    "position_tiebreak_indexer_forward",
    "packed_context",
    "STOCK_ATTR",
]

# Indexer class -> the RoPE function of its modeling module. Only the indexers of the DSA
# layers that hybrid.patch_hybrid_layers patches are listed: no other class reaches here.
_INDEXER_ROPE = {"DeepseekV32Indexer": "apply_rotary_pos_emb"}
# Where a patched module keeps its bound stock forward (in its __dict__, outside nn.Module's registries).
STOCK_ATTR = "_treepack_stock_forward"


def packed_context(kwargs: dict[str, Any]) -> Any:
    """The active packed context of a layer call (``treepack_context`` kwarg, else the context variable), or None."""
    ctx = kwargs.get(BATCH_KWARG)
    return ctx if ctx is not None else current_packed()


def _modeling(module: torch.nn.Module) -> types.ModuleType:
    return sys.modules[type(module).__module__]


@torch.no_grad()
def dsa_indexer_scores(
    indexer: torch.nn.Module,
    hidden_states: torch.Tensor,
    q_resid: torch.Tensor,
    position_embeddings: tuple[torch.Tensor, torch.Tensor],
    cache: Any = None,
) -> torch.Tensor:
    """The stock indexer's scores before masking and top-k.

    Args:
        indexer: a ``DeepseekV32Indexer``.
        hidden_states: [B, S, hidden]. q_resid: [B, S, q_lora_rank] (``q_a_layernorm(q_a_proj(x))``).
        position_embeddings: (cos, sin) [B, S, rope_dim] from the model's rotary embedding.
        cache: an HF cache holding the indexer keys of earlier tokens (unpacked decoding),
            updated with this call's keys as the stock indexer does; None on packed rows.

    Returns:
        [B, S, T] float32 scores, T = S plus the cached keys.
    """
    name = type(indexer).__name__
    if name not in _INDEXER_ROPE:
        raise RequestError(f"unsupported sparse indexer {name}; known: {sorted(_INDEXER_ROPE)}", path="$.model", rule="unsupported")
    rope = getattr(_modeling(indexer), _INDEXER_ROPE[name])
    B, S, _ = hidden_states.shape
    cos, sin = position_embeddings
    q = indexer.wq_b(q_resid).view(B, S, indexer.n_heads, indexer.head_dim)
    split = [indexer.qk_rope_head_dim, indexer.head_dim - indexer.qk_rope_head_dim]
    q_rot, q_pass = torch.split(q, split, dim=-1)
    k = indexer.k_norm(indexer.wk(hidden_states)).unsqueeze(2)
    k_rot, k_pass = torch.split(k, split, dim=-1)
    q_rot, k_rot = rope(q_rot, k_rot, cos, sin, unsqueeze_dim=2)
    q = torch.cat([q_rot, q_pass], dim=-1)
    k = torch.cat([k_rot, k_pass], dim=-1).squeeze(2)
    if cache is not None:
        k = cache.update_indexer(k, indexer.layer_idx)
    weights = indexer.weights_proj(hidden_states.to(indexer.weights_proj.weight.dtype)).float() * (indexer.n_heads**-0.5)
    return indexer_scores(q, k, weights, indexer.softmax_scale)


def position_tiebreak_indexer_forward(
    self: torch.nn.Module,
    hidden_states: torch.Tensor,
    q_resid: torch.Tensor,
    position_embeddings: tuple[torch.Tensor, torch.Tensor],
    attention_mask: torch.Tensor,
    position_ids: torch.Tensor | None = None,
    cache: Any = None,
    **kwargs: Any,
) -> torch.Tensor:
    """The stock indexer's forward with ties broken towards lower positions (unpacked calls).

    Same inputs (including a cache of earlier keys) and output as the stock ``forward``
    ([B, S, topk] int32 key indices); equal scores are ordered by key index, which is the
    key's position in an unpacked sequence.
    """
    scores = dsa_indexer_scores(self, hidden_states, q_resid, position_embeddings, cache)
    if attention_mask.dtype == torch.bool:
        scores = scores.masked_fill(~attention_mask, float("-inf"))
    else:
        scores = scores + attention_mask
    topk = min(self.index_topk, scores.shape[-1])
    return torch.sort(scores, dim=-1, descending=True, stable=True).indices[..., :topk].to(torch.int32)


def dsa_tree_attention(attn: torch.nn.Module, hidden_states: torch.Tensor, position_embeddings: tuple[torch.Tensor, torch.Tensor], batch: Any) -> torch.Tensor:
    """``DeepseekV32Attention`` on tree rows: stock MLA projections, tree top-k, gathered attention.

    Args:
        attn: the attention module.
        hidden_states: [K, L, hidden] packed rows.
        position_embeddings: (cos, sin) from the per-sequence ``position_ids``.
        batch: the :class:`~treepack.trainer.data.packed_batch.PackedBatch` (``subtree_end``, ``position_ids``).

    Returns:
        [K, L, hidden].
    """
    K, L = hidden_states.shape[:2]
    if (K, L) != tuple(batch.subtree_end.shape):
        raise RequestError(f"hidden_states has {K} rows of {L}, the batch {tuple(batch.subtree_end.shape)}", path="$.hidden_states", rule="shape")
    if attn.training and attn.attention_dropout:
        raise RequestError(f"attention dropout {attn.attention_dropout} is not supported on packed rows; set attention_dropout=0", path="$.model.config.attention_dropout", rule="unsupported")
    q_resid = attn.q_a_layernorm(attn.q_a_proj(hidden_states))
    q_states = attn.q_b_proj(q_resid).view(K, L, -1, attn.qk_head_dim).transpose(1, 2)
    q_pass, q_rot = torch.split(q_states, [attn.qk_nope_head_dim, attn.qk_rope_head_dim], dim=-1)
    kv_pass, k_rot = torch.split(attn.kv_a_proj_with_mqa(hidden_states), [attn.kv_lora_rank, attn.qk_rope_head_dim], dim=-1)
    k_pass = attn.kv_a_layernorm(kv_pass).view(K, 1, L, attn.kv_lora_rank)
    k_rot = k_rot.view(K, 1, L, attn.qk_rope_head_dim)
    cos, sin = position_embeddings
    q_rot, k_rot = _modeling(attn).apply_rotary_pos_emb_interleave(q_rot, k_rot, cos, sin)
    query = torch.cat((q_pass, q_rot), dim=-1)
    key, value = attn.expand_kv(k_pass, k_rot)
    scores = dsa_indexer_scores(attn.indexer, hidden_states, q_resid, position_embeddings)
    idx, valid = tree_topk(scores, batch.subtree_end, batch.position_ids, attn.indexer.index_topk)
    out = sparse_attention(query, key, value, idx, valid, attn.scaling)
    return attn.o_proj(out.reshape(K, L, -1))


def dsa_forward(
    self: torch.nn.Module,
    hidden_states: torch.Tensor,
    position_embeddings: tuple[torch.Tensor, torch.Tensor],
    attention_mask: Any = None,
    cache: Any = None,
    position_ids: torch.Tensor | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Patched ``DeepseekV32Attention.forward``: tree rows when a packed batch is active, else stock."""
    ctx = packed_context(kwargs)
    if ctx is None:
        return getattr(self, STOCK_ATTR)(hidden_states, position_embeddings, attention_mask, cache=cache, position_ids=position_ids, **kwargs)
    if cache is not None:
        raise RequestError("packed rows run without a cache: call the model with use_cache=False", path="$.use_cache", rule="unsupported")
    return dsa_tree_attention(self, hidden_states, position_embeddings, ctx.batch), None
