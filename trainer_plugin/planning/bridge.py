"""The padded-batch bridge: HF/TRL's ``[B, T]`` prompt/completion tensors <-> sequences.

TRL (and most HF training loops) hold a batch as a prompt block and a completion block,
each ``[B, width]`` ids plus a 0/1 mask::

    prompt_ids [B, P]   prompt_mask [B, P]       (TRL: left padding)
    completion_ids [B, C]   completion_mask [B, C]   (TRL: right padding)

:func:`from_padded` reads the real tokens of each row (mask 1; each block's ones must be
one run, padding on the left or on the right) into one sequence per row, prompt then
completion, with the trainable flags (the completion tokens: ``trainable[b]`` is the
prompt length) and the groups (rows with identical prompts share a group, the GRPO
group). :meth:`PaddedSequences.to_padded` goes back: per-position values of packed rows
(``[K, L]``, e.g. log-probabilities at the scored positions) land at ``[B, C]`` where TRL
expects the value of completion token ``c`` of row ``b``, 0 at padding, differentiably.

:func:`from_labeled` reads an SFT batch (``input_ids``, ``attention_mask``, ``labels`` with
-100 off the loss) the same way; its way back is HF's shifted ``[B, T - 1]`` layout.

The way back reads of a packed batch only its scored entries (:class:`ScoredRows`, which
:class:`~treepack.trainer.data.packed_batch.PackedBatch` is): planning sits below the data
floor and imports nothing of it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch

from treepack.proto.errors import InputTypeError, RequestError
from treepack.proto.plan import Plan

__all__ = ["PaddedSequences", "ScoredRows", "from_padded", "from_labeled", "prompt_groups"]


class ScoredRows(Protocol):
    """What :meth:`PaddedSequences.to_padded` reads of packed rows: their scored entries.

    :class:`~treepack.trainer.data.packed_batch.PackedBatch` is one (its attributes of
    these names); T is the number of scored entries.

    Attributes:
        plan: the plan the rows were materialized from.
        num_rows: K, the rows. seq_len: L, their length.
        score_seq: [T] int64 sequence of each scored entry.
        score_pos: [T] int64 index of the token each entry predicts.
        score_flat: [T] int64 flat row position (``row * L + index``) of each entry.
    """

    @property
    def plan(self) -> Plan: ...

    @property
    def num_rows(self) -> int: ...

    @property
    def seq_len(self) -> int: ...

    @property
    def score_seq(self) -> torch.Tensor: ...

    @property
    def score_pos(self) -> torch.Tensor: ...

    @property
    def score_flat(self) -> torch.Tensor: ...


@dataclass(frozen=True, slots=True, kw_only=True)
class PaddedSequences:
    """The rows of a padded prompt/completion batch as sequences, and the way back.

    Attributes:
        sequences: B int64 arrays, row b's real prompt tokens then its real completion tokens.
        prompt_lens: [B] int64 real prompt tokens of each row.
        completion_lens: [B] int64 real completion tokens of each row.
        groups: [B] int64 dense code of each row's prompt (identical prompts, one code;
            codes in order of first appearance).
        token_ptr: [B + 1] int64 CSR of the sequences' tokens in ``token_cols``.
        token_cols: [sum lengths] int64 output column of the value that predicts each token
            (the completion block's column of a completion token; -1 for a token whose value
            has no place in the output, e.g. a prompt token).
        completion_width: C, the output's width (the completion block's).
        flags: per sequence a [len] bool array of trainable tokens, or None when the
            trainable tokens are exactly the completion (``trainable`` is then the prompt lengths).
    """

    sequences: list[np.ndarray]
    prompt_lens: np.ndarray
    completion_lens: np.ndarray
    groups: np.ndarray
    token_ptr: np.ndarray
    token_cols: np.ndarray
    completion_width: int
    flags: list[np.ndarray] | None = None

    @property
    def batch_size(self) -> int:
        """B, the rows."""
        return len(self.sequences)

    @property
    def trainable(self) -> list[Any]:
        """The planner's and ``materialize``'s trainable form: the prompt lengths (or ``flags``)."""
        return [int(p) for p in self.prompt_lens] if self.flags is None else self.flags

    @property
    def lengths(self) -> np.ndarray:
        """[B] int64 sequence lengths."""
        return self.prompt_lens + self.completion_lens

    def to_padded(self, batch: ScoredRows, values: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """Scatter per-position values of packed rows to ``[B, C]`` (differentiable).

        Entry ``(b, c)`` receives the value at the row position that predicts completion
        token ``c`` of row ``b`` (the position of the token before it), which is where
        :meth:`~treepack.trainer.data.packed_batch.PackedBatch.target_logprobs` writes that token's log-probability.

        Args:
            batch: the packed rows, materialized from a plan of ``sequences`` with
                ``trainable`` (all rows, or a subset: rows not in ``batch`` keep ``out``).
            values: [K, L, ...] per-position values of ``batch``'s rows.
            out: [B, C, ...] to write into (out of place); default zeros.

        Returns:
            [B, C, ...] values, ``out`` (or 0) where ``batch`` scores nothing.

        Raises:
            RequestError: ``values`` of another shape, or a batch of another plan's sequences.
        """
        K, L = batch.num_rows, batch.seq_len
        if values.ndim < 2 or tuple(values.shape[:2]) != (K, L):
            raise RequestError(
                f"values must have shape [{K}, {L}, ...], got {tuple(values.shape)}", path="$.values", rule="shape"
            )
        B, C = self.batch_size, self.completion_width
        if batch.plan.num_sequences != B:
            raise RequestError(
                f"the batch's plan has {batch.plan.num_sequences} sequences, the padded batch {B}",
                path="$.batch",
                rule="plan_mismatch",
            )
        seq = batch.score_seq.cpu().numpy()
        pos = batch.score_pos.cpu().numpy()
        lens = self.lengths[seq]
        if (pos >= lens).any():
            raise RequestError(
                "the batch scores tokens past the padded rows' sequences", path="$.batch", rule="plan_mismatch"
            )
        cols = self.token_cols[self.token_ptr[seq] + pos]
        if (cols < 0).any():
            raise RequestError(
                "the batch scores tokens outside the completions: materialize it with trainable=padded.trainable",
                path="$.batch",
                rule="plan_mismatch",
            )
        dev = values.device
        tail = tuple(values.shape[2:])
        if out is None:
            out = values.new_zeros((B, C, *tail))
        elif tuple(out.shape) != (B, C, *tail):
            raise RequestError(
                f"out must have shape {(B, C, *tail)}, got {tuple(out.shape)}", path="$.out", rule="shape"
            )
        src = values.reshape(K * L, *tail)[batch.score_flat.to(dev)]
        idx = (torch.from_numpy(seq).to(dev), torch.from_numpy(cols).to(dev))
        return out.index_put(idx, src.to(out.dtype))


def _runs(mask: torch.Tensor, what: str) -> tuple[np.ndarray, np.ndarray]:
    """(start, length) [B] int64 of each row's run of ones; refuses a row whose ones are not one run."""
    m = mask.detach().cpu().numpy()
    if m.ndim != 2:
        raise RequestError(f"{what} must be [B, width], got shape {m.shape}", path=f"$.{what}", rule="shape")
    if not np.isin(m, (0, 1)).all():
        raise RequestError(f"{what} must hold 0/1 (or bool)", path=f"$.{what}", rule="value")
    m = m.astype(bool)
    n = m.sum(1).astype(np.int64)
    start = np.where(n > 0, m.argmax(1) if m.shape[1] else 0, 0).astype(np.int64)  # width 0: no runs
    width = m.shape[1]
    cols = np.arange(width)[None, :]
    run = (cols >= start[:, None]) & (cols < (start + n)[:, None])
    bad = np.flatnonzero((run != m).any(1))
    if bad.shape[0]:
        b = int(bad[0])
        raise RequestError(
            f"{what}[{b}] has padding inside the row (its ones are not one run); pad on the left or on the right",
            path=f"$.{what}[{b}]",
            rule="padding",
        )
    return start, n


def prompt_groups(prompts: list[np.ndarray]) -> np.ndarray:
    """[B] int64 dense group codes, one per distinct prompt, in order of first appearance."""
    index: dict[bytes, int] = {}
    return np.array([index.setdefault(p.astype(np.int64).tobytes(), len(index)) for p in prompts], dtype=np.int64)


def from_padded(
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    completion_ids: torch.Tensor,
    completion_mask: torch.Tensor,
) -> PaddedSequences:
    """Read a padded prompt/completion batch as sequences, trainable flags and groups.

    Args:
        prompt_ids: [B, P] int token ids.
        prompt_mask: [B, P] 0/1, each row's ones one run (left or right padding).
        completion_ids: [B, C] int token ids.
        completion_mask: [B, C] 0/1, each row's ones one run.

    Returns:
        The :class:`PaddedSequences`.

    Raises:
        RequestError: mismatched shapes, padding inside a row, or a row with a completion
            but no prompt (its first token would have nothing to be predicted from).
        InputTypeError: ids that are not integers.
    """
    for name, x in (("prompt_ids", prompt_ids), ("completion_ids", completion_ids)):
        if x.dtype.is_floating_point or x.dtype == torch.bool:
            raise InputTypeError(f"{name} must hold integer ids, got {x.dtype}", path=f"$.{name}", rule="dtype")
    B = prompt_ids.shape[0]
    for name, x, ref in (
        ("prompt_mask", prompt_mask, prompt_ids),
        ("completion_ids", completion_ids, None),
        ("completion_mask", completion_mask, completion_ids),
    ):
        if (ref is not None and tuple(x.shape) != tuple(ref.shape)) or x.ndim != 2 or x.shape[0] != B:
            raise RequestError(
                f"{name} has shape {tuple(x.shape)}; expected [{B}, ...] matching its ids",
                path=f"$.{name}",
                rule="shape",
            )
    p_start, p_len = _runs(prompt_mask, "prompt_mask")
    c_start, c_len = _runs(completion_mask, "completion_mask")
    orphan = np.flatnonzero((p_len == 0) & (c_len > 0))
    if orphan.shape[0]:
        b = int(orphan[0])
        raise RequestError(f"row {b} has a completion but an empty prompt", path=f"$.prompt_mask[{b}]", rule="empty")
    pid = prompt_ids.detach().cpu().numpy().astype(np.int64)
    cid = completion_ids.detach().cpu().numpy().astype(np.int64)
    prompts = [pid[b, p_start[b] : p_start[b] + p_len[b]] for b in range(B)]
    seqs = [np.concatenate([prompts[b], cid[b, c_start[b] : c_start[b] + c_len[b]]]) for b in range(B)]
    cols = [np.concatenate([np.full(p_len[b], -1), np.arange(c_start[b], c_start[b] + c_len[b])]) for b in range(B)]
    return PaddedSequences(
        sequences=seqs,
        prompt_lens=p_len,
        completion_lens=c_len,
        groups=prompt_groups(prompts),
        token_ptr=np.concatenate([[0], np.cumsum(p_len + c_len)]).astype(np.int64),
        token_cols=np.concatenate(cols or [np.zeros(0)]).astype(np.int64),
        completion_width=int(completion_ids.shape[1]),
    )


def from_labeled(input_ids: torch.Tensor, attention_mask: torch.Tensor, labels: torch.Tensor) -> PaddedSequences:
    """Read an SFT batch (``[B, T]`` ids, mask, labels with -100 off the loss) as sequences.

    The output layout is HF's shifted one: the value predicting token ``t`` of row b's
    run sits at column ``start_b + t - 1`` of ``[B, T - 1]`` (``log_probs[:, k]`` scores
    ``labels[:, k + 1]``). Trainable tokens are those whose label is not -100; groups are
    the rows themselves (sharing comes from the tree, not from a loss group).

    Args:
        input_ids: [B, T] int ids.
        attention_mask: [B, T] 0/1, each row's ones one run.
        labels: [B, T] int, the token itself or -100.

    Returns:
        The :class:`PaddedSequences` (``prompt_lens`` 0, ``completion_lens`` the lengths,
        ``flags`` the trainable tokens, ``completion_width`` T - 1).

    Raises:
        RequestError: mismatched shapes, padding inside a row, a label on a padding position
            or a label that is not the row's own next token.
    """
    if (
        input_ids.dtype.is_floating_point
        or tuple(attention_mask.shape) != tuple(input_ids.shape)
        or tuple(labels.shape) != tuple(input_ids.shape)
    ):
        raise RequestError(
            f"input_ids, attention_mask and labels must be [B, T] ids alike; got {tuple(input_ids.shape)}, "
            f"{tuple(attention_mask.shape)}, {tuple(labels.shape)}",
            path="$.input_ids",
            rule="shape",
        )
    start, n = _runs(attention_mask, "attention_mask")
    ids = input_ids.detach().cpu().numpy().astype(np.int64)
    lab = labels.detach().cpu().numpy().astype(np.int64)
    B, T = ids.shape
    on = lab != -100
    m = attention_mask.detach().cpu().numpy().astype(bool)
    bad = np.argwhere(on & (~m | (lab != ids)))
    if bad.shape[0]:
        b, t = (int(x) for x in bad[0])
        raise RequestError(
            f"labels[{b}, {t}] = {int(lab[b, t])} is not the row's token there (or sits on padding)",
            path=f"$.labels[{b}][{t}]",
            rule="plan_mismatch",
        )
    seqs = [ids[b, start[b] : start[b] + n[b]] for b in range(B)]
    flags = [on[b, start[b] : start[b] + n[b]] for b in range(B)]
    cols = [np.concatenate([[-1], np.arange(start[b], start[b] + n[b] - 1)]) if n[b] else np.zeros(0) for b in range(B)]
    return PaddedSequences(
        sequences=seqs,
        prompt_lens=np.zeros(B, dtype=np.int64),
        completion_lens=n,
        groups=np.arange(B, dtype=np.int64),
        token_ptr=np.concatenate([[0], np.cumsum(n)]).astype(np.int64),
        token_cols=np.concatenate(cols or [np.zeros(0)]).astype(np.int64),
        completion_width=max(T - 1, 0),
        flags=flags,
    )
