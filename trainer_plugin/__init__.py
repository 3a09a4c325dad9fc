"""treepack's trainer plugin: packed tensors, tree attention, losses (torch only).

- :func:`materialize` -> :class:`PackedBatch` (``input_ids``, ``position_ids``,
  ``subtree_end``, ``targets``, ``loss_mask``, payloads, masks, varlen metadata).
- :func:`tree_attention` (``sdpa`` | ``flex`` | ``flash``).
- Losses: :mod:`treepack.trainer.losses`.
- HF transformers: :mod:`treepack.trainer.hf` (``packed_forward``).
- Ranks: :mod:`treepack.trainer.distributed`.
- Layers that need the batch: :mod:`treepack.trainer.context`.

GPU packages (flash-attn, flash-linear-attention, triton) are imported only inside the
functions that use them; transformers only by :mod:`treepack.trainer.hf`.
"""

from treepack.trainer.attention import BACKENDS, naive_varlen_attention, tree_attention
from treepack.trainer.batch import PackedBatch
from treepack.trainer.context import PackedContext, current_packed, resolve_packed, use_packed
from treepack.trainer.materialize import materialize

__all__ = [
    "materialize",
    "PackedBatch",
    "tree_attention",
    "naive_varlen_attention",
    "BACKENDS",
    "PackedContext",
    "use_packed",
    "current_packed",
    "resolve_packed",
]
