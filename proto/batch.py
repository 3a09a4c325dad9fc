"""The pack request and its normalization: :class:`PackInput` -> one validated :class:`SequenceBatch`.

:class:`PackInput` is the one form of a pack request: ``plan_batch``, both clients, both
client backends, the wire codec and the planner take it (or build it once, with
:meth:`PackInput.of`, from ``plan_batch``-style keywords).

The planner works in metadata space: after this module, nothing reads token payloads
except the tree builder (to find shared prefixes) and ``validate_plan`` (to check them).
Sequences stay per-sequence uint32 views; nothing is concatenated or copied when the
input already has the right dtype (the wire's columnar buffer is sliced, not copied).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from treepack.proto.errors import CapacityError, InputTypeError, RequestError
from treepack.proto.options import PlanOptions, as_options
from treepack.proto.plan import OverflowEvent

__all__ = ["PackInput", "SequenceBatch", "normalize_batch", "as_trainable", "normalize_trainable", "group_codes"]

MAX_GROUP_LABEL = 256  # characters, as on the wire
_UINT32_MAX = np.iinfo(np.uint32).max
_SAFE_UNSIGNED = (np.dtype(np.uint8), np.dtype(np.uint16), np.dtype(np.uint32))


@dataclass(frozen=True, slots=True, kw_only=True)
class SequenceBatch:
    """A validated batch of sequences, in the planner's terms.

    Attributes:
        tokens: per sequence, a C-contiguous uint32 array of the kept tokens (a dropped
            sequence keeps an empty array so indices stay those of the request).
        lens: [S] int64 kept lengths (0 for dropped sequences).
        orig_lens: [S] int64 lengths as submitted.
        kept: [S] bool, False for sequences dropped by ``on_overflow="drop"``.
        first_trainable: [S] int64 index of the first trainable token (== lens[s] if none).
        trainable: per sequence bool arrays, or None when every sequence was given as a
            prompt length (then ``prompt_lens`` holds them).
        prompt_lens: [S] int64 or None; sequence s is trainable from prompt_lens[s] on.
        group_codes: [S] int64 dense group ids in order of first appearance; a sequence
            without a group gets a code of its own.
        group_labels: the original label of each code (None for ungrouped sequences).
        keys: per sequence uint64 arrays (or None for all-zero keys), or None if no keys.
        overflow: sequences that were truncated or dropped.
    """

    tokens: tuple[np.ndarray, ...]
    lens: np.ndarray
    orig_lens: np.ndarray
    kept: np.ndarray
    first_trainable: np.ndarray
    trainable: tuple[np.ndarray, ...] | None
    prompt_lens: np.ndarray | None
    group_codes: np.ndarray
    group_labels: tuple[Any, ...]
    keys: tuple[np.ndarray | None, ...] | None
    overflow: tuple[OverflowEvent, ...] = field(default=())

    @property
    def num_sequences(self) -> int:
        return len(self.tokens)

    def trainable_of(self, s: int) -> np.ndarray:
        """[lens[s]] bool trainable flags of sequence s."""
        if self.trainable is not None:
            return self.trainable[s]
        out = np.zeros(int(self.lens[s]), dtype=bool)
        out[int(self.prompt_lens[s]) :] = True
        return out

    def flat_trainable(self) -> np.ndarray | None:
        """[sum lens] bool the flags of every kept token, sequence after sequence, or None
        when every sequence was given by a prompt length (see ``first_trainable``)."""
        if self.trainable is None:
            return None
        return np.concatenate(self.trainable) if self.trainable else np.zeros(0, dtype=bool)

    def shareable_lens(self) -> np.ndarray:
        """[S] int64 default-mode shareable length: the index of the first scored position.

        Position p is scored when token p+1 is trainable; a trainable token is never shared
        either, so the shareable run ends before ``first_trainable - 1`` (or covers the whole
        sequence when nothing is trainable).
        """
        ft = self.first_trainable
        return np.where(ft >= self.lens, self.lens, np.maximum(ft - 1, 0)).astype(np.int64)


@dataclass(frozen=True, slots=True, kw_only=True)
class PackInput:
    """One pack request: the batch, its plan options, and what to record with it.

    Attributes:
        sequences: S sequences of token ids in [0, 2**32) (lists, numpy arrays, anything
            ``np.asarray`` takes; uint8/16/32 arrays are used without a copy).
        options: the plan options as given (the planner checks them, ``check_options``).
        trainable: None (no token is a loss target: every sequence fully shareable), or
            per sequence a bool array of its length or a prompt length p (tokens p.. are
            trainable).
        groups: None, or per sequence an int/str group id (or None: a group of its own);
            groups order ``bfd``, they never limit sharing.
        keys: None, or per sequence None or one uint64 per token that must also match
            for two sequences to share a token.
        tags: per sequence a task tag, recorded with the shape (what-if by tag), or None.
        record: record the batch's shape in the history, where there is one (the
            sidecar's, or an embedded client's ``history_path``).
    """

    sequences: Sequence[Any]
    options: PlanOptions
    trainable: Sequence[Any] | None = None
    groups: Sequence[Any] | None = None
    keys: Sequence[Any] | None = None
    tags: Sequence[str | None] | None = None
    record: bool = True

    @classmethod
    def of(
        cls,
        sequences: Sequence[Any],
        options: PlanOptions | None = None,
        *,
        trainable: Sequence[Any] | None = None,
        groups: Sequence[Any] | None = None,
        keys: Sequence[Any] | None = None,
        tags: Sequence[str | None] | None = None,
        record: bool = True,
        **option_kwargs: Any,
    ) -> PackInput:
        """The request from ``plan_batch``-style arguments (the attributes above).

        Args:
            options: a :class:`~treepack.proto.options.PlanOptions`, or its fields as
                keywords instead (``seq_len=...``, ``placement=...``), not both.

        A :class:`PackInput` given as ``sequences``, with nothing else, is returned as it
        is, so every entry point takes either form.

        Raises:
            InputTypeError: both forms of options, an unknown keyword, no ``seq_len``, or
                a :class:`PackInput` with more arguments.
        """
        if isinstance(sequences, PackInput):
            if (
                options is not None
                or option_kwargs
                or any(v is not None for v in (trainable, groups, keys, tags))
                or record is not True
            ):
                raise InputTypeError(
                    "give a PackInput alone, or sequences with their arguments, not both", path="$", rule="exclusive"
                )
            return sequences
        opts = as_options(options, option_kwargs)
        return cls(
            sequences=sequences, options=opts, trainable=trainable, groups=groups, keys=keys, tags=tags, record=record
        )

    def normalize(self, seq_len: int, on_overflow: str) -> SequenceBatch:
        """The :class:`SequenceBatch`, with the checked ``seq_len`` and ``on_overflow``."""
        return normalize_batch(
            self.sequences,
            seq_len=seq_len,
            trainable=self.trainable,
            groups=self.groups,
            keys=self.keys,
            on_overflow=on_overflow,
        )


def _as_tokens(x: Any, i: int) -> np.ndarray:
    path = f"$.sequences[{i}]"
    arr = np.asarray(x)
    if arr.ndim != 1:
        raise InputTypeError(f"expected a 1-D array of token ids, got shape {arr.shape}", path=path, rule="ndim")
    if arr.dtype in _SAFE_UNSIGNED:
        return np.ascontiguousarray(arr, dtype=np.uint32)
    if arr.size == 0:
        return np.zeros(0, dtype=np.uint32)
    if arr.dtype.kind not in "iu":
        raise InputTypeError(f"expected integer token ids, got dtype {arr.dtype}", path=path, rule="dtype")
    lo, hi = int(arr.min()), int(arr.max())
    if lo < 0:
        j = int(np.argmax(arr < 0))
        raise RequestError(f"token id must be >= 0, got {int(arr[j])}", path=f"{path}[{j}]", rule="token_range")
    if hi > _UINT32_MAX:
        j = int(np.argmax(arr > _UINT32_MAX))
        raise RequestError(f"token id must fit uint32, got {int(arr[j])}", path=f"{path}[{j}]", rule="token_range")
    return arr.astype(np.uint32)


def as_trainable(x: Any, n: int, path: str, *, placed: int | None = None) -> tuple[np.ndarray | None, int]:
    """One sequence's trainable flags, in either form: (bool array or None, prompt length or -1).

    Args:
        x: a bool (or 0/1 integer) array of ``n`` flags, or a prompt length p in [0, n]
            (tokens p.. are trainable).
        n: the sequence's length.
        path: where ``x`` is in the request, for errors.
        placed: another accepted array length (the placed length of a truncated
            sequence); flags of the full length are then cut to it.

    Raises:
        InputTypeError: neither form (rules ``type``, ``ndim``, ``dtype``).
        RequestError: a prompt length out of range, or flags of another length.
    """
    if isinstance(x, (bool, np.bool_)):
        raise InputTypeError(f"expected a bool array or a prompt length, got {x!r}", path=path, rule="type")
    if isinstance(x, (int, np.integer)):
        p = int(x)
        if not 0 <= p <= n:
            raise RequestError(f"prompt length must be in [0, {n}], got {p}", path=path, rule="prompt_len_range")
        return None, p if placed is None else min(p, placed)
    arr = np.asarray(x)
    if arr.ndim != 1:
        raise InputTypeError(f"expected a 1-D bool array, got shape {arr.shape}", path=path, rule="ndim")
    if arr.shape[0] != n and arr.shape[0] != placed:
        raise RequestError(f"trainable has {arr.shape[0]} flags for {n} tokens", path=path, rule="length_mismatch")
    if arr.dtype != np.bool_:
        if arr.dtype.kind not in "iub" or (arr.size and (arr.min() < 0 or arr.max() > 1)):
            raise InputTypeError(f"expected bools or 0/1, got dtype {arr.dtype}", path=path, rule="dtype")
        arr = arr.astype(bool)
    if placed is not None:
        arr = arr[:placed]
    return np.ascontiguousarray(arr), -1


def normalize_trainable(
    trainable: Sequence[Any] | None,
    seq_lens: np.ndarray,
    orig_lens: np.ndarray | None = None,
    *,
    path: str = "$.trainable",
) -> Callable[[int], np.ndarray]:
    """Per-sequence trainable flags cut to the placed lengths (the trainer's view of a plan).

    Args:
        trainable: None (nothing trainable), or per sequence what :func:`as_trainable`
            takes (flags of the submitted or the placed length, or a prompt length).
        seq_lens: [S] placed lengths (``plan.seq_lens``).
        orig_lens: [S] submitted lengths (``plan.orig_lens``); default ``seq_lens``.
        path: the argument's path, for errors (``{path}[s]`` names one sequence).

    Returns:
        ``flags(s)`` -> [seq_lens[s]] bool.
    """
    orig = seq_lens if orig_lens is None else orig_lens
    S = int(seq_lens.shape[0])
    if trainable is None:
        return lambda s: np.zeros(int(seq_lens[s]), dtype=bool)
    if len(trainable) != S:
        raise RequestError(
            f"trainable has {len(trainable)} entries for the plan's {S} sequences", path=path, rule="length_mismatch"
        )

    def flags(s: int) -> np.ndarray:
        n = int(seq_lens[s])
        arr, p = as_trainable(trainable[s], int(orig[s]), f"{path}[{s}]", placed=n)
        return _prompt_mask(n, p) if arr is None else arr

    return flags


def _as_keys(x: Any, n: int, i: int) -> np.ndarray | None:
    if x is None:
        return None
    path = f"$.sequences[{i}].keys"
    arr = np.asarray(x)
    if arr.ndim != 1 or arr.shape[0] != n:
        raise RequestError(
            f"keys must be one uint64 per token ({n}), got shape {arr.shape}", path=path, rule="length_mismatch"
        )
    if arr.dtype.kind not in "iu":
        raise InputTypeError(f"expected integer keys, got dtype {arr.dtype}", path=path, rule="dtype")
    if arr.dtype.kind == "i" and arr.size and arr.min() < 0:
        raise RequestError("keys must be >= 0 (uint64)", path=path, rule="key_range")
    return np.ascontiguousarray(arr, dtype=np.uint64)


def group_codes(groups: Sequence[Any] | None, n: int) -> tuple[np.ndarray, tuple[Any, ...]]:
    """([n] int64 dense group codes in order of first appearance, the label of each code).

    A sequence without a group (None, or ``groups`` None) gets a code of its own. Labels
    are ints or strings within the wire's limits (256 characters, int64).
    """
    if groups is None:
        return np.arange(n, dtype=np.int64), (None,) * n
    if len(groups) != n:
        raise RequestError(
            f"groups has {len(groups)} entries for {n} sequences", path="$.groups", rule="length_mismatch"
        )
    codes = np.empty(n, dtype=np.int64)
    index: dict[Any, int] = {}
    labels: list[Any] = []
    for s, g in enumerate(groups):
        if g is None:
            codes[s] = len(labels)
            labels.append(None)
            continue
        if isinstance(g, (bool, np.bool_)) or not isinstance(g, (int, str, np.integer)):
            raise InputTypeError(
                f"group must be an int or a string, got {type(g).__name__}", path=f"$.groups[{s}]", rule="type"
            )
        key = int(g) if isinstance(g, np.integer) else g
        # The wire's limits, so the embedded planner and the sidecar accept the same batches.
        if isinstance(key, str) and len(key) > MAX_GROUP_LABEL:
            raise RequestError(
                f"group label has {len(key)} characters, at most {MAX_GROUP_LABEL}",
                path=f"$.groups[{s}]",
                rule="max_length",
            )
        if isinstance(key, int) and not -(2**63) <= key < 2**63:
            raise RequestError(f"group id {key} does not fit int64", path=f"$.groups[{s}]", rule="int64")
        c = index.get(key)
        if c is None:
            c = index[key] = len(labels)
            labels.append(key)
        codes[s] = c
    return codes, tuple(labels)


def normalize_batch(
    sequences: Sequence[Any],
    *,
    seq_len: int,
    trainable: Sequence[Any] | None = None,
    groups: Sequence[Any] | None = None,
    keys: Sequence[Any] | None = None,
    on_overflow: str = "error",
) -> SequenceBatch:
    """Validate a request's sequences and bring them into :class:`SequenceBatch` form.

    Args:
        sequences: S sequences of token ids (lists, numpy arrays, anything ``np.asarray``
            takes); ids must be integers in [0, 2**32).
        seq_len: row capacity C, already checked (``check_options``; a positive int).
        trainable: None (no token is a loss target: every sequence is fully shareable),
            or per sequence a bool array of its length or a prompt length p (tokens p.. are
            trainable).
        groups: None, or per sequence an int/str group id (or None: a group of its own).
        keys: None, or per sequence None or one uint64 per token that must also match for
            two sequences to share a token.
        on_overflow: already checked; what to do with a sequence longer than seq_len:
            ``error`` (raise :class:`CapacityError`), ``truncate`` (keep its first seq_len
            tokens) or ``drop``.

    Returns:
        The validated :class:`SequenceBatch`.

    Raises:
        RequestError: (or a subclass) naming the rule and the request path.
    """
    n = _check_counts(sequences, trainable, keys)
    per = [_normalize_one(sequences, trainable, keys, s, seq_len, on_overflow) for s in range(n)]
    lens = np.array([len(p.tokens) for p in per], dtype=np.int64)
    prompt = np.array([p.prompt for p in per], dtype=np.int64)
    train_tuple: tuple[np.ndarray, ...] | None = None
    prompt_lens: np.ndarray | None = prompt
    if trainable is not None and any(p.flags is not None for p in per):
        train_tuple = tuple(
            p.flags if p.flags is not None else _prompt_mask(int(lens[s]), p.prompt) for s, p in enumerate(per)
        )
        prompt_lens = None
    codes, labels = group_codes(groups, n)
    return SequenceBatch(
        tokens=tuple(p.tokens for p in per),
        lens=lens,
        orig_lens=np.array([p.orig for p in per], dtype=np.int64),
        kept=np.array([p.event is None or p.event.action != "drop" for p in per], dtype=bool),
        first_trainable=np.array([p.first for p in per], dtype=np.int64),
        trainable=train_tuple,
        prompt_lens=prompt_lens,
        group_codes=codes,
        group_labels=labels,
        keys=None if keys is None else tuple(p.keys for p in per),
        overflow=tuple(p.event for p in per if p.event is not None),
    )


def _check_counts(sequences: Any, trainable: Any, keys: Any) -> int:
    if isinstance(sequences, (str, bytes)) or not hasattr(sequences, "__len__"):
        raise InputTypeError("sequences must be a list of token arrays", path="$.sequences", rule="type")
    n = len(sequences)
    if n == 0:
        raise RequestError("the batch is empty: at least one sequence is needed", path="$.sequences", rule="non_empty")
    if trainable is not None and len(trainable) != n:
        raise RequestError(
            f"trainable has {len(trainable)} entries for {n} sequences", path="$.trainable", rule="length_mismatch"
        )
    if keys is not None and len(keys) != n:
        raise RequestError(f"keys has {len(keys)} entries for {n} sequences", path="$.keys", rule="length_mismatch")
    return n


@dataclass(frozen=True, slots=True)
class _One:
    """One normalized sequence: kept tokens, flags or prompt length, keys, overflow."""

    tokens: np.ndarray
    orig: int
    flags: np.ndarray | None
    prompt: int
    first: int
    keys: np.ndarray | None
    event: OverflowEvent | None


def _normalize_one(sequences: Any, trainable: Any, keys: Any, s: int, seq_len: int, on_overflow: str) -> _One:
    arr = _as_tokens(sequences[s], s)
    m = arr.shape[0]
    if m == 0:
        raise RequestError("sequence has no tokens", path=f"$.sequences[{s}]", rule="non_empty")
    tr, p = (None, m) if trainable is None else as_trainable(trainable[s], m, f"$.sequences[{s}].trainable")
    ky = None if keys is None else _as_keys(keys[s], m, s)
    event = None
    if m > seq_len:
        if on_overflow == "error":
            raise CapacityError(
                f"sequence {s} has {m} tokens, longer than seq_len {seq_len} "
                "(set on_overflow='truncate' or 'drop' to allow)",
                path=f"$.sequences[{s}]",
                rule="max_len",
            )
        event = OverflowEvent(index=s, length=m, action=on_overflow)
        keep = seq_len if on_overflow == "truncate" else 0
        arr, tr, ky, p = arr[:keep], None if tr is None else tr[:keep], None if ky is None else ky[:keep], min(p, keep)
    n = arr.shape[0]
    if tr is None:
        first = min(p, n)
    else:
        j = int(np.argmax(tr)) if n else 0
        first = j if n and tr[j] else n
    return _One(tokens=arr, orig=m, flags=tr, prompt=p, first=first, keys=ky, event=event)


def _prompt_mask(m: int, p: int) -> np.ndarray:
    out = np.zeros(m, dtype=bool)
    out[p:] = True
    return out
