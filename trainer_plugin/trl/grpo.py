"""``TreepackGRPOTrainer``: ``trl.GRPOTrainer`` computing every per-token log-probability on tree rows.

It overrides ``_get_per_token_logps_and_entropies`` (the policy in the loss, the old policy
and the reference in scoring: TRL's padded batch read as sequences, planned once per call,
its rows run in as many chunks as TRL's ``batch_size`` would make, the results scattered
back to ``[B, C]``) and ``_prepare_inputs`` (with ``PackingConfig(keep_groups=True)``, the
shuffle :func:`_shuffle_keeping_groups` that keeps each prompt's rows together); see
:mod:`treepack.trainer.trl`.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import trl
from trl.trainer import grpo_trainer as _grpo

from treepack.proto.errors import RequestError
from treepack.trainer.data.materialize import materialize
from treepack.trainer.planning.bridge import from_padded, prompt_groups
from treepack.trainer.trl.config import PackingConfig
from treepack.trainer.trl.step import PackedRows

__all__ = ["TreepackGRPOTrainer"]


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


class TreepackGRPOTrainer(PackedRows, trl.GRPOTrainer):
    """``trl.GRPOTrainer`` computing every per-token log-probability on tree-packed rows.

    Args:
        *args, **kwargs: exactly ``trl.GRPOTrainer``'s.
        packing: a :class:`~treepack.trainer.trl.config.PackingConfig` (default ``PackingConfig()``).
    """

    if TYPE_CHECKING:  # what GRPOTrainer sets, as it sets them (transformers and TRL leave them loose)
        args: trl.GRPOConfig
        # TRL's __init__ assigns None unannotated, so its stub says the attribute is None forever.
        _buffered_inputs: list[dict[str, Any]] | None  # type: ignore[assignment]

    def __init__(self, *args: Any, packing: PackingConfig | None = None, **kwargs: Any) -> None:
        self._init_packing(packing)
        super().__init__(*args, **kwargs)

    def _prepare_inputs(self, generation_batch: dict[str, Any]) -> dict[str, Any]:
        """TRL's ``_prepare_inputs`` with :func:`_shuffle_keeping_groups` as the shuffle."""
        if not self.packing.keep_groups or not self.model.training:
            return super()._prepare_inputs(generation_batch)
        steps = self.args.steps_per_generation
        assert steps is not None, "GRPOConfig's __post_init__ resolves steps_per_generation"
        generate_every = steps * self.num_iterations
        if self._step % generate_every == 0 or self._buffered_inputs is None:
            # TRL annotates this batch a dict and its generator's input a list of examples; the
            # dataloader hands the list, which TRL's own _prepare_inputs passes on as we do.
            batch = self._generate_and_score_completions(generation_batch)  # type: ignore[arg-type]
            batch = _shuffle_keeping_groups(_grpo.split_pixel_values_by_grid(batch))
            parts = _grpo.split_tensor_dict(batch, steps)
            # TRL's split_tensor_dict is typed to yield None values its unsplit_... does not take.
            self._buffered_inputs = [_grpo.unsplit_pixel_values_by_grid(p) for p in parts]  # type: ignore[arg-type]
        return self._buffered_inputs[self._step % steps]

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
                ``num_images`` and ``mm_token_type_ids``
                (:func:`~treepack.trainer.planning.padded_images.sequence_images`); any other
                is refused when given.

        Returns:
            ([B, C] log-probabilities, [B, C] entropies or None, None); 0 at padding.
        """
        if compute_aux_loss:
            raise RequestError(
                "TreepackGRPOTrainer packs dense-loss batches; got compute_aux_loss "
                "(MoE load balancing is not per sequence)",
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
            if entropies is not None:  # compute_entropy
                entropies = padded.to_padded(batch, out.entropy, out=entropies.to(out.entropy.dtype))
        return logps, entropies, None
