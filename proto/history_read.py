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
from collections.abc import Callable
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


def summary_rows(c: sqlite3.Connection) -> tuple[Any, ...]:
    """(totals and means, distinct seq_lens, every row's tags column): what :func:`summarize` reads."""
    head = c.execute(
        "SELECT COUNT(*), COALESCE(SUM(sequences),0), COALESCE(SUM(groups),0), COALESCE(SUM(tokens),0),"
        " MIN(created), MAX(created), AVG(rows), AVG(saved_fraction) FROM batches"
    ).fetchone()
    seq_lens = [int(r[0]) for r in c.execute("SELECT DISTINCT seq_len FROM batches ORDER BY seq_len")]
    return head, seq_lens, c.execute("SELECT tags FROM batches").fetchall()


def summarize(rows: tuple[Any, ...]) -> dict[str, Any]:
    """Counts, time span, seq_lens, groups per tag and means, from :func:`summary_rows`."""
    (n, seqs, groups, toks, oldest, newest, mean_rows, mean_saved), seq_lens, tag_rows = rows
    tags: dict[str, int] = {}
    for (t,) in tag_rows:
        try:
            per_tag = json.loads(t)
            for k, v in per_tag.items():
                tags[k] = tags.get(k, 0) + int(v)
        except (TypeError, ValueError, AttributeError):
            continue  # an undecodable row's tags: counted by shapes(), skipped here
    return dict(
        batches=int(n),
        sequences=int(seqs),
        groups=int(groups),
        tokens=int(toks),
        oldest=oldest,
        newest=newest,
        seq_lens=seq_lens,
        tags=dict(sorted(tags.items())),
        mean_rows=None if mean_rows is None else float(mean_rows),
        mean_saved_fraction=None if mean_saved is None else float(mean_saved),
    )


def shape_rows(c: sqlite3.Connection, limit: int | None, known: Callable[[int], bool]) -> tuple[list[int], list[Any]]:
    """The ids of the most recent ``limit`` batches (all if None), newest first, and the
    (id, shape blob, checksum) rows of those not ``known`` yet."""
    ids = [
        r[0]
        for r in c.execute("SELECT id FROM batches ORDER BY id DESC LIMIT ?", (-1 if limit is None else int(limit),))
    ]
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
