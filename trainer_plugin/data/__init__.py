"""Packed data: a plan plus the trainer's per-sequence arrays -> :class:`PackedBatch`.

- :mod:`~treepack.trainer.data.materialize`: :func:`materialize` (one vectorized gather
  per array);
- :mod:`~treepack.trainer.data.packed_batch`: :class:`PackedBatch`, the rows as tensors
  plus the index maps back to the sequences.
"""

from treepack.trainer.data.materialize import materialize
from treepack.trainer.data.packed_batch import PackedBatch

__all__ = ["materialize", "PackedBatch"]
