"""Packed data: a plan plus the trainer's per-sequence arrays -> :class:`PackedBatch`.

- :mod:`~treepack.trainer.data.materialize`: :func:`materialize` (one vectorized gather
  per array);
- :mod:`~treepack.trainer.data.packed_batch`: :class:`PackedBatch`, the rows as tensors
  plus the index maps back to the sequences;
- :mod:`~treepack.trainer.data.routing`: :func:`routing_keys`, planner keys from MoE
  routing-replay arrays (so the planner never shares a token whose routing differs);
- :mod:`~treepack.trainer.data.bridge`: HF/TRL padded ``[B, T]`` batches <-> sequences,
  trainable flags and groups (:func:`from_padded`, :func:`from_labeled`);
- :mod:`~treepack.trainer.data.microbatch`: plan a whole generation batch once, deal its
  rows to ranks and micro-batches (:func:`plan_microbatches`).
"""

from treepack.trainer.data.bridge import PaddedSequences, from_labeled, from_padded
from treepack.trainer.data.materialize import materialize
from treepack.trainer.data.microbatch import MicroBatches, plan_microbatches
from treepack.trainer.data.packed_batch import PackedBatch
from treepack.trainer.data.routing import routing_keys

__all__ = ["materialize", "PackedBatch", "routing_keys", "PaddedSequences", "from_padded", "from_labeled", "MicroBatches", "plan_microbatches"]
