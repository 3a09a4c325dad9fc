"""Packed data: a plan plus the trainer's per-sequence arrays -> :class:`PackedBatch`.

- :mod:`~treepack.trainer.data.materialize`: :func:`materialize` (one vectorized gather
  per array);
- :mod:`~treepack.trainer.data.packed_batch`: :class:`PackedBatch`, the rows as tensors
  plus the index maps back to the sequences;
- :mod:`~treepack.trainer.data.routing`: :func:`routing_keys`, planner keys from MoE
  routing-replay arrays (so the planner never shares a token whose routing differs).
"""

from treepack.trainer.data.materialize import materialize
from treepack.trainer.data.packed_batch import PackedBatch
from treepack.trainer.data.routing import routing_keys

__all__ = ["materialize", "PackedBatch", "routing_keys"]
