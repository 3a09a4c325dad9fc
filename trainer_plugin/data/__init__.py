"""After the plan: a plan plus the trainer's per-sequence arrays -> :class:`PackedBatch`.

- :mod:`~treepack.trainer.data.materialize`: :func:`materialize` (one vectorized gather
  per array), composed of:
- :mod:`~treepack.trainer.data.rows`: the segment table -> token maps, scored entries and
  row tensors;
- :mod:`~treepack.trainer.data.payloads`: target- and token-aligned payloads
  (:class:`~treepack.trainer.data.payloads.PayloadMismatchError`);
- :mod:`~treepack.trainer.data.cp_shard`: one context-parallel rank's shard of the rows;
- :mod:`~treepack.trainer.data.packed_batch`: :class:`PackedBatch`, the rows as tensors
  plus the index maps back to the sequences (and the per-batch masks and tree schedule);
- :mod:`~treepack.trainer.data.logprobs`: the targets' log-probabilities from logits or
  from hidden states in chunks;
- :mod:`~treepack.trainer.data.images`: a batch's images, one per distinct content;
- :mod:`~treepack.trainer.data.sequences`: the per-sequence inputs, checked against the plan;
- :mod:`~treepack.trainer.data.advice`: warnings about a plan that shares less than it could.

What runs before the plan (padded batches -> sequences, routing keys, the planning call,
micro-batches) is :mod:`treepack.trainer.planning`.
"""

from treepack.trainer.data.materialize import materialize
from treepack.trainer.data.packed_batch import PackedBatch

__all__ = ["materialize", "PackedBatch"]
