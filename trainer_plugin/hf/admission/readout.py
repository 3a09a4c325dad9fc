"""What the probe compares, by the model's head: log-probabilities, per-token values or per-sequence scores.

The probe runs every sequence alone, all of them right-padded in one batch, and packed, and
compares one output per side (:mod:`~treepack.trainer.hf.admission.probe`). What that output is
follows the head (:func:`~treepack.trainer.hf.task_head.task_head`):

- ``lm``: each token's log-probability given the tokens before it, [n] per sequence with NaN
  at position 0 (:func:`~treepack.trainer.hf.admission.measure.alone_logprobs`);
- ``token``: the head's outputs at every token, [n, num_labels] per sequence;
- ``sequence``: the score, [num_labels] per sequence. Alone it is HF's own pooled output (the
  truth the packed rows must equal); right-padded, the score module's output read at each
  sequence's pooled token (HF would pool the padded rows at their padding when the pad id is
  not the one padded with).

Every side's outputs are lists of float tensors of one shape per sequence, so the noise
model, the bounds and the weighted loss whose gradients are compared stay the same for all.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from treepack.trainer.data.values import naive_last_token
from treepack.trainer.hf.admission.measure import (
    SHAPES,
    alone_logprobs,
    padded_logprobs,
    right_padded,
    seed,
    upcast,
)
from treepack.trainer.hf.task_head import TaskHead, per_position_scores, task_head

__all__ = ["Readout", "readout"]

Outputs = list[torch.Tensor]


@dataclass(frozen=True, slots=True, kw_only=True)
class Readout:
    """The probe's output of each side for one head.

    Attributes:
        name: what is compared (``logprobs`` | ``values`` | ``scores``), for messages.
        alone: (call, sequences, seed offset) -> each sequence's output, run alone through
            the caller's callable (wrappers included).
        padded: (call, sequences, shape) -> each sequence's output, the sequences right-padded
            into the batches of ``shape`` (a key of :data:`~treepack.trainer.hf.admission.measure.SHAPES`).
        packed: (batch, the packed call's result) -> each sequence's output.
    """

    name: str
    alone: Callable[[Any, list[torch.Tensor], int], Outputs]
    padded: Callable[[Any, list[torch.Tensor], str], Outputs]
    packed: Callable[[Any, torch.Tensor], Outputs]


def _in_shape(seqs: list[torch.Tensor], shape: str, run: Callable[[list[torch.Tensor]], Outputs]) -> Outputs:
    """Each sequence's output with the sequences dealt into the batches of ``shape``; ``run``
    takes one batch's sequences and returns their outputs in order."""
    parts, rev = SHAPES[shape]
    order = list(range(len(seqs)))[::-1] if rev else list(range(len(seqs)))
    out: Outputs = [torch.empty(0)] * len(seqs)
    for k in range(parts):
        idx = order[k::parts]
        if idx:
            for i, o in zip(idx, run([seqs[i] for i in idx])):
                out[i] = o
    return out


def _lm_packed(batch: Any, out: torch.Tensor) -> Outputs:
    return [x for x in batch.unpack_logprobs(batch.target_logprobs(upcast(out))) if x is not None]


def _head_alone(call: Any, seqs: list[torch.Tensor], offset: int = 0) -> Outputs:
    out = []
    for s in seqs:
        seed(offset)
        out.append(upcast(call(input_ids=s[None], use_cache=False).logits[0]))
    return out


def _token_padded(call: Any, seqs: list[torch.Tensor], shape: str = "right-padded") -> Outputs:
    def run(part: list[torch.Tensor]) -> Outputs:
        ids, mask = right_padded(part)
        seed()
        logits = upcast(call(input_ids=ids, attention_mask=mask, use_cache=False).logits)
        return [logits[i, : s.shape[0]] for i, s in enumerate(part)]

    return _in_shape(seqs, shape, run)


def _token_packed(batch: Any, out: torch.Tensor) -> Outputs:
    return [x for x in batch.unpack_values(upcast(out)) if x is not None]


def _sequence_padded(hf: Any, head: TaskHead) -> Callable[[Any, list[torch.Tensor], str], Outputs]:
    def padded(call: Any, seqs: list[torch.Tensor], shape: str = "right-padded") -> Outputs:
        def run(part: list[torch.Tensor]) -> Outputs:
            ids, mask = right_padded(part)
            seed()
            inputs = dict(input_ids=ids, attention_mask=mask, use_cache=False)
            scores = upcast(per_position_scores(call, hf, head, inputs))
            return [scores[i, naive_last_token(s.tolist(), head.pad_token_id)] for i, s in enumerate(part)]

        return _in_shape(seqs, shape, run)

    return padded


def _sequence_packed(batch: Any, out: torch.Tensor) -> Outputs:
    return list(upcast(out).unbind(0))


def readout(hf: Any) -> Readout:
    """The probe's :class:`Readout` for the unwrapped model ``hf``, by its head
    (:func:`~treepack.trainer.hf.task_head.task_head`)."""
    head = task_head(hf)
    if head.kind == "token":
        return Readout(name="values", alone=_head_alone, padded=_token_padded, packed=_token_packed)
    if head.kind == "sequence":
        return Readout(name="scores", alone=_head_alone, padded=_sequence_padded(hf, head), packed=_sequence_packed)
    return Readout(name="logprobs", alone=alone_logprobs, padded=padded_logprobs, packed=_lm_packed)
