"""The what-if sampling pool: the groups of recorded batch shapes, indexed by tag, and what a what-if may cost.

:func:`build_pool` indexes the groups of a list of shapes in one pass (each group's
sequences, its tag, the groups of each tag): one dict lookup per sequence, then sorts by
group and by tag: a pool of many distinct tags costs what a pool of one does.
:func:`naive_build_pool` is its loop reference (a scan of every group per tag).
:func:`whatif_work` prices a what-if before any trial runs (the tokens its trials may
plan); :func:`pool_summary` is the pool as the answer reports it.

Pool rules (shared by the sidecar and the embedded client):

- The unit is a group of one recorded batch (a sequence without a group is a group of
  its own); a group's task tag is its first sequence's tag (``""`` when untagged).
- Groups of different recorded batches stay different groups, even with equal labels.
- ``tags`` (a what-if's ``history_tags``) keeps only the groups of those tags.

What a what-if samples from the history by default (:func:`history_scope`): the batches
recorded at its own ``seq_len`` (``history_seq_len="any"``: every batch), and the groups of
``history_tags`` when given. Inline shapes are sampled as given.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from treepack.proto.errors import InputTypeError, RequestError
from treepack.proto.options import MAX_SEQ_LEN, cp_shard_len
from treepack.proto.shape import BatchShape

__all__ = [
    "GroupPool",
    "build_pool",
    "naive_build_pool",
    "history_scope",
    "no_batches_error",
    "whatif_work",
    "pool_summary",
]


@dataclass(frozen=True, slots=True, kw_only=True)
class GroupPool:
    """The groups of a list of shapes, ready for sampling.

    Attributes (U groups, N sequences in all):
        shapes: the recorded batches.
        seq_base: [B+1] int64 global index of each batch's first sequence.
        unit_ptr: [U+1] int64 CSR into ``unit_seqs``.
        unit_seqs: [n] int64 global sequence indices of each group, ascending (n <= N:
            the sequences of the groups kept).
        unit_tag: [U] tag of each group (``""`` when untagged).
        by_tag: tag -> [k] int64 group ids carrying it, ascending; tags sorted.
        lens: [N] int64 length of every sequence.
    """

    shapes: tuple[BatchShape, ...]
    seq_base: np.ndarray
    unit_ptr: np.ndarray
    unit_seqs: np.ndarray
    unit_tag: tuple[str, ...]
    by_tag: dict[str, np.ndarray]
    lens: np.ndarray

    @property
    def num_groups(self) -> int:
        return len(self.unit_tag)

    @property
    def num_sequences(self) -> int:
        """Sequences of the groups in the pool."""
        return int(self.unit_ptr[-1])

    @property
    def num_tokens(self) -> int:
        """Tokens of the groups in the pool."""
        return int(self.lens[self.unit_seqs].sum())

    def group_tokens(self) -> np.ndarray:
        """[U] int64 tokens of each group."""
        if not self.num_groups:
            return np.zeros(0, dtype=np.int64)
        return np.add.reduceat(self.lens[self.unit_seqs], self.unit_ptr[:-1]).astype(np.int64)


def _naive_groups_of(shapes: Sequence[BatchShape]) -> tuple[list[list[int]], list[str]]:
    """Every group's global sequence indices and tag, in recorded order, one sequence at a time."""
    unit_seqs: list[list[int]] = []
    tags: list[str] = []
    base = 0
    for sh in shapes:
        index: dict[Any, int] = {}
        for s, g in enumerate(sh.groups):
            u = index.get(g) if g is not None else None
            if u is None:
                u = len(unit_seqs)
                unit_seqs.append([])
                tags.append((sh.tags[s] if sh.tags is not None else None) or "")
                if g is not None:
                    index[g] = u
            unit_seqs[u].append(base + s)
        base += sh.num_sequences
    return unit_seqs, tags


_NONE = object()  # with the sequence index, the key of a sequence without a group (a group of its own)


def _units(shapes: Sequence[BatchShape], check: Callable[[], None] | None) -> tuple[np.ndarray, list[str]]:
    """([N] int64 group of every sequence, groups numbered in recorded order; [U] tag of each group).

    A dict of the labels in first-appearance order numbers the groups, one lookup per
    sequence (in C: ``map``), the rest numpy.
    """
    parts: list[np.ndarray] = []
    tags: list[str] = []
    base = 0
    for sh in shapes:
        if check is not None:
            check()
        n = sh.num_sequences
        keys: Sequence[Any] = sh.groups
        if None in keys:
            keys = [(_NONE, s) if g is None else g for s, g in enumerate(keys)]
        index = {k: i for i, k in enumerate(dict.fromkeys(keys))}  # first appearance numbers a group
        code = np.fromiter(map(index.__getitem__, keys), dtype=np.int64, count=n)
        first = np.empty(len(index), dtype=np.int64)
        first[code[::-1]] = np.arange(n - 1, -1, -1)  # each group's first sequence
        tags += [""] * len(index) if sh.tags is None else [sh.tags[i] or "" for i in first.tolist()]
        parts.append(code + base)
        base += len(index)
    return (np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)), tags


def _pool(
    shapes: Sequence[BatchShape], ptr: np.ndarray, flat: np.ndarray, tags: list[str], by_tag: dict[str, np.ndarray]
) -> GroupPool:
    seq_base = np.zeros(len(shapes) + 1, dtype=np.int64)
    np.cumsum([sh.num_sequences for sh in shapes], out=seq_base[1:])
    lens = np.concatenate([sh.lens for sh in shapes]) if shapes else np.zeros(0, dtype=np.int64)
    return GroupPool(
        shapes=tuple(shapes),
        seq_base=seq_base,
        unit_ptr=ptr,
        unit_seqs=flat,
        unit_tag=tuple(tags),
        by_tag=by_tag,
        lens=lens,
    )


def build_pool(
    shapes: Sequence[BatchShape], *, tags: Collection[str] | None = None, check: Callable[[], None] | None = None
) -> GroupPool:
    """Index the groups of ``shapes`` (in recorded order) for sampling (module docstring).

    Args:
        shapes: the recorded batches.
        tags: keep only the groups of these tags (``""``: untagged); None keeps every group.
        check: called once per batch; it raises to stop the work (the sidecar's deadline
            and disconnects), or None.
    """
    unit_of, unit_tag = _units(shapes, check)
    seqs = np.arange(unit_of.shape[0], dtype=np.int64)
    if tags is not None:
        keep = set(tags)
        kept = np.array([t in keep for t in unit_tag], dtype=bool)
        renumber = np.cumsum(kept) - 1
        mine = kept[unit_of]
        seqs, unit_of = seqs[mine], renumber[unit_of[mine]]
        unit_tag = [t for t, k in zip(unit_tag, kept.tolist()) if k]
    # A group's sequences ascending, groups in order: one stable sort by group.
    flat = seqs[np.argsort(unit_of, kind="stable")]
    ptr = np.zeros(len(unit_tag) + 1, dtype=np.int64)
    np.cumsum(np.bincount(unit_of, minlength=len(unit_tag)), out=ptr[1:])
    # Group by tag in one sort: tag codes in sorted tag order, group ids ascending inside.
    names = sorted(set(unit_tag))
    tag_code = {t: i for i, t in enumerate(names)}
    code = np.fromiter(map(tag_code.__getitem__, unit_tag), dtype=np.int64, count=len(unit_tag))
    order = np.argsort(code, kind="stable")
    ends = np.cumsum(np.bincount(code, minlength=len(names)))
    by_tag = {t: order[e - n : e] for t, e, n in zip(names, ends.tolist(), np.diff(ends, prepend=0).tolist())}
    return _pool(shapes, ptr, flat, unit_tag, by_tag)


def naive_build_pool(shapes: Sequence[BatchShape], *, tags: Collection[str] | None = None) -> GroupPool:
    """:func:`build_pool`, one sequence at a time and every group scanned once per tag (the reference)."""
    unit_seqs, unit_tag = _naive_groups_of(shapes)
    if tags is not None:
        kept = [u for u in range(len(unit_tag)) if unit_tag[u] in tags]
        unit_seqs, unit_tag = [unit_seqs[u] for u in kept], [unit_tag[u] for u in kept]
    by_tag = {t: np.array([u for u, x in enumerate(unit_tag) if x == t], dtype=np.int64) for t in sorted(set(unit_tag))}
    ptr = np.zeros(len(unit_seqs) + 1, dtype=np.int64)
    np.cumsum([len(u) for u in unit_seqs], out=ptr[1:])
    flat = np.array([s for u in unit_seqs for s in u], dtype=np.int64)
    return _pool(shapes, ptr, flat, unit_tag, by_tag)


def history_scope(
    seq_len: int, history_seq_len: Any = None, history_tags: Any = None
) -> tuple[int | None, tuple[str, ...] | None]:
    """Which recorded batches and groups a what-if samples (module docstring).

    Args:
        seq_len: the what-if's (checked) ``seq_len``.
        history_seq_len: None (the what-if's ``seq_len``), an int in [1, MAX_SEQ_LEN], or ``"any"``.
        history_tags: None, or a list of tags (strings).

    Returns:
        (the ``seq_len`` recorded batches must have, None for any; the tags, None for any).

    Raises:
        InputTypeError: a value of another type or range (path ``$.history_seq_len`` /
            ``$.history_tags``).
    """
    if history_seq_len is None:
        scope: int | None = int(seq_len)
    elif history_seq_len == "any":
        scope = None
    elif isinstance(history_seq_len, int) and not isinstance(history_seq_len, bool):
        if not 1 <= history_seq_len <= MAX_SEQ_LEN:
            raise InputTypeError(
                f"history_seq_len must be in [1, {MAX_SEQ_LEN}] or 'any', got {history_seq_len}",
                path="$.history_seq_len",
                rule="range",
            )
        scope = history_seq_len
    else:
        raise InputTypeError(
            f"history_seq_len must be an int or 'any', got {history_seq_len!r}", path="$.history_seq_len", rule="type"
        )
    if history_tags is None:
        return scope, None
    if isinstance(history_tags, (str, bytes)) or not all(isinstance(t, str) for t in history_tags):
        raise InputTypeError("history_tags must be a list of strings", path="$.history_tags", rule="type")
    return scope, tuple(history_tags)


def no_batches_error(scope: int | None, recorded: Sequence[int], tags: Sequence[str] | None) -> RequestError:
    """The error of a what-if whose history scope holds no group (422, rule ``no_history``).

    Args:
        scope: the ``seq_len`` sampled (None: any).
        recorded: the distinct ``seq_len`` s the history holds.
        tags: the ``history_tags`` asked, or None.
    """
    if not recorded:
        return RequestError(
            "there are no recorded batches to sample from: pack with record=true first, or send shapes",
            path="$.shapes",
            rule="no_history",
        )
    where = "" if scope is None else f" at seq_len {scope}"
    which = "" if tags is None else f" of tags {list(tags)[:8]}"
    held = ", ".join(str(x) for x in list(recorded)[:16]) + (", ..." if len(recorded) > 16 else "")
    return RequestError(
        f"no recorded groups{which}{where} to sample (the history holds seq_len {held}); "
        "set history_seq_len to one of those or 'any', or send shapes",
        path="$.history_seq_len" if tags is None else "$.history_tags",
        rule="no_history",
    )


def whatif_work(
    pool: GroupPool,
    compositions: Sequence[Any],
    trials: int,
    *,
    seq_len: int = 0,
    cp_size: int = 1,
    cp_attention: str = "auto",
) -> int:
    """Positions a what-if may plan: per composition, trials x the most tokens one draw can
    hold, plus, under an all-gather CP split, one padded row per trial (the split works on
    every position of a row, padding included: a trial holds at least one row).

    Exact Python ints (a composition drawing the k largest groups is the bound). Time:
    one sort of the group sizes, and per ``by_tag`` key a sort of that tag's groups.

    Args:
        pool: the sampling pool.
        compositions: the :class:`~treepack.proto.whatif.Composition` s.
        trials: trials per composition.
        seq_len, cp_size, cp_attention: the trials' options.
    """
    sizes = pool.group_tokens()
    largest = np.cumsum(np.sort(sizes)[::-1])
    cp_row = cp_size * cp_shard_len(seq_len, cp_size) if cp_size > 1 and cp_attention == "allgather" else 0
    total = 0
    for comp in compositions:
        if comp.groups is not None:
            k = min(int(comp.groups), largest.shape[0])
            top = int(largest[k - 1]) if k else 0
        else:
            top = 0
            for tag, k in (comp.by_tag or {}).items():
                ids = pool.by_tag.get(tag)
                if k and ids is not None:
                    top += int(np.sort(sizes[ids])[::-1][: int(k)].sum())
        total += trials * (top + cp_row)
    return total


def pool_summary(pool: GroupPool, max_tags: int | None = None) -> dict[str, Any]:
    """What a what-if sampled from: batches, groups, sequences, tokens, groups per tag.

    Args:
        pool: the pool.
        max_tags: list at most this many tags (the most groups first, then by name); the
            count of the others is ``tags_omitted``. None: all.
    """
    counts = sorted(((t, int(u.shape[0])) for t, u in pool.by_tag.items()), key=lambda x: (-x[1], x[0]))
    listed = counts if max_tags is None else counts[:max_tags]
    return {
        "batches": len(pool.shapes),
        "groups": pool.num_groups,
        "sequences": pool.num_sequences,
        "tokens": pool.num_tokens,
        "tags": dict(sorted(listed)),
        "tags_omitted": len(counts) - len(listed),
    }
