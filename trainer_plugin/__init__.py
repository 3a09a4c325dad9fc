"""treepack's trainer plugin: packed tensors, tree attention, losses (torch only).

Layers, each importing only the ones above it in this list:

- :mod:`treepack.trainer.kernels`: tree masks, :func:`tree_attention` (``sdpa`` |
  ``flex`` | ``flash``), Gated DeltaNet and sparse top-k attention, each with its reference;
- :mod:`treepack.trainer.planning` (before the plan): padded batches -> sequences, routing
  keys, the planning call (:func:`~treepack.trainer.planning.obtain_plan`), micro-batches;
- :mod:`treepack.trainer.data` (after the plan): :func:`materialize` -> :class:`PackedBatch`
  (``input_ids``, ``position_ids``, ``subtree_end``, ``targets``, ``loss_mask``, payloads,
  masks, varlen metadata, the tree schedule);
- :mod:`treepack.trainer.hf`: HF transformers (:func:`packed_forward`, the registered
  attention implementation, the layer registry :mod:`treepack.trainer.hf.layers`; layers
  find the batch through :mod:`treepack.trainer.hf.context`; :func:`parity_report`: packed
  drift against each sequence alone and the model's own noise floor, a table to paste);
- :mod:`treepack.trainer.losses`: SFT, GRPO/PPO-clip and CISPO losses on packed rows;
- :mod:`treepack.trainer.distributed`: rank 0 plans (through :mod:`treepack.client`), every
  rank materializes its rows;
- :mod:`treepack.trainer.cost`: :func:`calibrate` measures a model's step-time cost model
  (:class:`~treepack.proto.cost.CostModel`) on this device;
- :mod:`treepack.trainer.trl` (extra ``trl``, imported only on request):
  ``TreepackGRPOTrainer`` / ``TreepackSFTTrainer``, TRL's trainers on tree rows.

GPU packages (flash-attn, flash-linear-attention, triton) are imported only inside the
functions that use them; transformers only when a model is first prepared for packed calls.
"""

try:
    import torch  # noqa: F401  (every module below needs it)
except ImportError as exc:
    raise ImportError(
        "treepack.trainer needs the 'trainer' extra (torch, transformers), and torch is missing: "
        "in the clone, pip install '.[trainer]' (install torch first to choose its build, e.g. "
        "pip install torch --index-url https://download.pytorch.org/whl/cpu)"
    ) from exc

from treepack.trainer.cost import calibrate, time_step  # noqa: E402  (after the check above)
from treepack.trainer.data.advice import TreepackWarning
from treepack.trainer.data.materialize import materialize
from treepack.trainer.data.packed_batch import PackedBatch
from treepack.trainer.hf.admission import check_model
from treepack.trainer.hf.context import PackedContext, current_packed, resolve_packed, use_packed
from treepack.trainer.hf.forward import packed, packed_forward
from treepack.trainer.hf.head import output_head
from treepack.trainer.hf.parity import ParityReport, parity_report
from treepack.trainer.kernels.attention import BACKENDS, naive_varlen_attention, tree_attention
from treepack.trainer.kernels.cp import ContextParallel
from treepack.trainer.planning.images import image_keys

__all__ = [
    "materialize",
    "image_keys",
    "ContextParallel",
    "PackedBatch",
    "tree_attention",
    "naive_varlen_attention",
    "BACKENDS",
    "packed_forward",
    "packed",
    "output_head",
    "parity_report",
    "ParityReport",
    "TreepackWarning",
    "check_model",
    "PackedContext",
    "use_packed",
    "current_packed",
    "resolve_packed",
    "calibrate",
    "time_step",
]
