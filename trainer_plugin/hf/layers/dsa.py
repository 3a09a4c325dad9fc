"""Stock HF DeepSeek-V3.2 and GLM-MoE-DSA sparse attention (DSA) on tree rows.

The kinds ``dsa``, ``glm_dsa``, ``dsa_indexer``.

HF's ``DeepseekV32Attention`` is MLA (low-rank q and kv, a shared RoPE key) plus a
lightning indexer that picks ``index_topk`` keys per query; the eager path folds the picks
into a dense [L, L] mask. On tree rows the patched forward (:func:`dsa_forward`, installed
by :func:`~treepack.trainer.hf.layers.patch_layers`) keeps every projection of the
stock layer and replaces the selection and the attention:

- indexer scores exactly as the stock indexer (no gradient, as in HF), then
  :func:`~treepack.trainer.kernels.sparse.tree_topk`: visible keys only, ties to the lower
  in-sequence position, invisible picks dropped;
- :func:`~treepack.trainer.kernels.sparse.sparse_attention` over the picked keys (a gather of
  ``index_topk`` keys per query, no [L, L] mask).

GLM-MoE-DSA (``GlmMoeDsaAttention``, GLM-5 style) is the same layer with interleaved RoPE
in its indexer and **cross-layer top-k sharing**: a layer whose
``config.indexer_types[layer_idx]`` is ``"shared"`` has no indexer and reuses the top-k of
the previous full layer, which HF passes up the stack as ``prev_topk_indices``. The
patched forward (:func:`glm_dsa_forward`) returns a :class:`TreeSelection` (row indices
plus validity of the picks, computed once by the full layer's tree top-k) in that slot, so
a shared layer attends to exactly the keys its full layer picked on the tree, as it does
alone; a shared layer that receives anything else (a stock selection) is refused.

Under context parallelism (:func:`dsa_shard_attention`) the projections run on the rank's
shard, the indexer scores the shard's queries against the whole row's keys (gathered: one
head) and its picks equal the whole row's; attention is Ulysses over the query heads.

Ties: the stock indexer ends in ``torch.topk``, whose order among equal scores is
unspecified (on CPU it differs between a row and the same sequence alone), and ReLU-sum
scores tie at exactly 0 often. Tree rows break them towards the lower position. Unpacked
calls keep the stock order, so the patches leave the model as found, bitwise; inside
:func:`position_ties` (the kind's ``reference``: the probe's alone runs enter it, through
:func:`~treepack.trainer.hf.layers.reference_rules`) a patched indexer breaks ties on
unpacked calls by the same rule (:func:`position_tiebreak_indexer_forward`: a stable sort,
lower position first), so the packed run of a sequence equals its unpacked run. That only
reorders equal scores: the picked score values are those of ``torch.topk``.
"""

from __future__ import annotations

import sys
import types
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

import torch

from treepack.proto.errors import RequestError
from treepack.trainer.hf.context import packed_context
from treepack.trainer.hf.layers.spec import STOCK_ATTR, ContextShard, TreeLayer
from treepack.trainer.kernels.cp import divide_refusal, gather_seq, heads_to_seq, seq_to_heads
from treepack.trainer.kernels.sparse import indexer_scores, shard_tree_topk, sparse_attention, tree_topk

__all__ = [
    "TreeSelection",
    "dsa_indexer_scores",
    "dsa_tree_attention",
    "dsa_shard_attention",
    "dsa_forward",
    "glm_dsa_forward",
    "position_tiebreak_indexer_forward",
    "position_ties",
    "LAYERS",
    "DSA",
    "GLM_DSA",
    "DSA_INDEXER",
]

# Indexer class -> the RoPE function of its modeling module. Only the indexers of the DSA
# layers patched here are listed: no other class reaches here.
_INDEXER_ROPE = {"DeepseekV32Indexer": "apply_rotary_pos_emb", "GlmMoeDsaIndexer": "apply_rotary_pos_emb_interleave"}
# Unpacked calls of a patched indexer break top-k ties by position only inside position_ties().
_POSITION_TIES: ContextVar[bool] = ContextVar("treepack_position_ties", default=False)


@contextmanager
def position_ties() -> Iterator[None]:
    """Inside the block, unpacked calls of patched DSA indexers order equal top-k scores by
    key position, lower first: the rule of tree rows (outside it they run stock).

    For reference runs that must equal the packed run exactly (the probe's alone runs, tests):
    HF's ``torch.topk`` leaves the order of ties open, and ReLU-sum scores tie at exactly 0
    often. Run the reference's backward inside the block too when checkpointing replays it.
    """
    token = _POSITION_TIES.set(True)
    try:
        yield
    finally:
        _POSITION_TIES.reset(token)


@dataclass(frozen=True, slots=True)
class TreeSelection:
    """A DSA layer's top-k picks on tree rows, handed to the layers that share them.

    Attributes:
        idx: [K, L, k] int64 row index of each pick, best first.
        valid: [K, L, k] bool, False for picks that are not visible (dropped).
    """

    idx: torch.Tensor
    valid: torch.Tensor


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
    q, k, weights = _indexer_qkw(indexer, hidden_states, q_resid, position_embeddings)
    if cache is not None:
        k = cache.update_indexer(k, indexer.layer_idx)
    return indexer_scores(q, k, weights, indexer.softmax_scale)


def _indexer_qkw(
    indexer: torch.nn.Module,
    hidden_states: torch.Tensor,
    q_resid: torch.Tensor,
    position_embeddings: tuple[torch.Tensor, torch.Tensor],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The stock indexer's queries [B, S, H, D], keys [B, S, D] (RoPE applied) and head weights [B, S, H]."""
    name = type(indexer).__name__
    if name not in _INDEXER_ROPE:
        raise RequestError(
            f"unsupported sparse indexer {name}; known: {sorted(_INDEXER_ROPE)}", path="$.model", rule="unsupported"
        )
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
    weights = indexer.weights_proj(hidden_states.to(indexer.weights_proj.weight.dtype)).float() * (
        indexer.n_heads**-0.5
    )
    return q, k, weights


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
    """The patched indexer's forward on unpacked calls: stock, or inside :func:`position_ties`
    the stock scores with ties broken towards lower positions.

    Same inputs (including a cache of earlier keys) and output as the stock ``forward``
    ([B, S, topk] int32 key indices); with the rule, equal scores are ordered by key index,
    which is the key's position in an unpacked sequence.
    """
    if not _POSITION_TIES.get():
        stock = getattr(self, STOCK_ATTR)
        return stock(hidden_states, q_resid, position_embeddings, attention_mask, position_ids, cache=cache, **kwargs)
    scores = dsa_indexer_scores(self, hidden_states, q_resid, position_embeddings, cache)
    if attention_mask.dtype == torch.bool:
        scores = scores.masked_fill(~attention_mask, float("-inf"))
    else:
        scores = scores + attention_mask
    topk = min(self.index_topk, scores.shape[-1])
    return torch.sort(scores, dim=-1, descending=True, stable=True).indices[..., :topk].to(torch.int32)


def dsa_tree_attention(
    attn: torch.nn.Module,
    hidden_states: torch.Tensor,
    position_embeddings: tuple[torch.Tensor, torch.Tensor],
    batch: Any,
    shared: TreeSelection | None = None,
) -> tuple[torch.Tensor, TreeSelection]:
    """A DSA layer on tree rows: stock MLA projections, tree top-k, gathered attention.

    Args:
        attn: a ``DeepseekV32Attention`` or ``GlmMoeDsaAttention``.
        hidden_states: [K, L, hidden] packed rows.
        position_embeddings: (cos, sin) from the per-sequence ``position_ids``.
        batch: the :class:`~treepack.trainer.data.packed_batch.PackedBatch` (``subtree_end``, ``position_ids``).
        shared: for a layer without an indexer (GLM ``"shared"``), the selection of the
            previous full layer.

    Returns:
        ([K, L, hidden], the selection this layer attended with).
    """
    K, L = hidden_states.shape[:2]
    q_resid, query, key, value = _project(attn, hidden_states, position_embeddings, batch)
    if getattr(attn, "indexer", None) is not None:
        scores = dsa_indexer_scores(attn.indexer, hidden_states, q_resid, position_embeddings)
        sel = TreeSelection(*tree_topk(scores, batch.subtree_end, batch.position_ids, attn.indexer.index_topk))
    else:
        sel = _shared(attn, shared, K, L)
    out = sparse_attention(query, key, value, sel.idx, sel.valid, attn.scaling)
    return attn.o_proj(out.reshape(K, L, -1)), sel


def dsa_shard_attention(
    attn: torch.nn.Module,
    hidden_states: torch.Tensor,
    position_embeddings: tuple[torch.Tensor, torch.Tensor],
    batch: Any,
    shared: TreeSelection | None = None,
) -> tuple[torch.Tensor, TreeSelection]:
    """A DSA layer on one context-parallel shard (``batch.cp``): :func:`dsa_tree_attention` split over the group.

    The projections run on this rank's shard of every row. The indexer scores this
    shard's queries against the whole row's indexer keys (one head: gathered whole) and
    picks with :func:`~treepack.trainer.kernels.sparse.shard_tree_topk`, whose picks equal
    the whole row's; the picks are gathered to whole rows (so a GLM ``"shared"`` layer
    reuses them as alone). Attention is Ulysses: queries, keys and values go to whole rows of
    ``H / cp`` heads (an all-to-all), the sparse attention runs there, and the output comes back.

    Args:
        attn: a ``DeepseekV32Attention`` or ``GlmMoeDsaAttention``.
        hidden_states: [K, Ls, hidden] this rank's shard of every row.
        position_embeddings: (cos, sin) of the shard's positions.
        batch: the CP shard (``batch.cp``, ``batch.cp_full``).
        shared: for a layer without an indexer, the (whole-row) selection of the previous full layer.

    Returns:
        ([K, Ls, hidden], the whole-row selection this layer attended with).
    """
    cp, full = batch.cp, batch.cp_full
    K, Ls = hidden_states.shape[:2]
    C = full.seq_len
    q_resid, query, key, value = _project(attn, hidden_states, position_embeddings, batch)
    if getattr(attn, "indexer", None) is not None:
        with torch.no_grad():  # as the stock indexer
            q, k, w = _indexer_qkw(attn.indexer, hidden_states, q_resid, position_embeddings)
            scores = indexer_scores(q, gather_seq(k, cp)[:, :C], w, attn.indexer.softmax_scale)
            idx, valid = shard_tree_topk(
                scores, full.subtree_end, full.position_ids, attn.indexer.index_topk, query_start=cp.rank * Ls
            )
            sel = TreeSelection(gather_seq(idx, cp)[:, :C], gather_seq(valid.to(torch.uint8), cp)[:, :C].bool())
    else:
        sel = _shared(attn, shared, K, C)
    q, k, v = (seq_to_heads(x, cp)[:, :, :C] for x in (query, key, value))
    out = sparse_attention(q, k, v, sel.idx, sel.valid, attn.scaling).transpose(1, 2)  # [K, H/P, C, Dv]
    out = torch.cat([out, out.new_zeros(*out.shape[:2], cp.size * Ls - C, out.shape[3])], dim=2)  # CP padding
    out = heads_to_seq(out, cp).transpose(1, 2)
    return attn.o_proj(out.reshape(K, Ls, -1)), sel


def _shared(attn: torch.nn.Module, shared: Any, K: int, L: int) -> TreeSelection:
    if isinstance(shared, TreeSelection) and tuple(shared.idx.shape[:2]) == (K, L):
        return shared
    raise RequestError(
        f"{type(attn).__name__} (layer {getattr(attn, 'layer_idx', '?')}) shares the top-k of an earlier layer "
        "but received "
        f"{type(shared).__name__}, not that layer's tree selection: every DSA layer of the model must be patched",
        path="$.model",
        rule="unpatched_sparse_layer",
    )


def _project(
    attn: torch.nn.Module,
    hidden_states: torch.Tensor,
    position_embeddings: tuple[torch.Tensor, torch.Tensor],
    batch: Any,
) -> tuple[torch.Tensor, ...]:
    """The stock MLA projections: (q_resid [K, L, q_lora], query [K, H, L, dq], key [K, H, L, dq],
    value [K, H, L, dv])."""
    K, L = hidden_states.shape[:2]
    if (K, L) != tuple(batch.subtree_end.shape):
        raise RequestError(
            f"hidden_states has {K} rows of {L}, the batch {tuple(batch.subtree_end.shape)}",
            path="$.hidden_states",
            rule="shape",
        )
    if attn.training and attn.attention_dropout:
        raise RequestError(
            f"attention dropout {attn.attention_dropout} is not supported on packed rows; set attention_dropout=0",
            path="$.model.config.attention_dropout",
            rule="unsupported",
        )
    q_resid = attn.q_a_layernorm(attn.q_a_proj(hidden_states))
    q_states = attn.q_b_proj(q_resid).view(K, L, -1, attn.qk_head_dim).transpose(1, 2)
    q_pass, q_rot = torch.split(q_states, [attn.qk_nope_head_dim, attn.qk_rope_head_dim], dim=-1)
    kv_pass, k_rot = torch.split(
        attn.kv_a_proj_with_mqa(hidden_states), [attn.kv_lora_rank, attn.qk_rope_head_dim], dim=-1
    )
    k_pass = attn.kv_a_layernorm(kv_pass).view(K, 1, L, attn.kv_lora_rank)
    k_rot = k_rot.view(K, 1, L, attn.qk_rope_head_dim)
    cos, sin = position_embeddings
    q_rot, k_rot = _modeling(attn).apply_rotary_pos_emb_interleave(q_rot, k_rot, cos, sin)
    query = torch.cat((q_pass, q_rot), dim=-1)
    key, value = attn.expand_kv(k_pass, k_rot)
    return q_resid, query, key, value


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
        return getattr(self, STOCK_ATTR)(
            hidden_states, position_embeddings, attention_mask, cache=cache, position_ids=position_ids, **kwargs
        )
    if cache is not None:
        raise RequestError(
            "packed rows run without a cache: call the model with use_cache=False",
            path="$.use_cache",
            rule="unsupported",
        )
    run = dsa_tree_attention if ctx.batch.cp is None else dsa_shard_attention
    return run(self, hidden_states, position_embeddings, ctx.batch)[0], None


def glm_dsa_forward(
    self: torch.nn.Module,
    hidden_states: torch.Tensor,
    position_embeddings: tuple[torch.Tensor, torch.Tensor],
    attention_mask: Any = None,
    cache: Any = None,
    position_ids: torch.Tensor | None = None,
    prev_topk_indices: Any = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None, Any]:
    """Patched ``GlmMoeDsaAttention.forward``: tree rows when a packed batch is active, else stock.

    Returns what the stock layer returns, ``(output, None, selection)``; on tree rows the
    selection is a :class:`TreeSelection`, which the next (shared) layer receives as
    ``prev_topk_indices``.
    """
    ctx = packed_context(kwargs)
    if ctx is None:
        stock = getattr(self, STOCK_ATTR)
        return stock(
            hidden_states,
            position_embeddings,
            attention_mask,
            cache=cache,
            position_ids=position_ids,
            prev_topk_indices=prev_topk_indices,
            **kwargs,
        )
    if cache is not None:
        raise RequestError(
            "packed rows run without a cache: call the model with use_cache=False",
            path="$.use_cache",
            rule="unsupported",
        )
    run = dsa_tree_attention if ctx.batch.cp is None else dsa_shard_attention
    out, sel = run(self, hidden_states, position_embeddings, ctx.batch, shared=prev_topk_indices)
    return out, None, sel


def _heads_refusal(attn: torch.nn.Module, cp_size: int) -> str | None:
    return divide_refusal("query heads", attn.num_heads, cp_size)


# Patched by exact class name: their forwards read the batch's ancestor masks, not a schedule;
# under CP the patched forward runs dsa_shard_attention itself.
_SHARD = ContextShard(refusal=_heads_refusal)
DSA = TreeLayer(kind="dsa", classes=("DeepseekV32Attention",), patch=dsa_forward, shard=_SHARD)
GLM_DSA = TreeLayer(kind="glm_dsa", classes=("GlmMoeDsaAttention",), patch=glm_dsa_forward, shard=_SHARD)
# The indexers of patched DSA layers run stock on unpacked calls, or break ties by position
# inside position_ties(); on tree rows (and under CP) their DSA layer computes the scores itself.
DSA_INDEXER = TreeLayer(
    kind="dsa_indexer",
    classes=tuple(_INDEXER_ROPE),
    patch=position_tiebreak_indexer_forward,
    shard=ContextShard(),
    reference=position_ties,
)
LAYERS = (DSA, GLM_DSA, DSA_INDEXER)
