"""HF transformers on tree-packed rows: :func:`packed_forward`.

:func:`packed_forward` runs a stock HF decoder model (Qwen3, Llama, Mistral, ...) on a
:class:`~treepack.trainer.data.packed_batch.PackedBatch`:

- ``input_ids`` and the per-sequence ``position_ids`` go in as they are, so RoPE sees
  each token's position in its own sequence;
- the model's attention implementation is switched to ``"treepack"``
  (:data:`~treepack.trainer.hf.attention.ATTN_IMPLEMENTATION`), registered in HF's ``AttentionInterface``. HF builds no
  mask of its own for an implementation without a mask function, so it never infers the
  (linear, wrong) packing from ``position_ids``; ``packed_forward`` passes the tree mask
  itself (dense for ``sdpa``, BlockMask for ``flex``), which HF hands to every layer
  untouched, and :func:`~treepack.trainer.hf.attention.treepack_attention` takes everything else from the batch;
- the batch travels as the keyword argument ``treepack_context`` (HF forwards
  ``**kwargs`` to the attention functions, and activation checkpointing replays it) and
  in a context variable (:mod:`treepack.trainer.hf.context`) for layers without ``**kwargs``.
  Other layer kinds (recurrent and conv mixers, sparse indexers) are patched to read the same
  context; nothing here assumes attention is the only layer that needs it.

The model stays in ``"treepack"`` mode after ``packed_forward`` returns, because
gradient checkpointing re-runs the layers during ``backward()`` and must dispatch the same
way; an unpacked call then raises a clear error until :func:`disable_tree_attention`.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from treepack.proto.errors import RequestError
from treepack.trainer.data.packed_batch import PackedBatch
from treepack.trainer.hf.attention import ATTN_IMPLEMENTATION, register_tree_attention
from treepack.trainer.hf.context import BATCH_KWARG, PackedContext, use_packed
from treepack.trainer.kernels.attention import BACKENDS

__all__ = ["enable_tree_attention", "disable_tree_attention", "packed_forward"]


def enable_tree_attention(model: Any, *, patch_layers: bool = True) -> str:
    """Switch ``model`` (and its sub-models) to tree attention; returns the previous implementation.

    Args:
        model: the HF model.
        patch_layers: also install the tree forwards on recurrent / conv mixers (GDN,
            Mamba2, Mamba, KDA, short conv: :mod:`treepack.trainer.hf.mixers`) and
            DeepSeek-V3.2 sparse attention layers
            (:func:`treepack.trainer.hf.hybrid.patch_hybrid_layers`, idempotent); without
            them those layers would scan each row as one sequence.
    """
    register_tree_attention()
    if patch_layers:
        from treepack.trainer.hf.hybrid import patch_hybrid_layers

        patch_hybrid_layers(model)
    prev = model.config._attn_implementation
    if prev != ATTN_IMPLEMENTATION:
        model.set_attn_implementation(ATTN_IMPLEMENTATION)
        if model.config._attn_implementation != ATTN_IMPLEMENTATION:
            raise RequestError(
                f"{type(model).__name__} does not accept a custom attention implementation "
                "(it does not dispatch through HF's AttentionInterface)",
                path="$.model",
                rule="unsupported",
            )
    return prev


def disable_tree_attention(model: Any, implementation: str = "sdpa") -> None:
    """Switch ``model`` back to a stock implementation (for unpacked calls)."""
    model.set_attn_implementation(implementation)


def packed_forward(
    model: Any,
    batch: PackedBatch,
    *,
    backend: str = "sdpa",
    varlen_fn: Callable | None = None,
    compile: bool | None = None,
    output: str = "logits",
    patch_layers: bool = True,
    **kwargs: Any,
) -> torch.Tensor:
    """Run an HF causal LM on the packed rows.

    Args:
        model: an HF ``*ForCausalLM`` (or any model returning ``.logits``) whose layers
            dispatch attention through ``AttentionInterface``.
        batch: the packed batch.
        backend: ``sdpa`` | ``flex`` | ``flash`` (:func:`~treepack.trainer.tree_attention`).
        varlen_fn: ``flash`` backend kernel override (e.g. ``naive_varlen_attention`` on CPU).
        compile: ``flex`` backend: compile ``flex_attention`` (default: on CUDA).
        output: ``logits``, or ``hidden`` to run the base model only and return its final
            hidden states (then :meth:`PackedBatch.target_logprobs_from_hidden` with
            ``model.lm_head`` never materializes [K, L, vocab]).
        patch_layers: patch mixer / DSA layers for tree rows (see :func:`enable_tree_attention`);
            False only to run their stock forward on purpose (a negative control).
        **kwargs: passed to ``model(...)``.

    Returns:
        [K, L, vocab] logits, or [K, L, hidden] hidden states, of the packed rows.
    """
    if backend not in BACKENDS:
        raise RequestError(f"backend must be one of {BACKENDS}, got {backend!r}", path="$.backend", rule="enum")
    if output not in ("logits", "hidden"):
        raise RequestError(f"output must be 'logits' or 'hidden', got {output!r}", path="$.output", rule="enum")
    enable_tree_attention(model, patch_layers=patch_layers)
    ctx = PackedContext(batch=batch, backend=backend, options={"varlen_fn": varlen_fn, "compile": compile})
    mask = None
    if backend == "sdpa":
        mask = batch.dense_mask()
    elif backend == "flex":
        mask = batch.block_mask()
    target = model.base_model if output == "hidden" else model
    with use_packed(ctx):
        out = target(
            input_ids=batch.input_ids,
            position_ids=batch.position_ids,
            attention_mask=mask,
            use_cache=False,
            **{BATCH_KWARG: ctx},
            **kwargs,
        )
    if output == "hidden":
        return out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]
    return out.logits if hasattr(out, "logits") else out[0]
