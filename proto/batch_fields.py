"""The checks of a pack request's fields, one sequence at a time: tokens, trainable flags, keys, group ids.

Each function takes what a caller gave for one field (lists, numpy arrays, anything
``np.asarray`` takes) and returns the planner's form, or raises the error that names the
value, the rule and the request path. :func:`~treepack.proto.batch.normalize_batch` runs
them over a batch; the trainer reads a plan's flags back through
:func:`normalize_trainable`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from treepack.proto.errors import InputTypeError, RequestError

__all__ = [
    "MAX_GROUP_LABEL",
    "as_tokens",
    "as_trainable",
    "normalize_trainable",
    "as_keys",
    "group_codes",
    "check_tags",
    "prompt_mask",
]

MAX_GROUP_LABEL = 256  # characters, as on the wire
_UINT32_MAX = np.iinfo(np.uint32).max
_SAFE_UNSIGNED = (np.dtype(np.uint8), np.dtype(np.uint16), np.dtype(np.uint32))


def as_tokens(x: Any, i: int) -> np.ndarray:
    """Sequence ``i``'s token ids as a C-contiguous uint32 array (no copy when already uint8/16/32).

    Raises:
        InputTypeError: not a 1-D integer array (rules ``ndim``, ``dtype``).
        RequestError: an id outside [0, 2**32) (rule ``token_range``).
    """
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
        return prompt_mask(n, p) if arr is None else arr

    return flags


def as_keys(x: Any, n: int, i: int) -> np.ndarray | None:
    """Sequence ``i``'s keys (one uint64 per token of its ``n``), or None for all-zero keys.

    Raises:
        InputTypeError: non-integer keys (rule ``dtype``).
        RequestError: another length, or a negative key (rules ``length_mismatch``, ``key_range``).
    """
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
    fast = _int_group_codes(groups)
    if fast is not None:
        return fast
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
            if isinstance(key, str):
                _check_text(key, f"$.groups[{s}]", "group label")
            c = index[key] = len(labels)
            labels.append(key)
        codes[s] = c
    return codes, tuple(labels)


def _int_group_codes(groups: Sequence[Any]) -> tuple[np.ndarray, tuple[Any, ...]] | None:
    """:func:`group_codes` of a batch whose ids are all Python ints within int64, in a few
    numpy passes (the loop costs about a microsecond a sequence); None for any other batch."""
    if not all(type(g) is int for g in groups):  # bools, None, strings, numpy ints: the loop
        return None
    arr = np.array(groups)
    if arr.dtype != np.int64:  # an id beyond int64 (uint64 or object): the loop names it
        return None
    labels, first, inverse = np.unique(arr, return_index=True, return_inverse=True)
    order = np.argsort(first, kind="stable")  # codes in order of first appearance
    code_of = np.empty(order.shape[0], dtype=np.int64)
    code_of[order] = np.arange(order.shape[0])
    return code_of[inverse.reshape(-1)], tuple(labels[order].tolist())


def _check_text(text: str, path: str, what: str) -> None:
    """Refuse a label that is not valid Unicode text (a lone surrogate, as JSON's ``"\\udfff"``
    decodes): the history stores labels as UTF-8, and such a label would be acknowledged,
    then fail to be written."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise RequestError(
            f"{what} is not valid Unicode text: character {exc.start} is a lone surrogate "
            f"(U+{ord(text[exc.start]):04X})",
            path=path,
            rule="unicode",
        ) from None


def check_tags(tags: Sequence[Any] | None, n: int) -> None:
    """Check a batch's task tags: None, or per sequence a string (at most
    :data:`MAX_GROUP_LABEL` characters, valid Unicode) or None.

    Raises:
        RequestError: a length mismatch, a tag too long or not valid Unicode (``$.tags[i]``).
        InputTypeError: a tag of another type.
    """
    if tags is None:
        return
    if isinstance(tags, (str, bytes)) or len(tags) != n:
        got = "a string" if isinstance(tags, (str, bytes)) else f"{len(tags)} entries"
        raise RequestError(f"tags has {got} for {n} sequences", path="$.tags", rule="length_mismatch")
    seen: set[str] = set()
    for s, t in enumerate(tags):
        if t is None or t in seen:
            continue
        if not isinstance(t, str):
            raise InputTypeError(
                f"tag must be a string or None, got {type(t).__name__}", path=f"$.tags[{s}]", rule="type"
            )
        if len(t) > MAX_GROUP_LABEL:
            raise RequestError(
                f"tag has {len(t)} characters, at most {MAX_GROUP_LABEL}", path=f"$.tags[{s}]", rule="max_length"
            )
        _check_text(t, f"$.tags[{s}]", "tag")
        seen.add(t)


def prompt_mask(m: int, p: int) -> np.ndarray:
    """[m] bool flags of a sequence trainable from ``p`` on."""
    out = np.zeros(m, dtype=bool)
    out[p:] = True
    return out
