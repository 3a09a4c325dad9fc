"""The shape history: an embedded SQLite store of recorded batch shapes.

One table, one row per batch: summary columns (time, seq_len, counts, rows, savings,
groups per tag) plus the shape itself as a msgpack blob (``BatchShapeMessage``, no
tokens). Durability:

- WAL journal with ``synchronous=NORMAL``: a commit is atomic and survives the process
  being killed (SIGKILL) at any point; readers never see a half-written batch. (A power
  cut may lose the last commits, never the file.)
- Retention is enforced inside the inserting transaction: at most ``max_batches`` rows
  and none older than ``max_age_s``.
- ``PRAGMA user_version`` marks the schema; a file from an unknown version is refused
  rather than misread.

:class:`HistoryRecorder` writes from one background thread so a pack response never
waits for hashing or the disk; :meth:`HistoryRecorder.flush` lets readers see every
earlier write.
"""

from __future__ import annotations

import json
import logging
import sqlite3
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable

import msgpack

from treepack.proto.codec import parse_message
from treepack.proto.messages import BatchShapeMessage
from treepack.proto.plan import PlanStats
from treepack.proto.shape import BatchShape
from treepack.proto.shape_wire import shape_from_wire, shape_to_wire

__all__ = ["HistoryStore", "HistoryRecorder", "SCHEMA_VERSION", "empty_summary"]

log = logging.getLogger("treepack.history")

SCHEMA_VERSION = 1
_SCHEMA = """
CREATE TABLE IF NOT EXISTS batches (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    created REAL NOT NULL,
    seq_len INTEGER NOT NULL,
    min_shared_len INTEGER NOT NULL,
    sequences INTEGER NOT NULL,
    groups INTEGER NOT NULL,
    tokens INTEGER NOT NULL,
    rows INTEGER NOT NULL,
    packed_tokens INTEGER NOT NULL,
    saved_fraction REAL NOT NULL,
    tags TEXT NOT NULL,
    shape BLOB NOT NULL
);
CREATE INDEX IF NOT EXISTS batches_created ON batches (created);
"""


def _groups_per_tag(shape: BatchShape) -> dict[str, int]:
    seen: dict[Any, str] = {}
    out: dict[str, int] = {}
    for s, g in enumerate(shape.groups):
        key = ("seq", s) if g is None else ("group", g)
        if key not in seen:
            tag = (shape.tags[s] if shape.tags is not None else None) or ""
            seen[key] = tag
            out[tag] = out.get(tag, 0) + 1
    return out


class HistoryStore:
    """SQLite store of batch shapes (module docstring). Thread-safe.

    Args:
        path: database file (created with its folder), or None for an in-memory store.
        max_batches: retention by count.
        max_age_s: retention by age in seconds (None: none).
    """

    def __init__(self, path: str | Path | None, *, max_batches: int = 1000, max_age_s: float | None = None) -> None:
        self.path = None if path is None else str(path)
        self.max_batches = max_batches
        self.max_age_s = max_age_s
        if self.path is not None:
            Path(self.path).parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._decoded: dict[int, BatchShape] = {}
        self._conn = sqlite3.connect(self.path or ":memory:", check_same_thread=False, isolation_level=None, timeout=30.0)
        with self._lock:
            c = self._conn
            if self.path is not None:
                c.execute("PRAGMA journal_mode=WAL")
            c.execute("PRAGMA synchronous=NORMAL")
            version = c.execute("PRAGMA user_version").fetchone()[0]
            if version not in (0, SCHEMA_VERSION):
                c.close()
                raise RuntimeError(f"history database {self.path} has schema version {version}; this build reads {SCHEMA_VERSION}")
            c.executescript(_SCHEMA)
            c.execute(f"PRAGMA user_version={SCHEMA_VERSION}")

    def record(self, shape: BatchShape, *, rows: int, packed_tokens: int, saved_fraction: float, created: float | None = None) -> int:
        """Store one batch's shape and apply retention, in one transaction.

        Returns:
            The batch's id.
        """
        now = time.time() if created is None else created
        blob = msgpack.packb(shape_to_wire(shape, "msgpack"), use_bin_type=True)
        per_tag = _groups_per_tag(shape)
        row = (
            now,
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
        )
        with self._lock:
            c = self._conn
            c.execute("BEGIN IMMEDIATE")
            try:
                cur = c.execute(
                    "INSERT INTO batches (created, seq_len, min_shared_len, sequences, groups, tokens, rows,"
                    " packed_tokens, saved_fraction, tags, shape) VALUES (?,?,?,?,?,?,?,?,?,?,?)",
                    row,
                )
                self._prune(now)
                c.execute("COMMIT")
            except BaseException:
                c.execute("ROLLBACK")
                raise
            return int(cur.lastrowid)

    def _prune(self, now: float) -> None:
        c = self._conn
        c.execute(
            "DELETE FROM batches WHERE id <= (SELECT id FROM batches ORDER BY id DESC LIMIT 1 OFFSET ?)",
            (self.max_batches,),
        )
        if self.max_age_s is not None:
            c.execute("DELETE FROM batches WHERE created < ?", (now - self.max_age_s,))

    def prune(self, now: float | None = None) -> None:
        """Apply retention now (recording does it too; this serves an idle store)."""
        with self._lock:
            self._prune(time.time() if now is None else now)

    def count(self) -> int:
        with self._lock:
            return int(self._conn.execute("SELECT COUNT(*) FROM batches").fetchone()[0])

    def summary(self) -> dict[str, Any]:
        """Counts, time span, seq_lens, groups per tag and means over the retained batches."""
        with self._lock:
            c = self._conn
            n, seqs, groups, toks, oldest, newest, mean_rows, mean_saved = c.execute(
                "SELECT COUNT(*), COALESCE(SUM(sequences),0), COALESCE(SUM(groups),0), COALESCE(SUM(tokens),0),"
                " MIN(created), MAX(created), AVG(rows), AVG(saved_fraction) FROM batches"
            ).fetchone()
            seq_lens = [int(r[0]) for r in c.execute("SELECT DISTINCT seq_len FROM batches ORDER BY seq_len")]
            tag_rows = c.execute("SELECT tags FROM batches").fetchall()
        tags: dict[str, int] = {}
        for (t,) in tag_rows:
            for k, v in json.loads(t).items():
                tags[k] = tags.get(k, 0) + int(v)
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

    def shapes(self, limit: int | None = None) -> list[BatchShape]:
        """The most recent ``limit`` batches (all if None), oldest first.

        Decoded shapes are kept between calls (rows never change once written), so
        repeated what-if requests only decode batches recorded since the last one.
        """
        with self._lock:
            ids = [r[0] for r in self._conn.execute("SELECT id FROM batches ORDER BY id DESC LIMIT ?", (-1 if limit is None else int(limit),))]
            missing = [i for i in ids if i not in self._decoded]
            rows = []
            for k in range(0, len(missing), 500):  # stay under SQLite's bound-parameter limit
                part = missing[k : k + 500]
                rows += self._conn.execute(f"SELECT id, shape FROM batches WHERE id IN ({','.join('?' * len(part))})", part).fetchall()
        fresh = {bid: shape_from_wire(parse_message(BatchShapeMessage, msgpack.unpackb(blob, raw=False)), f"history[{bid}]") for bid, blob in rows}
        known = {**self._decoded, **fresh}
        self._decoded = {i: known[i] for i in ids if i in known}
        return [self._decoded[i] for i in reversed(ids) if i in self._decoded]

    def check(self) -> str:
        """``"ok"`` when the database answers a query (readiness)."""
        with self._lock:
            self._conn.execute("SELECT 1 FROM batches LIMIT 1").fetchall()
        return "ok"

    def close(self) -> None:
        with self._lock:
            self._conn.close()


class HistoryRecorder:
    """Records shapes from one background thread, dropping work beyond ``max_pending``.

    Counters (read by the metrics): ``recorded``, ``skipped`` (backlog full), ``failed``.
    """

    def __init__(self, store: HistoryStore, *, max_pending: int = 32) -> None:
        self.store = store
        self.max_pending = max_pending
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="treepack-history")
        self._lock = threading.Lock()
        self._pending = 0
        self.recorded = 0
        self.skipped = 0
        self.failed = 0

    @property
    def pending(self) -> int:
        return self._pending

    def _write(self, make_shape: Callable[[], BatchShape], stats: PlanStats) -> None:
        try:
            shape = make_shape()
            self.store.record(shape, rows=stats.rows, packed_tokens=stats.packed_tokens, saved_fraction=stats.saved_fraction)
            self.recorded += 1
        except Exception:
            self.failed += 1
            log.exception("could not record a batch shape")
        finally:
            with self._lock:
                self._pending -= 1

    def submit(self, make_shape: Callable[[], BatchShape] | None, stats: PlanStats) -> bool:
        """Queue a planned batch's shape for recording.

        Args:
            make_shape: computes the shape on the writer thread (the planner's
                ``fingerprint.shape_job``); None when there is nothing to record.
            stats: the plan's figures, recorded beside the shape.

        Returns:
            True if queued; False if the backlog is full or there was nothing to record.
        """
        if make_shape is None:
            return False
        with self._lock:
            if self._pending >= self.max_pending:
                self.skipped += 1
                return False
            self._pending += 1
        self._executor.submit(self._write, make_shape, stats)
        return True

    def flush(self, timeout: float | None = None) -> None:
        """Block until every earlier submission is written (the writer is FIFO)."""
        self._executor.submit(lambda: None).result(timeout)

    def close(self) -> None:
        self._executor.shutdown(wait=True)
        self.store.close()


def empty_summary() -> dict[str, Any]:
    """The summary of a disabled history."""
    return dict(
        batches=0, sequences=0, groups=0, tokens=0, oldest=None, newest=None, seq_lens=[], tags={}, mean_rows=None, mean_saved_fraction=None
    )
