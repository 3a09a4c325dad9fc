"""Tree rows through Megatron-Core's ``GPTModel`` with tensor parallelism (docs/megatron.md).

::

    from treepack.trainer.megatron import from_hf, packed_forward, vocab_parallel_target_logprobs
    model = from_hf(hf_model_or_dir, tp=2)      # GPTModel via Megatron-Bridge, this TP rank's shard
    logits = packed_forward(model, batch)       # [K, L, padded_vocab // tp], this rank's vocabulary slice
    lp = vocab_parallel_target_logprobs(logits, batch, vocab_size=model.config.vocab_size,
                                        group=parallel_state.get_tensor_model_parallel_group())
    loss = treepack.trainer.losses.ppo_clip_loss(lp, batch, advantages=...)

Rooms: :mod:`~treepack.trainer.megatron.bridge` (``from_hf``), :mod:`~treepack.trainer.megatron.spec`
(the tree layer spec and the admission), :mod:`~treepack.trainer.megatron.attention` (the tree
core attention), :mod:`~treepack.trainer.megatron.rope` (RoPE at the plan's positions),
:mod:`~treepack.trainer.megatron.context`, :mod:`~treepack.trainer.megatron.forward`
(``packed_forward``), :mod:`~treepack.trainer.megatron.vocab_parallel` (losses' inputs on
vocab-parallel logits, torch only).

Megatron-Core and Megatron-Bridge are imported only when a function needs them; without them
``from_hf`` raises an ``ImportError`` naming what to install.
"""

from treepack.trainer.megatron.bridge import INSTALL_HINT, from_hf
from treepack.trainer.megatron.forward import packed_forward, tree_attention_mask
from treepack.trainer.megatron.spec import check_megatron_model, megatron_refusals
from treepack.trainer.megatron.vocab_parallel import (
    naive_vocab_parallel_target_logprobs,
    vocab_parallel_stats,
    vocab_parallel_target_logprobs,
)

__all__ = [
    "from_hf",
    "packed_forward",
    "tree_attention_mask",
    "check_megatron_model",
    "megatron_refusals",
    "vocab_parallel_target_logprobs",
    "naive_vocab_parallel_target_logprobs",
    "vocab_parallel_stats",
    "INSTALL_HINT",
]
