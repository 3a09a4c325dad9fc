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

:func:`sequence_images` cuts TRL's batched image inputs (every image of the batch
concatenated) into each row's own, as its processor gives them for that row alone.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from treepack.proto.errors import InputTypeError, RequestError
from treepack.trainer.data.packed_batch import PackedBatch

__all__ = ["PaddedSequences", "from_padded", "from_labeled", "prompt_groups", "sequence_images"]


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

    def to_padded(self, batch: PackedBatch, values: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """Scatter per-position values of packed rows to ``[B, C]`` (differentiable).

        Entry ``(b, c)`` receives the value at the row position that predicts completion
        token ``c`` of row ``b`` (the position of the token before it), which is where
        :meth:`PackedBatch.target_logprobs` writes that token's log-probability.

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
    start = np.where(n > 0, m.argmax(1), 0).astype(np.int64)
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
            f"input_ids, attention_mask and labels must be [B, T] ids alike; got {tuple(input_ids.shape)}, {tuple(attention_mask.shape)}, {tuple(labels.shape)}",
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


# TRL's per-token log-probability keywords for image inputs that tree rows do not take.
_REFUSED_IMAGE_KWARGS = (
    "pixel_attention_mask",
    "spatial_shapes",
    "num_tiles",
    "image_sizes",
    "token_type_ids",
    "image_position_ids",
)


def sequence_images(
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    *,
    image_token_id: int | None,
    pixel_values: torch.Tensor | None = None,
    image_grid_thw: torch.Tensor | None = None,
    num_images: list[int] | None = None,
    mm_token_type_ids: torch.Tensor | None = None,
    **other: Any,
) -> tuple[list[torch.Tensor | None] | None, list[torch.Tensor | None] | None]:
    """TRL's batched image inputs cut into each sequence's own (what its processor gives it alone).

    TRL concatenates the batch's images: ``pixel_values`` holds every image's patch rows in
    sequence order, ``image_grid_thw`` one ``[t, h, w]`` per image, ``num_images`` (GRPO)
    each sequence's image count. Without ``num_images`` (SFT's collator gives none) each
    row takes the next images whose placeholder tokens its own placeholders cover
    (:func:`_image_counts`).

    Args:
        input_ids: [B, P + C] TRL's ids (left-padded prompts, right-padded completions).
        attention_mask: [B, P + C] 0/1.
        image_token_id: the model's image placeholder id (checked against ``mm_token_type_ids``).
        pixel_values: [sum patches, D] or None (a text-only batch).
        image_grid_thw: [sum images, 3]; required with ``pixel_values``.
        num_images: [B] images per sequence, or None: read from the placeholders.
        mm_token_type_ids: [B, P + C] or None: 1 on image placeholders, 0 elsewhere (2,
            video, is refused); must mark exactly the ``image_token_id`` positions.
        **other: TRL's other image keywords (``image_sizes``, ``pixel_attention_mask``, ...):
            refused when given.

    Returns:
        (per sequence its ``pixel_values`` or None, per sequence its ``[m, 3]`` grids or None),
        or (None, None) without images.

    Raises:
        RequestError: an unsupported image keyword, image inputs without grids or counts, or
            counts that do not cover the inputs, naming what.
    """
    given = [k for k, v in other.items() if v is not None]
    if given:
        what = given[0]
        why = (
            "not a model input tree rows take"
            if what not in _REFUSED_IMAGE_KWARGS
            else "supported image inputs are pixel_values with image_grid_thw (Qwen-VL families)"
        )
        raise RequestError(f"the packed forward got {what}: {why}", path=f"$.{what}", rule="unsupported")
    if mm_token_type_ids is not None:
        mm = mm_token_type_ids.to(attention_mask.device)
        if bool((mm > 1).any()):
            raise RequestError(
                "mm_token_type_ids marks video tokens: video inputs are not supported on tree rows",
                path="$.mm_token_type_ids",
                rule="unsupported",
            )
        placeholders = (
            (input_ids == image_token_id) & attention_mask.bool()
            if image_token_id is not None
            else torch.zeros_like(attention_mask, dtype=torch.bool)
        )
        if not torch.equal(mm.bool() & attention_mask.bool(), placeholders):
            raise RequestError(
                f"mm_token_type_ids marks other positions than the image token {image_token_id}",
                path="$.mm_token_type_ids",
                rule="image_placeholders",
            )
    if pixel_values is None:
        if image_grid_thw is not None:
            raise RequestError("image_grid_thw given without pixel_values", path="$.image_grid_thw", rule="missing")
        return None, None
    if image_grid_thw is None:
        raise RequestError(
            "pixel_values without image_grid_thw: supported image inputs are pixel_values with image_grid_thw (Qwen-VL families)",
            path="$.image_grid_thw",
            rule="missing",
        )
    B = input_ids.shape[0]
    rows = image_grid_thw.prod(-1).tolist()
    if sum(rows) != pixel_values.shape[0]:
        raise RequestError(
            f"image_grid_thw covers {sum(rows)} patch rows, pixel_values has {pixel_values.shape[0]}",
            path="$.image_grid_thw",
            rule="shape",
        )
    counts = (
        _image_counts(input_ids, attention_mask, image_token_id, rows)
        if num_images is None
        else [int(n) for n in num_images]
    )
    if len(counts) != B or sum(counts) != image_grid_thw.shape[0]:
        raise RequestError(
            f"num_images {counts} does not cover {B} sequences and {image_grid_thw.shape[0]} image grids",
            path="$.num_images",
            rule="length",
        )
    pv: list[torch.Tensor | None] = []
    thw: list[torch.Tensor | None] = []
    img = row = 0
    for n in counts:
        r = sum(rows[img : img + n])
        pv.append(pixel_values[row : row + r] if n else None)
        thw.append(image_grid_thw[img : img + n] if n else None)
        img, row = img + n, row + r
    return pv, thw


def _image_counts(
    input_ids: torch.Tensor, attention_mask: torch.Tensor, image_token_id: int | None, patches: list[int]
) -> list[int]:
    """[B] images of each row, read from its placeholder tokens (images in row order).

    Every image takes ``patches / m`` placeholders, ``m`` the batch's patches per
    placeholder (one spatial merge for all images, as :func:`~treepack.trainer.planning.images.placeholder_counts`
    assumes); row b takes the next images until their placeholders make its own count.

    Raises:
        RequestError: placeholders that do not cover the images image by image (e.g. cut by
            truncation), naming the row.
    """
    per_row = (
        ((input_ids == image_token_id) & attention_mask.bool()).sum(1).tolist()
        if image_token_id is not None
        else [0] * input_ids.shape[0]
    )
    total = sum(per_row)
    m = sum(patches) // total if total else 0
    if not m or m * total != sum(patches) or any(p % m for p in patches):
        raise RequestError(
            f"the rows hold {total} image placeholder tokens, which do not split over {len(patches)} images of {patches} patches (truncated by max_length?)",
            path="$.input_ids",
            rule="image_placeholders",
        )
    counts, img = [], 0
    for b, n in enumerate(per_row):
        start = img
        while n > 0 and img < len(patches):
            n -= patches[img] // m
            img += 1
        if n != 0:
            raise RequestError(
                f"row {b}'s image placeholder tokens do not cover whole images (truncated by max_length?)",
                path=f"$.input_ids[{b}]",
                rule="image_placeholders",
            )
        counts.append(img - start)
    return counts
