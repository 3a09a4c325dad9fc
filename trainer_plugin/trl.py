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
``check_model`` (with the dropout / patch refusals of :mod:`treepack.trainer.hf.guards`) and the
probe (:mod:`treepack.trainer.hf.probe`, once per setup; ``PackingConfig(verify=False)``
skips it).

Packed calls carry the batch as the ``treepack_context`` keyword, which alone selects the tree
attention (:mod:`treepack.trainer.hf.dispatch`); the model's own implementation is never
switched, so ``generate()`` between steps runs the stock model and activation checkpointing
replays the packed layers in backward.

:class:`TreepackSFTTrainer` does the same for ``trl.SFTTrainer``'s loss forward (one fused-head
call on ``[B, T]`` ids and labels, read by :func:`~treepack.trainer.planning.bridge.from_labeled`).

Vision-language models (TRL's multimodal path: a ``ProcessorMixin`` as ``processing_class``,
an ``image``/``images`` column), in both trainers: TRL hands the forward the batch's
``pixel_values``, ``image_grid_thw`` and ``mm_token_type_ids`` (GRPO also ``num_images``);
:func:`~treepack.trainer.planning.bridge.sequence_images` cuts them into each sequence's
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
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import trl
from trl.trainer import grpo_trainer as _grpo
from trl.trainer.utils import FusedCausalLMOutput

from treepack.proto.errors import RequestError
from treepack.trainer.data.materialize import materialize
from treepack.trainer.hf.admission import PackedSetup, admit
from treepack.trainer.hf.attention import TREE_MASK_OPTION
from treepack.trainer.hf.context import BATCH_KWARG, PackedContext, use_packed
from treepack.trainer.hf.vision import image_inputs
from treepack.trainer.hf.wrapped import unwrap_model
from treepack.trainer.kernels.attention import BACKENDS
from treepack.trainer.planning.bridge import PaddedSequences, from_labeled, from_padded, prompt_groups, sequence_images
from treepack.trainer.planning.images import image_keys
from treepack.trainer.planning.microbatch import plan_microbatches
from treepack.trainer.planning.planner import PlannerArg

__all__ = ["PackingConfig", "TreepackGRPOTrainer", "TreepackSFTTrainer", "choose_seq_len"]


@dataclass(frozen=True, slots=True, kw_only=True)
class PackingConfig:
    """How :class:`TreepackGRPOTrainer` packs.

    Attributes:
        seq_len: row length L; None picks one per batch (:func:`choose_seq_len`).
        min_shared_len: shortest shared run the planner keeps (GRPO prompts are the
            shared runs; the planner's default 64 hides short prompts, so 16 here).
        backend: tree attention backend, ``sdpa`` (dense mask, CPU and GPU) | ``flex`` |
            ``flash``.
        placement: the planner's placement (``auto`` ...).
        planner: as :func:`~treepack.trainer.planning.planner.obtain_plan`: a
            ``treepack.client.Packer`` (any :class:`~treepack.trainer.planning.planner.Planner`),
            a plan function, a sidecar URL, or None (embedded).
        max_seq_len: ``seq_len=None`` never picks more than this (unless one sequence is longer).
        keep_groups: shuffle whole prompt groups into the micro-batches, so each prompt's
            completions share it in one micro-batch (more sharing). Off by default: it
            changes which sequences make up each micro-batch, hence TRL's per-micro-batch
            loss normalisations, entropy quantile and logged metrics whenever gradient
            accumulation is above 1; False keeps TRL's own shuffle, step for step equal to stock.
        verify: prove packing exact for the model before its first packed step
            (:func:`~treepack.trainer.hf.forward.verify_model`, once per setup).
        allow_dropout: accept dropout outside attention while training (one mask per shared
            prefix: not exact). Default: refused.
        cost_model: a :class:`~treepack.proto.cost.CostModel` (``treepack.trainer.calibrate``)
            for the embedded planner: ``placement="auto"`` then packs each micro-batch as a
            tree or plainly, whichever is predicted faster (a sidecar ``planner`` uses its
            own ``cost_model_path``; giving both is refused).
    """

    seq_len: int | None = None
    min_shared_len: int = 16
    backend: str = "sdpa"
    placement: str = "auto"
    planner: PlannerArg = None
    max_seq_len: int = 8192
    keep_groups: bool = False
    verify: bool = True
    allow_dropout: bool = False
    cost_model: Any = None

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise RequestError(
                f"backend must be one of {BACKENDS}, got {self.backend!r}", path="$.packing.backend", rule="enum"
            )
        if self.cost_model is not None and self.planner is not None:
            raise RequestError(
                "give cost_model (embedded planner) or planner, not both: a sidecar uses its own cost_model_path, a Packer its own cost_model",
                path="$.packing.cost_model",
                rule="exclusive",
            )

    def make_planner(self) -> Any:
        """The planner to hand to ``plan_microbatches``: ``planner``, or an embedded
        ``Packer(cost_model=...)`` when a cost model is given."""
        if self.cost_model is None:
            return self.planner
        from treepack.client import Packer

        return Packer(cost_model=self.cost_model)


def choose_seq_len(padded: PaddedSequences, config: PackingConfig) -> int:
    """Row length for ``padded``: ``config.seq_len``, or room for the largest prompt tree.

    A tree (one prompt and its group's completions) needs at most prompt + all its
    completions tokens; L is that for the largest group (without groups, as from
    :func:`~treepack.trainer.planning.bridge.from_labeled`: all tokens of the batch), capped at
    ``max_seq_len`` but never below the longest sequence, rounded up to 128 (``flex``'s
    block) or 16.

    Returns:
        L >= 1.
    """
    if config.seq_len is not None:
        return int(config.seq_len)
    lens = padded.lengths
    if padded.flags is not None:
        # No groups known (SFT): any rows may share, so room for the whole batch.
        tree = np.array([lens.sum()])
    else:
        tree = np.bincount(padded.groups, weights=padded.completion_lens, minlength=1)
        first = np.unique(padded.groups, return_index=True)[1]
        tree[padded.groups[first]] += padded.prompt_lens[first]
    need = max(int(lens.max(initial=1)), min(int(tree.max(initial=1)), config.max_seq_len))
    step = 128 if config.backend == "flex" else 16
    return -(-need // step) * step


def _shuffle_keeping_groups(batch: dict[str, Any]) -> dict[str, Any]:
    """TRL's ``shuffle_sequence_dict`` with each prompt's rows kept together.

    Draws the same ``torch.randperm(B)`` as TRL, then orders the groups by where their
    first row landed, rows of a group in drawn order.
    """
    B = len(next(v for v in batch.values() if v is not None))
    perm = torch.randperm(B).numpy()
    pid, pmask = batch["prompt_ids"].cpu().numpy(), batch["prompt_mask"].cpu().numpy().astype(bool)
    groups = prompt_groups([pid[b][pmask[b]] for b in range(B)])
    g = groups[perm]
    first = np.full(groups.max(initial=0) + 1, B, dtype=np.int64)
    np.minimum.at(first, g, np.arange(B))
    order = torch.from_numpy(perm[np.lexsort((np.arange(B), first[g]))].copy())

    def permute(v: Any) -> Any:
        if v is None or (isinstance(v, torch.Tensor) and v.ndim == 0):
            return v
        return v[order] if isinstance(v, torch.Tensor) else [v[i] for i in order.tolist()]

    return {k: permute(v) for k, v in batch.items()}


class _PackedRows:
    """What both trainers share: the packed fused-head call and plan logging."""

    packing: PackingConfig

    def _init_packing(self, packing: PackingConfig | None) -> None:
        self.packing = PackingConfig() if packing is None else packing
        self._planner = self.packing.make_planner()

    def _plan(
        self,
        padded: PaddedSequences,
        num_microbatches: int,
        groups: list[int] | None,
        keys: list[np.ndarray] | None = None,
    ) -> Any:
        mb = plan_microbatches(
            padded.sequences,
            num_microbatches=num_microbatches,
            planner=self._planner,
            seq_len=choose_seq_len(padded, self.packing),
            trainable=padded.trainable,
            groups=groups,
            min_shared_len=self.packing.min_shared_len,
            placement=self.packing.placement,
            **({} if keys is None else {"keys": keys}),
        )
        metrics = self._metrics["train" if self.model.training else "eval"]
        metrics["treepack/saved_fraction"].append(float(mb.plan.stats.saved_fraction))
        metrics["treepack/rows"].append(float(mb.plan.stats.rows))
        metrics["treepack/plan_ms"].append(float(mb.plan_ms))
        return mb

    def _images(
        self,
        model: Any,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        sequences: list[np.ndarray],
        extra: dict[str, Any],
    ) -> tuple[Any, Any, Any]:
        """Each sequence's own image inputs and the planner keys that tell images apart.

        Args:
            model: the (wrapped) model (its ``image_token_id``).
            input_ids, attention_mask: TRL's padded ``[B, T]`` batch.
            sequences: the B sequences read from it.
            extra: TRL's image keywords (:func:`~treepack.trainer.planning.bridge.sequence_images`).

        Returns:
            (per sequence ``pixel_values``, per sequence grids, per sequence keys), or
            (None, None, None) for a batch without images.

        Raises:
            RequestError: images without ``image_grid_thw`` (LLaVA-style models), naming the
                model class; what :func:`~treepack.trainer.planning.bridge.sequence_images` refuses.
        """
        if extra.get("pixel_values") is not None and extra.get("image_grid_thw") is None:
            raise RequestError(
                f"{type(unwrap_model(model)).__name__}'s images come without image_grid_thw: tree rows take images as "
                "pixel_values with image_grid_thw (Qwen2-VL, Qwen2.5-VL, Qwen3-VL, Qwen3.5)",
                path="$.image_grid_thw",
                rule="unsupported",
            )
        image_token = _image_token_of(model) if extra.get("pixel_values") is not None else None
        pv, thw = sequence_images(input_ids, attention_mask, image_token_id=image_token, **extra)
        if pv is None:
            return None, None, None
        return pv, thw, image_keys(sequences, pixel_values=pv, image_grid_thw=thw, image_token_id=image_token)

    def _packed_fused(self, model: Any, batch: Any) -> Any:
        """TRL's fused-head output (``log_probs``, ``entropy``, ... as [K, L]) of ``batch``'s rows.

        Runs through ``model`` (its wrappers' hooks and gradient synchronisation stay) and
        TRL's fused LM head on pre-shifted labels (``batch.targets``, -100 off the loss mask).
        A batch with images gets the image features (the vision tower once per distinct
        image) and, for mRoPE models, each sequence's own 3-D positions
        (:func:`~treepack.trainer.hf.vision.image_inputs`).
        """
        backend = self.packing.backend
        hf = unwrap_model(model)
        setup = PackedSetup.of_call(
            batch, {}, backend=backend, verify=self.packing.verify, allow_dropout=self.packing.allow_dropout
        )
        # What packed_forward admits is admitted here too (the checks, the dispatch hooks and
        # patches, the probe under the step's autocast), before the first step computes anything.
        with self.accelerator.autocast():
            admit(hf, setup)
        mask = batch.dense_mask() if backend == "sdpa" else batch.block_mask() if backend == "flex" else None
        ctx = PackedContext(batch=batch, backend=backend, options={TREE_MASK_OPTION: mask})
        shift = batch.targets.masked_fill(~batch.loss_mask, -100)
        with self.accelerator.autocast():
            mm = image_inputs(hf, batch, {})
            with use_packed(ctx):
                return model(
                    input_ids=batch.input_ids,
                    position_ids=mm.pop("position_ids", batch.position_ids),
                    attention_mask=mask,
                    shift_labels=shift,
                    fused_lm_head=True,
                    **{BATCH_KWARG: ctx},
                    **mm,
                )


class TreepackGRPOTrainer(_PackedRows, trl.GRPOTrainer):
    """``trl.GRPOTrainer`` computing every per-token log-probability on tree-packed rows.

    Args:
        *args, **kwargs: exactly ``trl.GRPOTrainer``'s.
        packing: a :class:`PackingConfig` (default ``PackingConfig()``).
    """

    def __init__(self, *args: Any, packing: PackingConfig | None = None, **kwargs: Any) -> None:
        self._init_packing(packing)
        super().__init__(*args, **kwargs)

    def _prepare_inputs(self, generation_batch: dict[str, Any]) -> dict[str, Any]:
        """TRL's ``_prepare_inputs`` with :func:`_shuffle_keeping_groups` as the shuffle."""
        if not self.packing.keep_groups or not self.model.training:
            return super()._prepare_inputs(generation_batch)
        generate_every = self.args.steps_per_generation * self.num_iterations
        if self._step % generate_every == 0 or self._buffered_inputs is None:
            batch = self._generate_and_score_completions(generation_batch)
            batch = _shuffle_keeping_groups(_grpo.split_pixel_values_by_grid(batch))
            parts = _grpo.split_tensor_dict(batch, self.args.steps_per_generation)
            self._buffered_inputs = [_grpo.unsplit_pixel_values_by_grid(p) for p in parts]
        return self._buffered_inputs[self._step % self.args.steps_per_generation]

    def _get_per_token_logps_and_entropies(
        self,
        model: Any,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        logits_to_keep: int,
        batch_size: int | None = None,
        compute_entropy: bool = False,
        compute_aux_loss: bool = False,
        **extra: Any,
    ) -> tuple[torch.Tensor, torch.Tensor | None, None]:
        """TRL's per-token log-probabilities (and entropies) of the completions, on tree rows.

        Args:
            model: the (wrapped) policy or the reference model.
            input_ids: [B, P + C] prompt (left-padded) and completion (right-padded) ids.
            attention_mask: [B, P + C] 0/1.
            logits_to_keep: C, the completion block's width.
            batch_size: TRL's chunk size in sequences; the plan's rows run in
                ceil(B / batch_size) chunks.
            compute_entropy: also return the entropies.
            compute_aux_loss: refused (MoE load balancing is not per sequence).
            **extra: TRL's multimodal inputs: ``pixel_values``, ``image_grid_thw``,
                ``num_images`` and ``mm_token_type_ids`` (:func:`~treepack.trainer.planning.bridge.sequence_images`); any other
                is refused when given.

        Returns:
            ([B, C] log-probabilities, [B, C] entropies or None, None); 0 at padding.
        """
        if compute_aux_loss:
            raise RequestError(
                "TreepackGRPOTrainer packs dense-loss batches; got compute_aux_loss (MoE load balancing is not per sequence)",
                path="$.compute_aux_loss",
                rule="unsupported",
            )
        C = int(logits_to_keep)
        padded = from_padded(input_ids[:, :-C], attention_mask[:, :-C], input_ids[:, -C:], attention_mask[:, -C:])
        B = padded.batch_size
        pv, thw, keys = self._images(model, input_ids, attention_mask, padded.sequences, extra)
        groups = padded.groups
        if pv is not None:
            # A prompt is its ids and its images: identical ids over different images are two groups.
            groups = prompt_groups(
                [
                    np.concatenate([s[:p], k[:p].view(np.int64)])
                    for s, k, p in zip(padded.sequences, keys, padded.prompt_lens.tolist())
                ]
            )
        mb = self._plan(padded, max(1, math.ceil(B / (batch_size or B))), groups.tolist(), keys)
        logps = torch.zeros(B, C, device=input_ids.device)
        entropies = torch.zeros(B, C, device=input_ids.device) if compute_entropy else None
        for rows in mb.rows[0]:
            rows = rows[rows >= 0]
            if rows.shape[0] == 0:
                continue
            batch = materialize(
                mb.plan,
                padded.sequences,
                device=input_ids.device,
                trainable=padded.trainable,
                groups=groups.tolist(),
                rows=rows,
                pixel_values=pv,
                image_grid_thw=thw,
            )
            out = self._packed_fused(model, batch)
            logps = padded.to_padded(batch, out.log_probs, out=logps.to(out.log_probs.dtype))
            if compute_entropy:
                entropies = padded.to_padded(batch, out.entropy, out=entropies.to(out.entropy.dtype))
        return logps, entropies, None


def _image_token_of(model: Any) -> int:
    config = unwrap_model(model).config
    v = getattr(config, "image_token_id", None)
    if v is None:
        raise RequestError(
            f"the batch holds pixel_values but {type(unwrap_model(model)).__name__}'s config has no image_token_id",
            path="$.model",
            rule="unsupported",
        )
    return int(v)


class TreepackSFTTrainer(_PackedRows, trl.SFTTrainer):
    """``trl.SFTTrainer`` whose loss forward runs on tree-packed rows.

    Several completions of one prompt (distillation, rejection sampling) hold the prompt
    once per row; with images (TRL's vision collator, Qwen-VL families) a prompt's image
    tokens are shared only between samples holding the same image, and the vision tower
    runs once per distinct image, as in :class:`TreepackGRPOTrainer`. The batch must be padded (``padding_free=False``, ``packing=False``: TRL's
    own packing concatenates sequences without a tree); TRL's loss (``nll``, ``dft``),
    entropy and token-accuracy metrics run on the fused-head outputs scattered back to
    TRL's ``[B, T - 1]`` layout. ``compute_loss_func`` and label smoothing need full logits
    and are refused.

    Args:
        *args, **kwargs: exactly ``trl.SFTTrainer``'s.
        packing: a :class:`PackingConfig` (default ``PackingConfig()``).
    """

    def __init__(self, *args: Any, packing: PackingConfig | None = None, **kwargs: Any) -> None:
        self._init_packing(packing)
        super().__init__(*args, **kwargs)
        if self.padding_free:
            raise RequestError(
                "TreepackSFTTrainer packs padded batches: set padding_free=False and packing=False",
                path="$.args.padding_free",
                rule="unsupported",
            )
        if self.compute_loss_func is not None or self.label_smoother is not None:
            raise RequestError(
                "compute_loss_func and label smoothing need the full logits; TreepackSFTTrainer runs the fused head",
                path="$.args",
                rule="unsupported",
            )

    def compute_loss(
        self, model: Any, inputs: dict[str, Any], return_outputs: bool = False, num_items_in_batch: Any = None
    ) -> Any:
        """TRL's SFT loss, with the model call replaced by the packed one (:meth:`_sft_forward`)."""
        call = lambda **kw: self._sft_forward(model, **kw)  # noqa: E731
        return super().compute_loss(call, inputs, return_outputs=return_outputs, num_items_in_batch=num_items_in_batch)

    def _sft_forward(
        self,
        model: Any,
        *,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        labels: torch.Tensor,
        fused_lm_head: bool = False,
        use_cache: Any = None,
        pixel_values: torch.Tensor | None = None,
        image_grid_thw: torch.Tensor | None = None,
        mm_token_type_ids: torch.Tensor | None = None,
        **rest: Any,
    ) -> Any:
        """TRL's fused-head output for ``[B, T]`` inputs, computed on tree rows.

        Args:
            input_ids, attention_mask, labels: TRL's ``[B, T]`` batch.
            fused_lm_head: must be True (TRL's SFT loss path).
            use_cache: ignored (TRL passes False).
            pixel_values, image_grid_thw, mm_token_type_ids: what TRL's vision collator gives
                for processors with ``image_grid_thw`` (Qwen-VL families): the batch's images,
                cut into each sequence's own (:func:`~treepack.trainer.planning.bridge.sequence_images`)
                and planned with :func:`~treepack.trainer.planning.images.image_keys`.
            **rest: any other keyword is refused by name.

        Returns:
            A ``FusedCausalLMOutput`` with ``log_probs``, ``entropy``, ``is_top1`` and
            ``label_mask`` as [B, T - 1] (TRL's shifted layout), 0 off the labels.
        """
        given = sorted(k for k, v in rest.items() if v is not None)
        if not fused_lm_head or given:
            what = given[0] if given else "fused_lm_head"
            raise RequestError(
                f"TreepackSFTTrainer packs fused-head calls of text, or of images as pixel_values with image_grid_thw (Qwen-VL families); got {what}",
                path=f"$.{what}",
                rule="unsupported",
            )
        padded = from_labeled(input_ids, attention_mask, labels)
        extra = dict(pixel_values=pixel_values, image_grid_thw=image_grid_thw, mm_token_type_ids=mm_token_type_ids)
        pv, thw, keys = self._images(model, input_ids, attention_mask, padded.sequences, extra)
        mb = self._plan(padded, 1, None, keys)
        rows = mb.rows[0, 0]
        batch = materialize(
            mb.plan,
            padded.sequences,
            device=input_ids.device,
            trainable=padded.trainable,
            rows=rows[rows >= 0],
            pixel_values=pv,
            image_grid_thw=thw,
        )
        out = self._packed_fused(model, batch)
        fields = {}
        for name in ("log_probs", "entropy", "is_top1"):
            v = getattr(out, name)
            fields[name] = None if v is None else padded.to_padded(batch, v)
        return FusedCausalLMOutput(loss=None, label_mask=labels[:, 1:] != -100, **fields)
