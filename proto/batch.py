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

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from treepack.proto.batch_fields import as_keys, as_tokens, as_trainable, check_tags, group_codes, prompt_mask
from treepack.proto.errors import CapacityError, InputTypeError, RequestError
from treepack.proto.options import PlanOptions, as_options
from treepack.proto.plan import OverflowEvent

__all__ = ["PackInput", "SequenceBatch", "normalize_batch"]


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
        assert self.prompt_lens is not None  # one of trainable / prompt_lens is always set
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
        sequences: Sequence[Any] | PackInput,
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
        """The :class:`SequenceBatch`, with the checked ``seq_len`` and ``on_overflow``
        (the tags checked too: :func:`~treepack.proto.batch_fields.check_tags`)."""
        batch = normalize_batch(
            self.sequences,
            seq_len=seq_len,
            trainable=self.trainable,
            groups=self.groups,
            keys=self.keys,
            on_overflow=on_overflow,
        )
        check_tags(self.tags, batch.num_sequences)
        return batch


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
    per = _normalize_all(sequences, trainable, keys, n, seq_len, on_overflow)
    lens = np.array(per.lens, dtype=np.int64)
    prompt = np.array(per.prompt, dtype=np.int64)
    train_tuple: tuple[np.ndarray, ...] | None = None
    prompt_lens: np.ndarray | None = prompt
    if trainable is not None and any(f is not None for f in per.flags):
        train_tuple = tuple(
            f if f is not None else prompt_mask(per.lens[s], per.prompt[s]) for s, f in enumerate(per.flags)
        )
        prompt_lens = None
    codes, labels = group_codes(groups, n)
    return SequenceBatch(
        tokens=tuple(per.tokens),
        lens=lens,
        orig_lens=np.array(per.orig, dtype=np.int64),
        kept=np.array([e is None or e.action != "drop" for e in per.events], dtype=bool),
        first_trainable=np.array(per.first, dtype=np.int64),
        trainable=train_tuple,
        prompt_lens=prompt_lens,
        group_codes=codes,
        group_labels=labels,
        keys=None if keys is None else tuple(per.keys),
        overflow=tuple(e for e in per.events if e is not None),
    )


_U32 = np.dtype(np.uint32)


@dataclass(slots=True)
class _Columns:
    """The normalized sequences, one list per field (index s: sequence s)."""

    tokens: list[np.ndarray]
    orig: list[int]
    lens: list[int]
    flags: list[np.ndarray | None]
    prompt: list[int]
    first: list[int]
    keys: list[np.ndarray | None]
    events: list[OverflowEvent | None]


def _normalize_all(sequences: Any, trainable: Any, keys: Any, n: int, seq_len: int, on_overflow: str) -> _Columns:
    """Every sequence through :func:`_normalize_one`, except the common one, taken as it is.

    The common sequence (a C-contiguous uint32 array of 1..seq_len tokens, its trainable
    part None or a prompt length in range, no keys) is what :func:`_normalize_one` returns
    unchanged: it is checked here in a few attribute reads instead of the general checks,
    which cost a few microseconds a sequence (a batch of 100,000 short sequences spends
    most of its planning time there otherwise).
    """
    out = _Columns(
        tokens=[], orig=[], lens=[], flags=[None] * n, prompt=[], first=[], keys=[None] * n, events=[None] * n
    )
    tokens, orig, lens, prompt, first = out.tokens, out.orig, out.lens, out.prompt, out.first
    for s in range(n):
        x = sequences[s]
        t = None if trainable is None else trainable[s]
        if (
            type(x) is np.ndarray
            and x.dtype is _U32
            and x.ndim == 1
            and 0 < (m := x.shape[0]) <= seq_len
            and x.flags.c_contiguous
            and (t is None or (type(t) is int and 0 <= t <= m))
            and (keys is None or keys[s] is None)
        ):
            p = m if t is None else t
            tokens.append(x)
            orig.append(m)
            lens.append(m)
            prompt.append(p)
            first.append(p)
            continue
        one = _normalize_one(sequences, trainable, keys, s, seq_len, on_overflow)
        tokens.append(one.tokens)
        orig.append(one.orig)
        lens.append(int(one.tokens.shape[0]))
        prompt.append(one.prompt)
        first.append(one.first)
        out.flags[s], out.keys[s], out.events[s] = one.flags, one.keys, one.event
    return out


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
    arr = as_tokens(sequences[s], s)
    m = arr.shape[0]
    if m == 0:
        raise RequestError("sequence has no tokens", path=f"$.sequences[{s}]", rule="non_empty")
    tr, p = (None, m) if trainable is None else as_trainable(trainable[s], m, f"$.sequences[{s}].trainable")
    ky = None if keys is None else as_keys(keys[s], m, s)
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
