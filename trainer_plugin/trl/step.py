"""What both TRL trainers share: plan a padded batch, cut its images, run the packed fused-head call.

:class:`PackedRows` is the mixin :class:`~treepack.trainer.trl.grpo.TreepackGRPOTrainer` and
:class:`~treepack.trainer.trl.sft.TreepackSFTTrainer` put before TRL's trainer: the plan of
a padded batch (logged into TRL's metrics, with planner keys that tell a PEFT aLoRA
adapter's activation apart), each sequence's image inputs with the planner keys that tell
images apart, and the call of the model on the packed rows through TRL's
fused LM head (after the model's admission). On the main process (``PackingConfig(verbose=True)``,
the default) it says when the first packed step verifies packing on the model and how long
that took, and after ``train()`` what packing saved over the run
(:class:`~treepack.trainer.planning.tally.PackingTally`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from treepack.proto.errors import RequestError
from treepack.trainer.hf.admission import PackedSetup, admit
from treepack.trainer.hf.alora import alora_inputs, alora_invocation, alora_keys
from treepack.trainer.hf.attention import TREE_MASK_OPTION
from treepack.trainer.hf.context import BATCH_KWARG, PackedContext, use_packed
from treepack.trainer.hf.parity import parity_report, sample_on_every_rank
from treepack.trainer.hf.vision import image_inputs
from treepack.trainer.hf.wrapped import unwrap_model
from treepack.trainer.kernels.attention import resolve_backend
from treepack.trainer.planning.bridge import PaddedSequences
from treepack.trainer.planning.images import image_keys
from treepack.trainer.planning.microbatch import plan_microbatches
from treepack.trainer.planning.padded_images import sequence_images
from treepack.trainer.planning.tally import PackingTally
from treepack.trainer.trl.config import PackingConfig, choose_seq_len, record_tag

__all__ = ["PackedRows", "image_token_of"]


class PackedRows:
    """What both trainers share: the packed fused-head call and plan logging; every planned
    sequence carries the run's tag (:func:`~treepack.trainer.trl.config.record_tag`), which
    the planner's shape history records."""

    packing: PackingConfig
    if TYPE_CHECKING:  # set by the TRL trainer this mixin goes before (transformers.Trainer)
        model: Any
        accelerator: Any
        _metrics: dict[str, Any]

    def _init_packing(self, packing: PackingConfig | None) -> None:
        self.packing = PackingConfig() if packing is None else packing
        self._planner = self.packing.make_planner()
        self.packing_tally = PackingTally(say=self._say)

    def _say(self, line: str) -> None:
        """Print ``line`` on the main process when the config is verbose."""
        if self.packing.verbose and self.accelerator.is_main_process:
            print(line, flush=True)

    def train(self, *args: Any, **kwargs: Any) -> Any:
        """TRL's ``train``, then one line of what packing saved over it (:meth:`PackingTally.summary`)."""
        out = super().train(*args, **kwargs)  # type: ignore[misc]  # the TRL trainer after this mixin
        self.packing_tally.report()
        return out

    def _plan(
        self,
        padded: PaddedSequences,
        num_microbatches: int,
        groups: list[int] | None,
        keys: list[np.ndarray] | None = None,
    ) -> Any:
        tag = record_tag(self.packing, getattr(self, "args", None))
        invocation = alora_invocation(self.model)
        if invocation is not None:  # never share a position on which aLoRA's activation differs
            on = alora_keys(padded.sequences, invocation)
            keys = on if keys is None else [k * np.uint64(2) + a for k, a in zip(keys, on)]
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
            **({} if tag is None else {"tags": [tag] * len(padded.sequences)}),
        )
        metrics = self._metrics["train" if self.model.training else "eval"]
        metrics["treepack/saved_fraction"].append(float(mb.plan.stats.saved_fraction))
        metrics["treepack/rows"].append(float(mb.plan.stats.rows))
        metrics["treepack/plan_ms"].append(float(mb.plan_ms))
        self.packing_tally.add(mb.plan.stats, mb.plan_ms)
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
            extra: TRL's image keywords (:func:`~treepack.trainer.planning.padded_images.sequence_images`).

        Returns:
            (per sequence ``pixel_values``, per sequence grids, per sequence keys), or
            (None, None, None) for a batch without images.

        Raises:
            RequestError: images without ``image_grid_thw`` (LLaVA-style models), naming the
                model class; what :func:`~treepack.trainer.planning.padded_images.sequence_images` refuses.
        """
        if extra.get("pixel_values") is not None and extra.get("image_grid_thw") is None:
            raise RequestError(
                f"{type(unwrap_model(model)).__name__}'s images come without image_grid_thw: tree rows take images as "
                "pixel_values with image_grid_thw (Qwen2-VL, Qwen2.5-VL, Qwen3-VL, Qwen3.5)",
                path="$.image_grid_thw",
                rule="unsupported",
            )
        image_token = image_token_of(model) if extra.get("pixel_values") is not None else None
        pv, thw = sequence_images(input_ids, attention_mask, image_token_id=image_token, **extra)
        if pv is None:
            return None, None, None
        assert image_token is not None, "sequence_images finds images only in a batch with pixel_values"
        return pv, thw, image_keys(sequences, pixel_values=pv, image_grid_thw=thw, image_token_id=image_token)

    def _packed_fused(self, model: Any, batch: Any) -> Any:
        """TRL's fused-head output (``log_probs``, ``entropy``, ... as [K, L]) of ``batch``'s rows.

        Runs through ``model`` (its wrappers' hooks and gradient synchronisation stay) and
        TRL's fused LM head on pre-shifted labels (``batch.targets``, -100 off the loss mask).
        A batch with images gets the image features (the vision tower once per distinct
        image) and, for mRoPE models, each sequence's own 3-D positions
        (:func:`~treepack.trainer.hf.vision.image_inputs`).
        """
        backend = resolve_backend(self.packing.backend, batch.device, batch.seq_len)
        hf = unwrap_model(model)
        accepted = {"allow_dropout": self.packing.allow_dropout, "allow_stochastic": self.packing.allow_stochastic}
        setup = PackedSetup.of_call(batch, {}, backend=backend, verify=self.packing.verify, **accepted)
        # What packed_forward admits is admitted here too (the checks, the dispatch hooks and
        # patches, the probe through the model's wrappers under the step's autocast), before
        # the first step computes anything.
        with self.accelerator.autocast(), self.packing_tally.first_step(hf, backend, verify=self.packing.verify):
            admit(model, setup)  # as held: PEFT's adapters are judged on its wrapper
            if self.packing.report_parity and not getattr(self, "_parity_logged", False):
                self._parity_logged = True
                report = parity_report(model, batch, backend=backend, sequences=sample_on_every_rank(batch))
                if self.accelerator.is_main_process:
                    print(report.table(), flush=True)
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
                    **alora_inputs(model, batch),
                )


def image_token_of(model: Any) -> int:
    """The (wrapped) model's image placeholder id (``config.image_token_id``); refused when it has none."""
    config = unwrap_model(model).config
    v = getattr(config, "image_token_id", None)
    if v is None:
        raise RequestError(
            f"the batch holds pixel_values but {type(unwrap_model(model)).__name__}'s config has no image_token_id",
            path="$.model",
            rule="unsupported",
        )
    return int(v)
