"""Writing the shape history: one batch's row, its insert and the retention applied with it.

A row is the batch's summary columns plus its shape as a msgpack blob and the blob's
checksum (:mod:`~treepack.proto.history_schema`). RetentionLimits runs inside the inserting
transaction: at most ``max_batches`` rows, at most ``max_bytes`` of shape blobs (the
newest batch always stays) and none older than ``max_age_s``. The caller
(:class:`~treepack.proto.history.HistoryStore`) holds the lock and maps database errors.
"""

from __future__ import annotations

import json
import sqlite3
from dataclasses import dataclass
from typing import Any

import msgpack

from treepack.proto.history_schema import shape_checksum
from treepack.proto.shape import BatchShape
from treepack.proto.shape_wire import shape_to_wire

__all__ = ["RetentionLimits", "groups_per_tag", "batch_row", "insert_batch", "prune"]

_INSERT = (
    "INSERT INTO batches (created, seq_len, min_shared_len, sequences, groups, tokens, rows,"
    " packed_tokens, saved_fraction, tags, shape, checksum) VALUES (?,?,?,?,?,?,?,?,?,?,?,?)"
)


@dataclass(frozen=True, slots=True, kw_only=True)
class RetentionLimits:
    """What the history keeps.

    Attributes:
        max_batches: rows at most.
        max_age_s: seconds a row is kept (None: no bound).
        max_bytes: bytes of shape blobs at most, the newest row always kept (None: no bound).
    """

    max_batches: int
    max_age_s: float | None
    max_bytes: int | None


def groups_per_tag(shape: BatchShape) -> dict[str, int]:
    """Groups of the batch per task tag (``''`` for untagged); an ungrouped sequence is a group."""
    seen: dict[Any, str] = {}
    out: dict[str, int] = {}
    for s, g in enumerate(shape.groups):
        key = ("seq", s) if g is None else ("group", g)
        if key not in seen:
            tag = (shape.tags[s] if shape.tags is not None else None) or ""
            seen[key] = tag
            out[tag] = out.get(tag, 0) + 1
    return out


def batch_row(
    shape: BatchShape, *, rows: int, packed_tokens: int, saved_fraction: float, created: float
) -> tuple[Any, ...]:
    """The column values of one batch's row, in the order of the insert."""
    blob = msgpack.packb(shape_to_wire(shape, "msgpack"), use_bin_type=True)
    per_tag = groups_per_tag(shape)
    return (
        created,
        shape.seq_len,
        shape.min_shared_len,
        shape.num_sequences,
        sum(per_tag.values()),
        shape.num_tokens,
        int(rows),
        int(packed_tokens),
        float(saved_fraction),
        json.dumps(per_tag, sort_keys=True),
        blob,
        shape_checksum(blob),
    )


def insert_batch(c: sqlite3.Connection, row: tuple[Any, ...], retention: RetentionLimits, now: float) -> int:
    """Insert one row and apply retention in one transaction (rolled back on any failure).

    Returns:
        The batch's id.

    Raises:
        sqlite3.DatabaseError: the database failed (nothing was written).
    """
    c.execute("BEGIN IMMEDIATE")
    try:
        cur = c.execute(_INSERT, row)
        prune(c, now, retention)
        c.execute("COMMIT")
    except BaseException:
        if c.in_transaction:
            c.execute("ROLLBACK")
        raise
    assert cur.lastrowid is not None  # an INSERT sets it
    return int(cur.lastrowid)


def prune(c: sqlite3.Connection, now: float, retention: RetentionLimits) -> None:
    """Delete the rows that retention no longer keeps at time ``now``."""
    c.execute(
        "DELETE FROM batches WHERE id <= (SELECT id FROM batches ORDER BY id DESC LIMIT 1 OFFSET ?)",
        (retention.max_batches,),
    )
    if retention.max_age_s is not None:
        c.execute("DELETE FROM batches WHERE created < ?", (now - retention.max_age_s,))
    if retention.max_bytes is not None:
        # Oldest first, until the shapes from the newest back fit; the newest always stays.
        c.execute(
            "DELETE FROM batches WHERE id < (SELECT MAX(id) FROM batches) AND id IN (SELECT id FROM"
            " (SELECT id, SUM(LENGTH(shape)) OVER (ORDER BY id DESC) AS kept FROM batches) WHERE kept > ?)",
            (retention.max_bytes,),
        )
