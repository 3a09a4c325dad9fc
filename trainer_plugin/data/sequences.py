"""The trainer's per-sequence inputs, read for :func:`~treepack.trainer.data.materialize`.

Token ids and payloads arrive as list-likes of per-sequence arrays (lazy ones are indexed
only at the sequences a batch needs), callables ``s -> array``, or one flat array of every
sequence's tokens; trainable flags as bool arrays or prompt lengths; group ids as ints or
strings. Each is checked against the plan here, naming the offending entry.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from treepack.proto.errors import InputTypeError, RequestError
from treepack.proto.plan import Plan

__all__ = [
    "normalize_trainable", "group_codes", "plan_trainable", "plan_groups", "check_count", "check_rows", "concat_arrays",
]  # fmt: skip


def _as_tensor(x: Any, *, path: str) -> torch.Tensor:
    """One sequence's array as a tensor (numpy unsigned ids widened to int64)."""
    if isinstance(x, torch.Tensor):
        return x
    arr = np.asarray(x)
    if arr.dtype == object:
        raise InputTypeError(f"expected a numeric array, got {type(x).__name__} of objects", path=path, rule="dtype")
    if arr.dtype.kind == "u" and arr.dtype.itemsize >= 2:
        arr = arr.astype(np.int64)
    return torch.from_numpy(np.ascontiguousarray(arr))


def normalize_trainable(trainable: Sequence[Any] | None, plan: Plan) -> Callable[[int], np.ndarray]:
    """Per-sequence trainable flags in the planner's forms, cut to the placed length.

    Args:
        trainable: None (nothing trainable), or per sequence a bool array (of the
            submitted or the placed length) or a prompt length.
        plan: the plan (for the lengths).

    Returns:
        ``flags(s)`` -> [seq_lens[s]] bool.

    Raises:
        RequestError: wrong count or a length that matches neither the submitted nor the
            placed length of the sequence.
    """
    S = plan.num_sequences
    if trainable is None:
        return lambda s: np.zeros(int(plan.seq_lens[s]), dtype=bool)
    if len(trainable) != S:
        raise RequestError(
            f"trainable has {len(trainable)} entries for the plan's {S} sequences",
            path="$.trainable",
            rule="length_mismatch",
        )

    def flags(s: int) -> np.ndarray:
        n, m = int(plan.seq_lens[s]), int(plan.orig_lens[s])
        x = trainable[s]
        path = f"$.trainable[{s}]"
        if isinstance(x, (bool, np.bool_)):
            raise InputTypeError(f"expected a bool array or a prompt length, got {x!r}", path=path, rule="type")
        if isinstance(x, (int, np.integer)):
            out = np.zeros(n, dtype=bool)
            out[min(int(x), n) :] = True
            return out
        arr = x.detach().cpu().numpy() if isinstance(x, torch.Tensor) else np.asarray(x)
        if arr.ndim != 1 or arr.shape[0] not in (n, m):
            raise RequestError(
                f"trainable has shape {arr.shape} for a sequence of {m} tokens ({n} placed)",
                path=path,
                rule="length_mismatch",
            )
        return arr[:n].astype(bool)

    return flags


def check_count(sequences: Any, S: int) -> None:
    """``sequences`` must be a list-like of the plan's S sequences.

    Raises:
        RequestError: another count (or not a list-like), naming what was given.
    """
    if isinstance(sequences, (str, bytes)) or not hasattr(sequences, "__len__") or len(sequences) != S:
        got = len(sequences) if hasattr(sequences, "__len__") else type(sequences).__name__
        raise RequestError(f"sequences has {got} entries, the plan has {S}", path="$.sequences", rule="length_mismatch")


def check_rows(rows: Any, plan: Plan) -> np.ndarray:
    if rows is None:
        return np.arange(plan.num_rows, dtype=np.int64)
    arr = np.asarray(rows)
    if arr.ndim != 1 or arr.dtype.kind not in "iu":
        raise InputTypeError(
            f"rows must be a 1-D integer array, got shape {arr.shape} dtype {arr.dtype}", path="$.rows", rule="type"
        )
    arr = arr.astype(np.int64)
    bad = (arr < -1) | (arr >= plan.num_rows)
    if bad.any():
        raise RequestError(
            f"row {int(arr[np.argmax(bad)])} is not in [-1, {plan.num_rows})", path="$.rows", rule="range"
        )
    real = arr[arr >= 0]
    if np.unique(real).shape[0] != real.shape[0]:
        raise RequestError("rows lists a row twice", path="$.rows", rule="unique")
    return arr


def _per_sequence(value: Any, s: int, offsets: np.ndarray | None) -> Any:
    if callable(value) and not isinstance(value, (torch.Tensor, np.ndarray)):
        return value(s)
    if offsets is not None:
        return value[int(offsets[s]) : int(offsets[s + 1])]
    return value[s]


def concat_arrays(value: Any, seqs: np.ndarray, plan: Plan, device: torch.device, *, what: str) -> torch.Tensor:
    """Concatenate ``value``'s arrays of ``seqs`` (each cut to its placed length) on ``device``.

    ``value`` is a list-like of per-sequence arrays (lazy ones are indexed only at
    ``seqs``), a callable ``s -> array``, or one array/tensor whose first dimension is the
    sum of the submitted lengths (sequences concatenated in order).
    """
    offsets = None
    if isinstance(value, (torch.Tensor, np.ndarray)):
        total = int(plan.orig_lens.sum())
        if value.ndim == 0 or value.shape[0] != total:
            raise RequestError(
                f"{what} is one array of shape {tuple(value.shape)}; a flat array needs the sum of the "
                f"sequence lengths ({total}) as its first dimension",
                path=f"$.{what}",
                rule="length_mismatch",
            )
        offsets = np.concatenate([[0], np.cumsum(plan.orig_lens)])
    elif not callable(value) and len(value) != plan.num_sequences:
        raise RequestError(
            f"{what} has {len(value)} entries for the plan's {plan.num_sequences} sequences",
            path=f"$.{what}",
            rule="length_mismatch",
        )
    probe = seqs
    if seqs.shape[0] == 0:
        # No sequence here (a rank holding only empty rows): read one kept sequence's
        # array for its dtype and per-token shape.
        probe = np.flatnonzero(plan.row_of >= 0)[:1]
    parts = []
    for s in probe.tolist():
        t = _as_tensor(_per_sequence(value, s, offsets), path=f"$.{what}[{s}]")
        n, m = int(plan.seq_lens[s]), int(plan.orig_lens[s])
        if t.ndim == 0 or t.shape[0] not in (n, m):
            raise RequestError(
                f"{what}[{s}] has shape {tuple(t.shape)}, expected {m} rows (one per token; {n} placed)",
                path=f"$.{what}[{s}]",
                rule="length_mismatch",
            )
        parts.append(t[: n if seqs.shape[0] else 0].to(device))
    shapes = {tuple(p.shape[1:]) for p in parts}
    if len(shapes) > 1:
        raise RequestError(
            f"{what}: per-token shapes differ between sequences: {sorted(shapes)}", path=f"$.{what}", rule="shape"
        )
    return torch.cat(parts)


def group_codes(groups: Sequence[Any] | None, S: int) -> np.ndarray:
    """[S] int64 dense group codes in order of first appearance (None: each sequence its own group).

    Raises:
        RequestError: a count other than S. InputTypeError: a group id that is not an int or a string.
    """
    if groups is None:
        return np.arange(S, dtype=np.int64)
    if len(groups) != S:
        raise RequestError(
            f"groups has {len(groups)} entries for the plan's {S} sequences", path="$.groups", rule="length_mismatch"
        )
    codes = np.empty(S, dtype=np.int64)
    index: dict[Any, int] = {}
    for s, g in enumerate(groups):
        if g is None:
            g = ("__own__", s)
        elif isinstance(g, np.integer):
            g = int(g)
        elif isinstance(g, (bool, np.bool_)) or not isinstance(g, (int, str)):
            raise InputTypeError(
                f"group must be an int or a string, got {type(g).__name__}", path=f"$.groups[{s}]", rule="type"
            )
        codes[s] = index.setdefault(g, len(index))
    return codes


def _plan_flat_flags(plan: Plan) -> np.ndarray:
    """[sum seq_lens] bool the plan's trainable flags of the placed tokens, sequence after sequence."""
    if plan.trainable is not None:
        return np.asarray(plan.trainable, dtype=bool)
    lens = plan.seq_lens.astype(np.int64)
    starts = np.repeat(np.cumsum(lens) - lens, lens)
    pos = np.arange(int(lens.sum()), dtype=np.int64) - starts
    return pos >= np.repeat(plan.first_trainable.astype(np.int64), lens)


def plan_trainable(
    plan: Plan, trainable: Sequence[Any] | None = None
) -> tuple[Callable[[int], np.ndarray], np.ndarray]:
    """The plan's trainable flags, checked against ``trainable`` when it is given.

    The plan carries the flags it was planned with (``first_trainable`` / ``trainable``), so
    the trainer need not pass them again; passing them is a check.

    Args:
        plan: the plan.
        trainable: None (take the plan's), or per sequence a bool array or a prompt length.

    Returns:
        (``flags(s)`` -> [seq_lens[s]] bool, [S] int64 scored entries per sequence: trainable
        tokens at index >= 1).

    Raises:
        RequestError: ``trainable`` disagrees with the plan (rule ``plan_mismatch``), naming
            the first sequence and position that differ.
    """
    flat = _plan_flat_flags(plan)
    lens = plan.seq_lens.astype(np.int64)
    ptr = np.zeros(lens.shape[0] + 1, dtype=np.int64)
    np.cumsum(lens, out=ptr[1:])
    if trainable is not None:
        given = normalize_trainable(trainable, plan)
        got = np.concatenate([given(s) for s in range(plan.num_sequences)]) if lens.shape[0] else np.zeros(0, bool)
        bad = np.flatnonzero(got != flat)
        if bad.shape[0]:
            i = int(bad[0])
            s = int(np.searchsorted(ptr, i, side="right") - 1)
            raise RequestError(
                f"trainable disagrees with the plan at sequence {s}, token {i - int(ptr[s])} "
                f"(given {bool(got[i])}, planned {bool(flat[i])}); omit trainable= to use the plan's flags",
                path=f"$.trainable[{s}]",
                rule="plan_mismatch",
            )
    seq_of = np.repeat(np.arange(lens.shape[0]), lens)
    scored = flat.copy()
    scored[ptr[:-1][lens > 0]] = False  # a sequence's first token is predicted by nothing
    counts = np.bincount(seq_of[scored], minlength=lens.shape[0]).astype(np.int64)
    return (lambda s: flat[int(ptr[s]) : int(ptr[s + 1])]), counts


def plan_groups(plan: Plan, groups: Sequence[Any] | None = None) -> np.ndarray:
    """[S] int64 the plan's group codes, checked against ``groups`` when it is given.

    Raises:
        RequestError: ``groups`` gives other groups than the plan was made with (rule
            ``plan_mismatch``), naming the first sequence whose group differs.
    """
    codes = np.asarray(plan.group_codes, dtype=np.int64)
    if groups is None:
        return codes
    given = group_codes(groups, plan.num_sequences)
    bad = np.flatnonzero(given != codes)
    if bad.shape[0]:
        s = int(bad[0])
        raise RequestError(
            f"groups disagree with the plan at sequence {s} (its group code is {int(given[s])} here, "
            f"{int(codes[s])} in the plan); omit groups= to use the plan's groups",
            path=f"$.groups[{s}]",
            rule="plan_mismatch",
        )
    return codes
