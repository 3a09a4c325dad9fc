"""Tree rows through a Megatron ``GPTModel``: :func:`packed_forward`.

The stock ``GPTModel.forward`` runs on the batch's ``[K, L]`` token ids; the two tree
modules :func:`~treepack.trainer.megatron.from_hf` swapped in read the rows from the
context this call sets (:mod:`~treepack.trainer.megatron.context`): the rotary embedding
takes the plan's ``position_ids``, the core attention the tree mask. The model is admitted
(:func:`~treepack.trainer.megatron.spec.check_megatron_model`) before any compute.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from treepack.proto.errors import RequestError
from treepack.trainer.kernels.attention import BACKENDS
from treepack.trainer.megatron.context import MegatronRows, use_rows

__all__ = ["packed_forward", "tree_attention_mask"]


def tree_attention_mask(batch: Any) -> torch.Tensor:
    """[K, 1, L, L] bool tree mask in Megatron's convention: True = masked out (``~batch.dense_mask()``)."""
    return ~batch.dense_mask()


def _inner(model: torch.nn.Module) -> torch.nn.Module:
    """The GPTModel inside wrappers (DDP, Float16Module) that keep it as ``.module``."""
    inner = model
    while type(inner).__name__ != "GPTModel" and isinstance(getattr(inner, "module", None), torch.nn.Module):
        inner = inner.module
    return inner


def packed_forward(
    model: torch.nn.Module, batch: Any, *, backend: str = "sdpa", varlen_fn: Callable | None = None
) -> torch.Tensor:
    """Logits of tree-packed rows from a Megatron ``GPTModel`` built by ``from_hf``.

    Args:
        model: the model (or a wrapper keeping it as ``.module``: Megatron's DDP, Float16Module).
        batch: a :class:`~treepack.trainer.data.packed_batch.PackedBatch`
            (:func:`treepack.trainer.materialize`), whole rows (no context-parallel shard).
        backend: tree attention backend: ``sdpa`` (the ``[K, 1, L, L]`` mask handed to the
            core attention in Megatron's convention), ``flex`` or ``flash``
            (:func:`treepack.trainer.tree_attention`).
        varlen_fn: ``flash`` only: the varlen kernel (default ``flash_attn_varlen_func``;
            :func:`treepack.trainer.naive_varlen_attention` runs on CPU).

    Returns:
        [K, L, padded_vocab // tp] logits, batch-first: this TP rank's slice of the
        vocabulary (:func:`~treepack.trainer.megatron.vocab_parallel_target_logprobs` reads it).

    Raises:
        UnsupportedModelError: the model cannot run tree rows exactly (before any compute).
        RequestError: a backend outside ``BACKENDS``, a CP shard, images, or recomputation
            with a backend that reads the rows from the context.
    """
    from treepack.trainer.megatron.spec import check_megatron_model

    if backend not in BACKENDS:
        raise RequestError(f"backend must be one of {BACKENDS}, got {backend!r}", path="$.backend", rule="enum")
    if getattr(batch, "cp", None) is not None or getattr(batch, "images", None) is not None:
        raise RequestError(
            "the Megatron backend runs whole text rows (no context-parallel shard, no images)",
            path="$.batch",
            rule="megatron_rows",
        )
    inner = _inner(model)
    check_megatron_model(inner)
    if backend != "sdpa" and getattr(inner.config, "recompute_granularity", None) is not None:
        # Recomputation reruns the attention in the backward pass, outside this call's context:
        # only the sdpa backend hands the mask as an argument that survives it.
        raise RequestError(
            f"activation recomputation needs backend='sdpa' (got {backend!r})", path="$.backend", rule="recompute"
        )
    mask = tree_attention_mask(batch) if backend == "sdpa" else None
    rows = MegatronRows(batch=batch, position_ids=batch.position_ids, backend=backend, varlen_fn=varlen_fn)
    with use_rows(rows):
        return model(input_ids=batch.input_ids, position_ids=batch.position_ids, attention_mask=mask)
