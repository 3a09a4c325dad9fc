"""How the TRL trainers pack: :class:`PackingConfig`, and the row length it picks per batch."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import numpy as np

from treepack.proto.errors import RequestError
from treepack.trainer.kernels.attention import AUTO, BACKENDS
from treepack.trainer.planning.bridge import PaddedSequences
from treepack.trainer.planning.planner import PlannerArg

__all__ = ["PackingConfig", "choose_seq_len", "record_tag"]


@dataclass(frozen=True, slots=True, kw_only=True)
class PackingConfig:
    """How the trainers of :mod:`treepack.trainer.trl` pack (``TreepackGRPOTrainer``, ``TreepackSFTTrainer``).

    Attributes:
        seq_len: row length L; None picks one per batch (:func:`choose_seq_len`).
        min_shared_len: shortest shared run the planner keeps (GRPO prompts are the
            shared runs; the planner's default 64 hides short prompts, so 16 here).
        backend: tree attention backend, ``auto`` (default: ``flash``, the copy-free
            varlen path, on a GPU where flash-attn imports and on a CPU for rows of at least
            2,048 tokens, with the batched CPU kernel; ``sdpa`` elsewhere:
            :func:`~treepack.trainer.kernels.attention.resolve_backend`) | ``sdpa`` (dense mask,
            CPU and GPU) | ``flex`` | ``flash``.
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
            (:func:`~treepack.trainer.hf.admission.verify_model`, once per setup).
        allow_dropout: accept dropout outside attention while training (one mask per shared
            prefix: not exact). Default: refused.
        allow_stochastic: accept other random draws while training (router jitter, sampling
            routers, layerdrop: one draw per shared prefix, not exact). Default: refused.
        report_parity: at the first packed step, print the parity report of its batch
            (:func:`~treepack.trainer.parity_report`: packed drift against each sequence alone
            and the model's own noise floor at the step's precision; the main process prints).
        cost_model: a :class:`~treepack.proto.cost.CostModel` (``treepack.trainer.calibrate``)
            for the embedded planner: ``placement="auto"`` then packs each micro-batch as a
            tree or plainly, whichever is predicted faster (a sidecar ``planner`` uses its
            own ``cost_model_path``; giving both is refused).
        tag: the task tag every sequence this trainer packs is recorded with in the
            planner's shape history (what-ifs sample one run's batches by ``history_tags``
            or ``by_tag``): None takes TRL's ``run_name``, else the name of its
            ``output_dir``; ``""`` records them untagged. At most 256 characters.
        verbose: print, on the main process, when the first packed step verifies packing
            on the model (and how long it took) and, after ``train()``, one line of what
            packing saved (batches, rows, tokens computed of the unpacked total, planning time).
    """

    seq_len: int | None = None
    min_shared_len: int = 16
    backend: str = AUTO
    placement: str = "auto"
    planner: PlannerArg = None
    max_seq_len: int = 8192
    keep_groups: bool = False
    verify: bool = True
    allow_dropout: bool = False
    allow_stochastic: bool = False
    report_parity: bool = False
    cost_model: Any = None
    tag: str | None = None
    verbose: bool = True

    def __post_init__(self) -> None:
        if self.backend not in (*BACKENDS, AUTO):
            raise RequestError(
                f"backend must be one of {(*BACKENDS, AUTO)}, got {self.backend!r}",
                path="$.packing.backend",
                rule="enum",
            )
        if self.tag is not None and (not isinstance(self.tag, str) or len(self.tag) > 256):
            raise RequestError(
                f"tag must be a string of at most 256 characters, got {self.tag!r:.80}",
                path="$.packing.tag",
                rule="type",
            )
        if self.cost_model is not None and self.planner is not None:
            raise RequestError(
                "give cost_model (embedded planner) or planner, not both: a sidecar uses its own cost_model_path, "
                "a Packer its own cost_model",
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


def record_tag(config: PackingConfig, args: Any) -> str | None:
    """The tag the trainer's sequences are recorded with (:attr:`PackingConfig.tag`), or
    None for untagged.

    Args:
        config: the packing config.
        args: TRL's training arguments (``run_name``, ``output_dir``), or None.
    """
    if config.tag is not None:
        return config.tag or None
    out = getattr(args, "output_dir", None)
    name = getattr(args, "run_name", None) or (os.path.basename(os.path.normpath(out)) if out else "")
    return name[:256] or None


def choose_seq_len(padded: PaddedSequences, config: PackingConfig) -> int:
    """Row length for ``padded``: ``config.seq_len``, or room for the largest prompt tree.

    A tree (one prompt and its group's completions) needs at most prompt + all its
    completions tokens, plus one per completion but the first: the prompt's last token
    predicts each completion's first token, so every branch holds its own copy of it (the
    join token, SPEC 2 rule 3); L is that for the largest group (without groups, as from
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
        # Each completion with its own copy of the join token; the prompt's copy is the first's.
        tree = np.bincount(padded.groups, weights=padded.completion_lens + 1, minlength=1)
        first = np.unique(padded.groups, return_index=True)[1]
        tree[padded.groups[first]] += padded.prompt_lens[first] - 1
    need = max(int(lens.max(initial=1)), min(int(tree.max(initial=1)), config.max_seq_len))
    step = 128 if config.backend == "flex" else 16
    return -(-need // step) * step
