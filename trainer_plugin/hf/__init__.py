"""HF transformers on tree-packed rows (:func:`packed_forward`).

- :mod:`~treepack.trainer.hf.forward`: :func:`packed_forward` and the :func:`packed` context
  manager (the model is left as it was; :mod:`~treepack.trainer.hf.dispatch` picks tree
  attention per call; :mod:`~treepack.trainer.hf.wrapped` resolves DDP / FSDP2 / PEFT wrappers);
- :mod:`~treepack.trainer.hf.attention`: the registered ``"treepack"`` attention
  implementation;
- :mod:`~treepack.trainer.hf.context`: how a layer finds the packed batch it runs on;
- :mod:`~treepack.trainer.hf.layers`: the layer registry, one module per layer kind (Gated
  DeltaNet, KDA, Mamba2, Mamba, short conv, DeepSeek-V3.2 sparse attention, ...): how each
  is recognised, runs on tree rows and refuses;
- :mod:`~treepack.trainer.hf.vision`: vision-language models: the vision tower once per
  distinct image, features and multimodal positions placed in the rows;
- :mod:`~treepack.trainer.hf.admission`: the model's admission, :func:`check_model` (the
  fail-closed check that every token mixer of a model runs tree-exact), the guards, the walk
  cache and the run-time probe, behind one entry ``admit(model, setup) -> Verdict`` (run by
  :func:`packed_forward` first);
- :mod:`~treepack.trainer.hf.run`: the packed run of an admitted model (metadata, context, call);
- :mod:`~treepack.trainer.hf.layer_masks`: the per-layer-type mask mapping handed to models
  that take one;
- :mod:`~treepack.trainer.hf.head`: :func:`output_head`, the model's head with its final logit
  transforms, for the chunked head;
- :mod:`~treepack.trainer.hf.task_head`: what each head class gives on tree rows (a causal LM's
  logits, a token head's per-position values, a sequence head's per-sequence scores) and the
  refusal of any other head.

transformers itself is imported only when a model is first prepared (``register_tree_attention``).
"""

from treepack.trainer.hf.admission import SupportReport, check_model, enable_tree_attention
from treepack.trainer.hf.attention import ATTN_IMPLEMENTATION, register_tree_attention, treepack_attention
from treepack.trainer.hf.forward import packed, packed_forward
from treepack.trainer.hf.head import OutputHead, output_head
from treepack.trainer.hf.vision import VisionSavings, vision_savings
from treepack.trainer.hf.wrapped import unwrap_model

__all__ = [
    "ATTN_IMPLEMENTATION",
    "register_tree_attention",
    "treepack_attention",
    "enable_tree_attention",
    "packed_forward",
    "packed",
    "output_head",
    "OutputHead",
    "unwrap_model",
    "check_model",
    "SupportReport",
    "vision_savings",
    "VisionSavings",
]
