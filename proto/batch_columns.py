"""The client side of ``POST /v1/pack``: a batch as wire columns, and the msgpack body.

:func:`batch_columns` turns ``plan_batch``-style arguments into the columns of a
``PackRequest`` without concatenating anything: a column is a list of array parts whose
concatenation is the column, so :func:`msgpack_body` writes the body straight from the
caller's arrays (one copy of each token, into the body; msgpack's own ``Packer`` writes
the map header, the keys and the scalars).

**Validation** happens once, on the server, with the planner's own rules and messages.
The client checks only what has to hold before anything can be written: input already
in wire form (1-D C-contiguous ``uint32`` token arrays; prompt lengths in range or 1-D
bool flag arrays of the right lengths; ``uint64`` keys; int/str/None groups) is taken as
it is, and anything else goes through :func:`~.planner.normalize_batch`, which converts
it or raises the embedded planner's error (same exception, message, path and rule). What
the fast path lets through and the planner rejects (an empty sequence) comes back from
the server as that same error.

**Prefix references** (``prefix_src``/``prefix_len``): a sequence's common prefix with
its group's first sequence (the previous sequence without groups) is sent as a reference
when it is at least ``min_prefix`` tokens long. Members of a GRPO group share one prompt,
so the common prefix found for one member is tried first for the next one: one
``memcmp`` (``bytes.startswith``) and one token comparison confirm it exactly, and only a
miss costs a full vectorized comparison.
"""

from __future__ import annotations

import struct
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import msgpack
import numpy as np

from treepack.proto.batch import normalize_batch
from treepack.proto.options import MAX_SEQ_LEN

__all__ = [
    "Column",
    "BatchColumns",
    "BodyChunks",
    "batch_columns",
    "prefix_refs",
    "naive_prefix_refs",
    "msgpack_parts",
    "msgpack_body",
]

_U4, _U8, _I8, _BOOL = np.dtype("<u4"), np.dtype("<u8"), np.dtype("<i8"), np.dtype(np.bool_)
_INT64 = (-(2**63), 2**63 - 1)


@dataclass(frozen=True, slots=True)
class Column:
    """One buffer column: ``parts`` (C-contiguous, of ``dtype``) back to back."""

    dtype: str
    parts: list[np.ndarray]

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts)

    def concat(self) -> np.ndarray:
        """[n] the whole column (a copy unless it has one part)."""
        if len(self.parts) == 1:
            return self.parts[0]
        return np.concatenate(self.parts) if self.parts else np.zeros(0, self.dtype)


@dataclass(frozen=True, slots=True, kw_only=True)
class BatchColumns:
    """The batch fields of a ``PackRequest`` (:mod:`treepack.proto.pack_messages`).

    Attributes:
        tokens: ``<u4`` every sequence's tokens not covered by its prefix reference.
        offsets: [S+1] int64 cuts ``tokens`` into sequences.
        trainable: ``|u1`` flags of every token (prefixes included), or None.
        prompt_lens: [S] int64, or None (at most one of these two is set).
        keys: ``<u8`` keys of every token, or None.
        prefix_src, prefix_len: [S] int64 prefix references, or None when there are none.
        groups: [S] group ids as msgpack/JSON values, or None.
    """

    tokens: Column
    offsets: np.ndarray
    trainable: Column | None
    prompt_lens: np.ndarray | None
    keys: Column | None
    prefix_src: np.ndarray | None
    prefix_len: np.ndarray | None
    groups: list[Any] | None


def _wire_tokens(sequences: Sequence[Any]) -> list[np.ndarray] | None:
    """The sequences themselves when every one is a 1-D C-contiguous ``<u4`` array."""
    if not isinstance(sequences, (list, tuple)) or not sequences:
        return None
    for x in sequences:
        if type(x) is not np.ndarray or x.dtype != _U4 or x.ndim != 1 or not x.flags.c_contiguous:
            return None
    return list(sequences)


def _wire_trainable(
    trainable: Sequence[Any], lens: np.ndarray
) -> tuple[np.ndarray | None, list[np.ndarray] | None] | None:
    """(prompt lengths, None) or (None, flag parts) when already in wire form, else None."""
    if not isinstance(trainable, (list, tuple)) or len(trainable) != lens.shape[0]:
        return None
    if all(type(p) is int or isinstance(p, np.integer) for p in trainable):
        try:
            plen = np.array(trainable, dtype=np.int64)
        except OverflowError:
            return None
        return None if ((plen < 0) | (plen > lens)).any() else (plen, None)
    for f in trainable:
        if type(f) is not np.ndarray or f.dtype != _BOOL or f.ndim != 1 or not f.flags.c_contiguous:
            return None
    if any(f.shape[0] != m for f, m in zip(trainable, lens.tolist())):
        return None
    return None, [f.view(np.uint8) for f in trainable]


def _wire_keys(keys: Sequence[Any], lens: np.ndarray) -> list[np.ndarray] | None:
    """Key parts (zeros for a None entry) when every entry is None or 1-D ``<u8`` of its length."""
    if not isinstance(keys, (list, tuple)) or len(keys) != lens.shape[0]:
        return None
    parts = []
    for k, m in zip(keys, lens.tolist()):
        if k is None:
            parts.append(np.zeros(m, _U8))
        elif type(k) is np.ndarray and k.dtype == _U8 and k.shape == (m,) and k.flags.c_contiguous:
            parts.append(k)
        else:
            return None
    return parts


def _wire_groups(groups: Sequence[Any], n: int) -> list[Any] | None:
    """Group ids as plain ints/strings/None, or None when one is of another type."""
    if not isinstance(groups, (list, tuple)) or len(groups) != n:
        return None
    out = []
    for g in groups:
        if type(g) is int:
            if not _INT64[0] <= g <= _INT64[1]:
                return None
        elif isinstance(g, np.integer):
            g = int(g)
        elif g is not None and type(g) is not str:
            return None
        out.append(g)
    return out


def _lcp(a: np.ndarray, b: np.ndarray, m: int) -> int:
    """Length of the common prefix of a[:m] and b[:m] (m >= 1).

    Compared in windows that double (4096 tokens first): a prompt's end is found without
    comparing the completions behind it.
    """
    lo, w = 0, 4096
    while lo < m:
        hi = min(lo + w, m)
        ne = a[lo:hi] != b[lo:hi]
        k = int(ne.argmax())
        if ne[k]:
            return lo + k
        lo, w = hi, 2 * w
    return m


def prefix_refs(
    tokens: Sequence[np.ndarray], groups: Sequence[Any] | None, min_prefix: int
) -> tuple[np.ndarray, np.ndarray] | None:
    """Prefix references (module docstring).

    Args:
        tokens: per sequence a 1-D C-contiguous uint32 array.
        groups: per sequence a hashable group id or None (no reference), or None (each
            sequence against the previous one).
        min_prefix: shorter common prefixes are not worth a reference.

    Returns:
        (prefix_src [S] int64, -1 for none; prefix_len [S] int64), or None when no
        sequence gets a reference.
    """
    n = len(tokens)
    src = [-1] * n
    plen = [0] * n
    lens = [t.shape[0] for t in tokens]
    first: dict[Any, int] = {}
    guess: dict[int, int] = {}  # source -> the last common prefix found against it
    head: dict[int, tuple[bytes, memoryview, int]] = {}  # source -> (its first n tokens as bytes for memcmp, a view, n)
    floor = max(min_prefix, 1)
    found = False
    for i in range(n):
        if groups is None:
            j = i - 1
        else:
            g = groups[i]
            j = -1 if g is None else first.setdefault(g, i)
        if j < 0 or j == i:
            continue
        m = min(lens[i], lens[j])
        if m < floor:
            continue
        k = guess.get(j, 0)
        if floor <= k <= m:
            hb = head.get(j)
            if hb is None or hb[2] < k:
                # Only the guessed prefix as bytes: completions are never copied.
                hb = head[j] = (tokens[j][:k].tobytes(), tokens[j].data, k)
            va = tokens[i].data
            if not (hb[0].startswith(va[:k]) and (k == m or va[k] != hb[1][k])):
                k = guess[j] = _lcp(tokens[i], tokens[j], m)
        else:
            k = guess[j] = _lcp(tokens[i], tokens[j], m)
        if k >= floor:
            src[i], plen[i], found = j, k, True
    return (np.array(src, dtype=np.int64), np.array(plen, dtype=np.int64)) if found else None


def naive_prefix_refs(
    tokens: Sequence[np.ndarray], groups: Sequence[Any] | None, min_prefix: int
) -> tuple[np.ndarray, np.ndarray] | None:
    """:func:`prefix_refs` token by token (the reference the tests hold it to)."""
    n = len(tokens)
    src, plen = np.full(n, -1, np.int64), np.zeros(n, np.int64)
    first: dict[Any, int] = {}
    for i in range(n):
        j = i - 1 if groups is None else (-1 if groups[i] is None else first.setdefault(groups[i], i))
        if j < 0 or j == i:
            continue
        k = 0
        while k < len(tokens[i]) and k < len(tokens[j]) and tokens[i][k] == tokens[j][k]:
            k += 1
        if k >= max(min_prefix, 1):
            src[i], plen[i] = j, k
    return (src, plen) if (src >= 0).any() else None


def batch_columns(
    sequences: Sequence[Any],
    *,
    trainable: Sequence[Any] | None = None,
    groups: Sequence[Any] | None = None,
    keys: Sequence[Any] | None = None,
    dedup: bool = True,
    min_prefix: int = 64,
) -> BatchColumns:
    """The request columns of a batch (arguments as for ``plan_batch``).

    Args:
        dedup: send prefixes shared with the group's first sequence as references.
        min_prefix: the shortest prefix worth a reference.

    Returns:
        The :class:`BatchColumns`; token parts are views of the caller's arrays where
        they are already ``<u4``.

    Raises:
        RequestError: (or a subclass) the embedded planner's error for input that cannot
            be written as its column.
    """
    toks = _wire_tokens(sequences)
    lens: np.ndarray | None = None
    train: tuple[np.ndarray | None, list[np.ndarray] | None] | None = None
    key_parts: list[np.ndarray] | None = None
    grp: list[Any] | None = None
    if toks is not None:
        lens = np.fromiter((t.shape[0] for t in toks), np.int64, len(toks))
        train = None if trainable is None else _wire_trainable(trainable, lens)
        key_parts = None if keys is None else _wire_keys(keys, lens)
        grp = None if groups is None else _wire_groups(groups, len(toks))
    slow = toks is None or (trainable is not None and train is None) or (keys is not None and key_parts is None)
    if slow or (groups is not None and grp is None):
        # Capacity is the server's check (it applies on_overflow): no seq_len limit here.
        batch = normalize_batch(
            sequences, seq_len=MAX_SEQ_LEN, trainable=trainable, groups=groups, keys=keys, on_overflow="error"
        )
        toks = [t if t.dtype == _U4 else t.astype(_U4) for t in batch.tokens]
        lens = batch.lens
        if trainable is not None:
            train = (
                (batch.prompt_lens, None)
                if batch.trainable is None
                else (None, [f.view(np.uint8) for f in batch.trainable])
            )
        if batch.keys is not None:
            key_parts = [
                np.zeros(int(m), _U8) if k is None else k.astype(_U8, copy=False)
                for k, m in zip(batch.keys, lens.tolist())
            ]
        if groups is not None:
            grp = [int(g) if isinstance(g, np.integer) else g for g in groups]
    assert toks is not None and lens is not None  # the fast path or normalize_batch set both
    refs = prefix_refs(toks, grp, min_prefix) if dedup else None
    own = toks if refs is None else [t[k:] if k else t for t, k in zip(toks, refs[1].tolist())]
    off = np.zeros(len(own) + 1, dtype=np.int64)
    np.cumsum(lens if refs is None else lens - refs[1], out=off[1:])
    return BatchColumns(
        tokens=Column("<u4", own),
        offsets=off,
        trainable=None if train is None or train[1] is None else Column("|u1", train[1]),
        prompt_lens=None if train is None else train[0],
        keys=None if key_parts is None else Column("<u8", key_parts),
        prefix_src=None if refs is None else refs[0],
        prefix_len=None if refs is None else refs[1],
        groups=grp,
    )


def _bin_header(n: int) -> bytes:
    """The msgpack ``bin`` header of n bytes (the smallest of bin 8/16/32, as msgpack writes it;
    ``msgpack.Packer`` has no public call for it)."""
    if n < 1 << 8:
        return struct.pack(">BB", 0xC4, n)
    if n < 1 << 16:
        return struct.pack(">BH", 0xC5, n)
    if n < 1 << 32:
        return struct.pack(">BI", 0xC6, n)
    raise ValueError(f"a msgpack bin holds at most 2**32 - 1 bytes, got {n}")


def msgpack_parts(fields: dict[str, Any]) -> list[Any]:
    """A msgpack map as buffers whose concatenation is the encoded map, written straight
    from its values: a :class:`Column` or an ndarray becomes a ``bin`` of its bytes (the
    arrays themselves, not copies), anything else goes to ``msgpack.Packer``.

    The concatenation is bytes-for-bytes what ``msgpack.packb`` gives for the same map with
    each column concatenated into one buffer.
    """
    pk = msgpack.Packer(use_bin_type=True)
    out: list[Any] = [pk.pack_map_header(len(fields))]
    for key, value in fields.items():
        out.append(pk.pack(key))
        if isinstance(value, np.ndarray):
            value = Column(value.dtype.str, [value])
        if isinstance(value, Column):
            out.append(_bin_header(value.nbytes))
            out.extend(p for p in value.parts if p.nbytes)
        else:
            out.append(pk.pack(value))
    return out


def msgpack_body(fields: dict[str, Any]) -> bytes:
    """:func:`msgpack_parts` joined: every part is copied once, into the body."""
    return b"".join(msgpack_parts(fields))


class BodyChunks:
    """A body as chunks of at most ``chunk`` bytes, joined from its parts each time it is
    iterated (an HTTP client can send it again on a retry).

    One large body is a fresh allocation whose pages the kernel faults in one by one on
    first touch (about 0.5 ms per MB on the 2-core benchmark VM); chunks of a fixed size
    reuse the same freed memory, chunk after chunk.

    Args:
        parts: buffers (bytes, C-contiguous arrays) whose concatenation is the body.
        chunk: bytes per chunk.
    """

    def __init__(self, parts: list[Any], chunk: int = 1 << 20) -> None:
        self.parts = [memoryview(p).cast("B") for p in parts]
        self.nbytes = sum(p.nbytes for p in self.parts)
        self.chunk = chunk

    def __iter__(self) -> Iterator[bytes]:
        pending: list[memoryview] = []
        room = self.chunk
        for mv in self.parts:
            while mv.nbytes:
                take = mv[:room]
                pending.append(take)
                room -= take.nbytes
                mv = mv[take.nbytes :]
                if not room:
                    yield b"".join(pending)
                    pending, room = [], self.chunk
        if pending:
            yield b"".join(pending)
