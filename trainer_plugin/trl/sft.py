"""``TreepackSFTTrainer``: ``trl.SFTTrainer`` whose loss forward runs on tree-packed rows.

Its loss forward (one fused-head call on ``[B, T]`` ids and labels) is read by
:func:`~treepack.trainer.planning.bridge.from_labeled`, planned, run on the packed rows and
scattered back to TRL's shifted ``[B, T - 1]`` layout; see :mod:`treepack.trainer.trl`.
"""

from __future__ import annotations

from typing import Any

import torch
import trl
from trl.trainer.utils import FusedCausalLMOutput

from treepack.proto.errors import RequestError
from treepack.trainer.data.materialize import materialize
from treepack.trainer.planning.bridge import from_labeled
from treepack.trainer.trl.config import PackingConfig
from treepack.trainer.trl.step import PackedRows

__all__ = ["TreepackSFTTrainer"]


class TreepackSFTTrainer(PackedRows, trl.SFTTrainer):
    """``trl.SFTTrainer`` whose loss forward runs on tree-packed rows.

    Several completions of one prompt (distillation, rejection sampling) hold the prompt
    once per row; with images (TRL's vision collator, Qwen-VL families) a prompt's image
    tokens are shared only between samples holding the same image, and the vision tower
    runs once per distinct image, as in :class:`~treepack.trainer.trl.grpo.TreepackGRPOTrainer`.
    The batch must be padded (``padding_free=False``, ``packing=False``: TRL's own packing
    concatenates sequences without a tree); TRL's loss (``nll``, ``dft``), entropy and
    token-accuracy metrics run on the fused-head outputs scattered back to TRL's
    ``[B, T - 1]`` layout. ``compute_loss_func`` and label smoothing need full logits
    and are refused.

    Args:
        *args, **kwargs: exactly ``trl.SFTTrainer``'s.
        packing: a :class:`~treepack.trainer.trl.config.PackingConfig` (default ``PackingConfig()``).
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
                cut into each sequence's own (:func:`~treepack.trainer.planning.padded_images.sequence_images`)
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
                "TreepackSFTTrainer packs fused-head calls of text, or of images as pixel_values with "
                f"image_grid_thw (Qwen-VL families); got {what}",
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
