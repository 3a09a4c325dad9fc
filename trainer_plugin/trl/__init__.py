"""TRL on tree-packed rows: :class:`TreepackGRPOTrainer`, the one-line change from ``GRPOTrainer``.

::

    from treepack.trainer.trl import PackingConfig, TreepackGRPOTrainer
    trainer = TreepackGRPOTrainer(model=..., reward_funcs=..., args=GRPOConfig(...),
                                  train_dataset=..., packing=PackingConfig(min_shared_len=16))

What changes against ``trl.GRPOTrainer`` (1.16) is mainly one method, the one TRL computes
every per-token log-probability with (``_get_per_token_logps_and_entropies``: the policy in
the loss, the old policy and the reference in scoring), plus ``_prepare_inputs`` (the
shuffle below). It reads TRL's padded
``[B, P + C]`` batch as sequences (:mod:`treepack.trainer.planning.bridge`), plans them once
per call (a prompt's completions share its tokens in one tree), splits the plan's rows
into as many chunks as TRL's own ``batch_size`` chunking would make
(:mod:`treepack.trainer.planning.microbatch`), runs the model on the rows through TRL's own
fused LM head (``fused_lm_head=True`` with pre-shifted ``shift_labels``: the same
temperature, entropy, soft-capping, fp32 head and chunking as stock), and scatters the
results back to TRL's ``[B, C]``. TRL's loss code (every ``loss_type``), generation,
rewards and advantages run untouched, so every step equals stock TRL's. With
``PackingConfig(keep_groups=True)`` the micro-batch split after generation shuffles whole
prompt groups instead (the same ``torch.randperm`` draw as stock, so the random stream is
unchanged), so that each prompt's completions share it in one micro-batch; with gradient
accumulation above 1 that changes which completions each micro-batch holds, hence TRL's
per-micro-batch normalisations and metrics: a different (equally valid) run, not stock's.

Before the first packed step of a model the trainers run what ``packed_forward`` runs:
``check_model`` (with the dropout / patch refusals of :mod:`treepack.trainer.hf.admission.guards`) and the
probe (:mod:`treepack.trainer.hf.admission.probe`, once per setup; ``PackingConfig(verify=False)``
skips it).

Packed calls carry the batch as the ``treepack_context`` keyword, which alone selects the tree
attention (:mod:`treepack.trainer.hf.dispatch`); the model's own implementation is never
switched, so ``generate()`` between steps runs the stock model and activation checkpointing
replays the packed layers in backward.

:class:`TreepackSFTTrainer` does the same for ``trl.SFTTrainer``'s loss forward (one fused-head
call on ``[B, T]`` ids and labels, read by :func:`~treepack.trainer.planning.bridge.from_labeled`).

:class:`TreepackRewardTrainer` does it for ``trl.RewardTrainer``'s one call on ``[2B, T]``
preference pairs: a chosen and a rejected sequence share their prompt in one tree, and the
reward model (a ``*ForSequenceClassification``) scores each sequence at its own last non-pad
token (:mod:`treepack.trainer.hf.task_head`), so TRL's pairwise loss runs on scores equal to
stock's. TRL 1.16 has no PPO trainer (no value model anywhere in it): a PPO critic on tree
rows runs through ``packed_forward`` directly, or verl (:mod:`treepack.trainer.verl`).

Vision-language models (TRL's multimodal path: a ``ProcessorMixin`` as ``processing_class``,
an ``image``/``images`` column), in both trainers: TRL hands the forward the batch's
``pixel_values``, ``image_grid_thw`` and ``mm_token_type_ids`` (GRPO also ``num_images``);
:func:`~treepack.trainer.planning.padded_images.sequence_images` cuts them into each sequence's
own image inputs, the plan is made with :func:`~treepack.trainer.planning.images.image_keys`
(an image's tokens are shared only with sequences holding the same image, even where
two samples have identical token ids) and the rows run as ``packed_forward`` runs them
(:mod:`treepack.trainer.hf.vision`: the vision tower once per distinct image, each
sequence's own 3-D positions). Supported: models whose processor gives ``image_grid_thw``
(Qwen2-VL, Qwen2.5-VL, Qwen3-VL, Qwen3.5) with images in the prompts (SFT: anywhere in a sample); other image
arguments (LLaVA-style, tiled, ``token_type_ids``), video and the MoE auxiliary loss are
refused by name.

Logged into TRL's metrics: ``treepack/saved_fraction``, ``treepack/rows``,
``treepack/plan_ms`` (one entry per plan, averaged by TRL per logging step).

The package's rooms: :mod:`~treepack.trainer.trl.config` (:class:`PackingConfig`,
:func:`choose_seq_len`), :mod:`~treepack.trainer.trl.step` (what both trainers share: the
plan, the images, the packed fused-head call), :mod:`~treepack.trainer.trl.grpo` and
:mod:`~treepack.trainer.trl.sft`, :mod:`~treepack.trainer.trl.reward` (the trainers).
"""

try:
    import trl  # noqa: F401  (the trainers subclass TRL's)
except ImportError as exc:
    raise ImportError(
        "treepack.trainer.trl needs the 'trl' extra (trl is missing): in the clone, pip install '.[trainer,trl]'"
    ) from exc

from treepack.trainer.trl.config import PackingConfig, choose_seq_len  # noqa: E402  (after the check above)
from treepack.trainer.trl.grpo import TreepackGRPOTrainer
from treepack.trainer.trl.reward import TreepackRewardTrainer
from treepack.trainer.trl.sft import TreepackSFTTrainer

__all__ = ["PackingConfig", "TreepackGRPOTrainer", "TreepackSFTTrainer", "TreepackRewardTrainer", "choose_seq_len"]
