"""``TreepackRewardTrainer``: ``trl.RewardTrainer`` scoring its preference pairs on tree-packed rows.

TRL's reward loss reads one model call on ``[2B, T]`` ids (the B chosen sequences, then the
B rejected ones, right-padded). A chosen and a rejected sequence share their prompt; here
the call is read as 2B sequences (:func:`~treepack.trainer.planning.bridge.from_padded`),
planned with each pair as a group (nothing is trainable: every prefix may be shared), and
the reward model runs on the rows through :func:`~treepack.trainer.hf.packed_forward`, whose
sequence-classification head reads each sequence at its own last non-pad token
(:mod:`treepack.trainer.hf.task_head`). The ``[2B, 1]`` scores go back to TRL's loss,
accuracy and margin metrics untouched; see :mod:`treepack.trainer.trl`.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import torch
import trl
from transformers.modeling_outputs import SequenceClassifierOutput

from treepack.proto.errors import RequestError
from treepack.trainer.data.materialize import materialize
from treepack.trainer.hf.forward import packed_forward
from treepack.trainer.kernels.attention import resolve_backend
from treepack.trainer.planning.bridge import from_padded
from treepack.trainer.trl.config import PackingConfig
from treepack.trainer.trl.step import PackedRows

__all__ = ["TreepackRewardTrainer"]


class TreepackRewardTrainer(PackedRows, trl.RewardTrainer):
    """``trl.RewardTrainer`` whose reward model runs on tree-packed rows.

    The model is a ``*ForSequenceClassification`` (TRL's reward model); its scores equal each
    sequence run alone: HF's pooling at the last token that is not the pad id, per sequence.
    TRL's loss (the pairwise log-sigmoid, ``margin``, ``center_rewards_coefficient``) runs on
    them as on stock's.

    Args:
        *args, **kwargs: exactly ``trl.RewardTrainer``'s.
        packing: a :class:`~treepack.trainer.trl.config.PackingConfig` (default ``PackingConfig()``).
    """

    def __init__(self, *args: Any, packing: PackingConfig | None = None, **kwargs: Any) -> None:
        self._init_packing(packing)
        super().__init__(*args, **kwargs)

    def compute_loss(
        self, model: Any, inputs: dict[str, Any], return_outputs: bool = False, num_items_in_batch: Any = None
    ) -> Any:
        """TRL's reward loss, with the model call replaced by the packed one (:meth:`_reward_forward`)."""
        call = lambda **kw: self._reward_forward(model, **kw)  # noqa: E731
        return super().compute_loss(call, inputs, return_outputs=return_outputs, num_items_in_batch=num_items_in_batch)

    def _reward_forward(
        self,
        model: Any,
        *,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        use_cache: Any = None,
        margin: Any = None,
        **rest: Any,
    ) -> SequenceClassifierOutput:
        """``[2B, 1]`` scores of TRL's ``[2B, T]`` call, computed on tree rows.

        Args:
            input_ids, attention_mask: TRL's batch (each row's ones one run).
            use_cache: ignored (TRL passes False).
            margin: read by TRL's loss, not by the model.
            **rest: any other keyword is refused by name.

        Returns:
            A ``SequenceClassifierOutput`` whose ``logits`` are each row's score, as stock's.
        """
        given = sorted(k for k, v in rest.items() if v is not None)
        if given:
            raise RequestError(
                f"TreepackRewardTrainer packs calls of input_ids and attention_mask; got {given[0]}",
                path=f"$.{given[0]}",
                rule="unsupported",
            )
        empty = input_ids[:, :0]
        padded = from_padded(input_ids, attention_mask, empty, attention_mask[:, :0])
        B = padded.batch_size
        # Nothing is trainable (a reward model scores sequences); chosen b and rejected b share a prompt.
        padded = dataclasses.replace(padded, flags=[np.zeros(len(s), dtype=bool) for s in padded.sequences])
        mb = self._plan(padded, 1, (np.arange(B) % max(B // 2, 1)).tolist())
        rows = mb.rows[0, 0]
        batch = materialize(
            mb.plan,
            padded.sequences,
            device=input_ids.device,
            trainable=padded.trainable,
            rows=rows[rows >= 0],
            allow_empty_loss=True,
            advise=False,
        )
        assert np.array_equal(batch.local_seqs, np.arange(B)), "one plan of the call: every sequence is local"
        with self.accelerator.autocast():
            scores = packed_forward(
                model,
                batch,
                backend=resolve_backend(self.packing.backend, batch.device, batch.seq_len),
                verify=self.packing.verify,
                allow_dropout=self.packing.allow_dropout,
            )
        return SequenceClassifierOutput(logits=scores)
