"""Reading the shape history: the summary of the retained batches and their stored shapes.

The queries run on the connection the caller
(:class:`~treepack.proto.history.HistoryStore`) holds under its lock; what needs no
database (adding up tags, decoding a shape blob) runs after, outside it. A row whose tags
or shape do not decode is skipped here, never blamed on a request.
"""

from __future__ import annotations

import json
import logging
import sqlite3
from collections.abc import Callable, Collection
from typing import Any

import msgpack

from treepack.proto.codec import parse_message
from treepack.proto.errors import TreepackError
from treepack.proto.history_schema import one_line
from treepack.proto.shape import BatchShape
from treepack.proto.shape_wire import shape_from_wire
from treepack.proto.whatif_messages import BatchShapeMessage

__all__ = ["empty_summary", "summary_rows", "summarize", "shape_rows", "decode_row"]

log = logging.getLogger("treepack.history")

# Ids per query when reading shapes: SQLite's bound-parameter limit is 999 in old builds.
_IDS_PER_QUERY = 500


def empty_summary() -> dict[str, Any]:
    """The summary of a disabled history."""
    return dict(
        batches=0,
        skipped=0,
        sequences=0,
        groups=0,
        tokens=0,
        oldest=None,
        newest=None,
        seq_lens=[],
        tags={},
        mean_rows=None,
        mean_saved_fraction=None,
    )


def summary_rows(c: sqlite3.Connection) -> list[tuple[Any, ...]]:
    """Every row's summary columns: (id, sequences, groups, tokens, created, rows,
    saved_fraction, seq_len, tags), what :func:`summarize` reads."""
    return c.execute(
        "SELECT id, sequences, groups, tokens, created, rows, saved_fraction, seq_len, tags FROM batches"
    ).fetchall()


def summarize(rows: list[tuple[Any, ...]], skip: Collection[int] = ()) -> dict[str, Any]:
    """Counts, time span, seq_lens, groups per tag and means of the usable rows.

    Args:
        rows: from :func:`summary_rows`.
        skip: ids of rows that cannot be used (their shape fails its checksum or does not
            decode): counted as ``skipped``, left out of every other figure.
    """
    usable = [r for r in rows if r[0] not in skip]
    tags: dict[str, int] = {}
    for *_, t in usable:
        try:
            per_tag = json.loads(t)
            for k, v in per_tag.items():
                tags[k] = tags.get(k, 0) + int(v)
        except (TypeError, ValueError, AttributeError):
            continue  # an undecodable row's tags: counted by shapes(), skipped here
    n = len(usable)
    return dict(
        batches=n,
        skipped=len(rows) - n,
        sequences=sum(int(r[1]) for r in usable),
        groups=sum(int(r[2]) for r in usable),
        tokens=sum(int(r[3]) for r in usable),
        oldest=min((r[4] for r in usable), default=None),
        newest=max((r[4] for r in usable), default=None),
        seq_lens=sorted({int(r[7]) for r in usable}),
        tags=dict(sorted(tags.items())),
        mean_rows=sum(float(r[5]) for r in usable) / n if n else None,
        mean_saved_fraction=sum(float(r[6]) for r in usable) / n if n else None,
    )


def shape_rows(
    c: sqlite3.Connection, limit: int | None, known: Callable[[int], bool], seq_len: int | None = None
) -> tuple[list[int], list[Any]]:
    """The ids of the most recent ``limit`` batches (all if None) recorded at ``seq_len``
    (any if None), newest first, and the (id, shape blob, checksum) rows of those not
    ``known`` yet."""
    n = -1 if limit is None else int(limit)
    if seq_len is None:
        found = c.execute("SELECT id FROM batches ORDER BY id DESC LIMIT ?", (n,))
    else:
        found = c.execute("SELECT id FROM batches WHERE seq_len = ? ORDER BY id DESC LIMIT ?", (int(seq_len), n))
    ids = [r[0] for r in found]
    missing = [i for i in ids if not known(i)]
    rows = []
    for k in range(0, len(missing), _IDS_PER_QUERY):
        part = missing[k : k + _IDS_PER_QUERY]
        rows += c.execute(
            f"SELECT id, shape, checksum FROM batches WHERE id IN ({','.join('?' * len(part))})", part
        ).fetchall()
    return ids, rows


def decode_row(bid: int, blob: Any) -> BatchShape | None:
    """A stored shape, or None (logged) when the row does not decode or is inconsistent."""
    try:
        return shape_from_wire(parse_message(BatchShapeMessage, msgpack.unpackb(blob, raw=False)), f"history[{bid}]")
    except (TreepackError, ValueError, TypeError, msgpack.UnpackException) as exc:
        log.warning("history row %d does not decode (%s)", bid, one_line(exc))
        return None
