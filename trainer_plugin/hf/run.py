"""The packed run of an admitted model: the batch's metadata, the packed context, the model call.

:func:`run_packed` builds, before the first layer runs, every plan-derived structure the
layers read (:func:`build_mask`: the tree mask, varlen metadata, the tree schedule of the
recurrent / conv layers), hands the batch to the model as the ``treepack_context`` keyword
and the current packed context (:mod:`treepack.trainer.hf.context`), and calls the model
through its wrappers (:mod:`treepack.trainer.hf.wrapped`), with a PEFT aLoRA adapter's
per-sequence activation (:mod:`treepack.trainer.hf.alora`). What it returns follows the
model's head (:mod:`treepack.trainer.hf.task_head`): a sequence-classification head's scores
are read at each sequence's own pooled token, every other head's outputs per row position.
The model must have been admitted for the setup first (:func:`~treepack.trainer.hf.admission.admit`).
"""

from __future__ import annotations

from typing import Any

import torch
from torch.profiler import record_function

from treepack.trainer.data.packed_batch import PackedBatch
from treepack.trainer.hf.admission.setup import PackedSetup
from treepack.trainer.hf.alora import alora_inputs
from treepack.trainer.hf.attention import TREE_MASK_OPTION
from treepack.trainer.hf.context import BATCH_KWARG, PackedContext, use_packed
from treepack.trainer.hf.layer_masks import attention_mask_for
from treepack.trainer.hf.task_head import sequence_scores, task_head
from treepack.trainer.hf.vision import image_inputs
from treepack.trainer.hf.wrapped import forward_hidden, forward_logits
from treepack.trainer.kernels.cp_attention import shard_mask

__all__ = ["build_mask", "run_packed"]


def build_mask(batch: PackedBatch, backend: str, scans: bool = False) -> Any:
    """The attention mask handed to the model; builds, before the first layer runs, every
    plan-derived structure the layers read (varlen metadata, with ``scans`` the tree schedule
    of the recurrent / conv layers), once per batch and on the batch's device.

    Args:
        batch: the packed batch (a CP shard or whole rows).
        backend: ``sdpa`` | ``flex`` | ``flash``.
        scans: layers of the model read the tree schedule.

    Returns:
        The dense mask (``sdpa``), the BlockMask (``flex``), or None (varlen kernels).
    """
    if batch.cp is not None:
        if batch.cp_strategy == "allgather":
            return shard_mask(batch, backend)  # this shard's queries over the whole key axis
        batch = batch.cp_full  # Ulysses attention runs whole rows
    elif scans:
        batch.tree_schedule()
    if backend == "sdpa":
        return batch.dense_mask()
    if backend == "flex":
        return batch.block_mask()
    # No mask for varlen kernels; their metadata is built (and on the device) now, before
    # the first layer runs, not inside layer 0's attention mid-forward: the copy-free levels
    # (full attention) and the gathered chains (windowed and chunked layers).
    batch.varlen_levels()
    batch.varlen_meta()
    return None


def run_packed(
    model: Any, hf: Any, batch: PackedBatch, setup: PackedSetup, *, scans: bool, kwargs: dict[str, Any]
) -> torch.Tensor:
    """Run the admitted ``model`` on the packed rows of ``batch``.

    Args:
        model: the model as the caller holds it (wrappers run).
        hf: its unwrapped HF model.
        batch: the packed batch.
        setup: the forward's options (backend, output, varlen_fn, compile).
        scans: layers of the model read the rows' tree schedule (the admission's walk found them).
        kwargs: passed to ``model(...)``.

    Returns:
        [K, L, vocab] logits, or [K, L, hidden] hidden states, of the packed rows; a
        token-classification head's [K, L, num_labels] logits; a sequence-classification
        head's [S_local, num_labels] scores, one per sequence of ``batch.local_seqs``.
    """
    head = task_head(hf)
    mm = image_inputs(hf, batch, kwargs)
    with record_function("treepack::metadata"):
        mask = build_mask(batch, setup.backend, scans=scans)
    options = {"varlen_fn": setup.varlen_fn, "compile": setup.compile, TREE_MASK_OPTION: mask}
    ctx = PackedContext(batch=batch, backend=setup.backend, options=options)
    inputs = dict(
        input_ids=batch.input_ids,
        position_ids=mm.pop("position_ids", batch.position_ids),
        attention_mask=attention_mask_for(hf, mask),
        use_cache=False,
        **{BATCH_KWARG: ctx},
        **mm,
        **alora_inputs(model, batch),
        **kwargs,
    )
    with use_packed(ctx):
        if setup.output == "hidden":
            return forward_hidden(model, hf, inputs)
        if head.kind == "sequence":
            return sequence_scores(model, hf, head, inputs, batch)
        return forward_logits(model, inputs)
