"""The shape history: an embedded SQLite store of recorded batch shapes.

The file both planners write: the sidecar (through :class:`~treepack.service.recorder.HistoryRecorder`)
and the embedded client (``Packer(history_path=...)``), so it lives in the contract;
it needs nothing of treepack beyond the shape codec. Its file format and how a file is
judged: :mod:`~treepack.proto.history_schema`; a row and retention:
:mod:`~treepack.proto.history_write`; the summary and the shapes read back:
:mod:`~treepack.proto.history_read`. This module holds the store: the connection, its
lock, its damage state and the cache of decoded shapes. Durability:

- WAL journal with ``synchronous=NORMAL``: a commit is atomic and survives the process
  being killed (SIGKILL) at any point; readers never see a half-written batch. (A power
  cut may lose the last commits, never the file.)
- Retention is enforced inside the inserting transaction: at most ``max_batches`` rows,
  at most ``max_bytes`` of shape blobs (the newest batch always stays) and none older than
  ``max_age_s``.
- ``PRAGMA user_version`` marks the schema and ``PRAGMA application_id`` the file as a
  treepack history; a file from an unknown version, another application's database (its
  own tables, or another application id) or a zero-length file is refused rather than
  misread or silently started afresh.
- Each row carries a checksum of its shape (BLAKE2b-128 of the blob); a row whose shape
  no longer matches it, or does not decode, is skipped and counted
  (:attr:`HistoryStore.undecodable`, found at open and as rows are read), never blamed on
  a request.
- Integrity: opening runs ``PRAGMA quick_check`` and the checksums; a file that is not a
  database, fails the check, is empty, foreign or has another schema raises
  :class:`~treepack.proto.history_schema.HistoryDamaged`, one line naming the file and the
  cause, with a short path-free ``reason`` for unauthenticated readers
  (:func:`~treepack.proto.history_schema.move_aside` is the recovery: rename it and start
  fresh). A path that cannot be created or written raises
  :class:`~treepack.proto.history_schema.HistoryPathError` instead (moving nothing aside
  helps; :func:`~treepack.proto.history_schema.history_path_problem` finds it before a
  server starts). A database error later marks the store damaged
  (:attr:`HistoryStore.damaged`, for readiness) and raises ``HistoryDamaged`` too.
- :meth:`HistoryStore.checkpoint` (at shutdown, and in :meth:`HistoryStore.close`) folds
  the WAL into the database file, so the file alone is complete after a clean stop.
"""

from __future__ import annotations

import logging
import sqlite3
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from treepack.proto.history_read import decode_row, shape_rows, summarize, summary_rows
from treepack.proto.history_schema import (
    HistoryDamaged,
    HistoryPathError,
    checksum_or_none,
    clip,
    history_path_problem,
    one_line,
    prepare_file,
)
from treepack.proto.history_write import RetentionLimits, batch_row, insert_batch, prune
from treepack.proto.shape import BatchShape

__all__ = ["HistoryStore"]

log = logging.getLogger("treepack.history")


class HistoryStore:
    """SQLite store of batch shapes (module docstring). Thread-safe.

    Args:
        path: database file (created with its folder), or None for an in-memory store.
        max_batches: retention by count.
        max_age_s: retention by age in seconds (None: none).
        max_bytes: retention by the bytes of the stored shapes (None: none).

    Raises:
        HistoryDamaged: the file cannot be opened as a history (module docstring).
    """

    def __init__(
        self,
        path: str | Path | None,
        *,
        max_batches: int = 1000,
        max_age_s: float | None = None,
        max_bytes: int | None = None,
    ) -> None:
        self.path = None if path is None else str(path)
        self.max_batches = max_batches
        self.max_age_s = max_age_s
        self.max_bytes = max_bytes
        self.damaged: str | None = None
        self.damaged_reason: str | None = None
        self._bad: set[int] = set()
        self._lock = threading.Lock()
        self._decoded: dict[int, BatchShape] = {}
        where = self.path or ":memory:"
        if self.path is not None:
            problem = history_path_problem(self.path)
            if problem is not None:
                raise HistoryPathError(problem)
            if Path(self.path).exists() and Path(self.path).stat().st_size == 0:
                raise HistoryDamaged(
                    f"history database {where} is an empty (zero-length) file, not a history",
                    "an empty (zero-length) file",
                )
        try:
            self._conn = sqlite3.connect(where, check_same_thread=False, isolation_level=None, timeout=30.0)
        except (OSError, sqlite3.Error) as exc:
            raise HistoryDamaged(
                f"history database {where}: cannot open: {one_line(exc)}", f"cannot open: {one_line(exc)}"
            ) from None
        self._conn.create_function("treepack_checksum", 1, checksum_or_none, deterministic=True)
        try:
            self._open()
        except (sqlite3.Error, HistoryDamaged) as exc:
            self._conn.close()
            if isinstance(exc, HistoryDamaged):
                raise
            raise HistoryDamaged(f"history database {where}: {one_line(exc)}", one_line(exc)) from None

    @property
    def undecodable(self) -> int:
        """Stored shapes skipped: they fail their checksum or do not decode."""
        return len(self._bad)

    def _open(self) -> None:
        with self._lock:
            for bid in prepare_file(self._conn, self.path):
                self._skip(bid, "its shape does not match its checksum")

    def _skip(self, bid: int, why: str) -> None:
        """Count a stored row as skipped (once) and log why."""
        if bid not in self._bad:
            self._bad.add(bid)
            log.warning("history row %d skipped: %s", bid, why)

    def _failed(self, exc: sqlite3.Error) -> HistoryDamaged:
        """Mark the store damaged after a database error (readiness reports it)."""
        self.damaged = f"history database {self.path or ':memory:'}: {one_line(exc)}"
        self.damaged_reason = clip(one_line(exc))
        log.error("%s", self.damaged)
        return HistoryDamaged(self.damaged, self.damaged_reason)

    def record(
        self, shape: BatchShape, *, rows: int, packed_tokens: int, saved_fraction: float, created: float | None = None
    ) -> int:
        """Store one batch's shape and apply retention, in one transaction.

        Returns:
            The batch's id.
        """
        now = time.time() if created is None else created
        row = batch_row(shape, rows=rows, packed_tokens=packed_tokens, saved_fraction=saved_fraction, created=now)
        with self._lock:
            try:
                return insert_batch(self._conn, row, self._retention(), now)
            except sqlite3.DatabaseError as exc:
                raise self._failed(exc) from None

    def _retention(self) -> RetentionLimits:
        return RetentionLimits(max_batches=self.max_batches, max_age_s=self.max_age_s, max_bytes=self.max_bytes)

    def prune(self, now: float | None = None) -> None:
        """Apply retention now (recording does it too; this serves an idle store)."""
        with self._lock:
            try:
                prune(self._conn, time.time() if now is None else now, self._retention())
            except sqlite3.DatabaseError as exc:
                raise self._failed(exc) from None

    def count(self) -> int:
        return int(self._query(lambda c: c.execute("SELECT COUNT(*) FROM batches").fetchone()[0]))

    def stored_bytes(self) -> int:
        """Bytes of the stored shape blobs (what ``max_bytes`` bounds)."""
        return int(
            self._query(lambda c: c.execute("SELECT COALESCE(SUM(LENGTH(shape)), 0) FROM batches").fetchone()[0])
        )

    def _query(self, fn: Callable[[sqlite3.Connection], Any]) -> Any:
        """``fn(connection)`` under the lock; a database error marks the store damaged."""
        with self._lock:
            try:
                return fn(self._conn)
            except sqlite3.DatabaseError as exc:
                raise self._failed(exc) from None

    def summary(self) -> dict[str, Any]:
        """Counts, time span, seq_lens, groups per tag and means over the retained batches
        that can be used; ``skipped``: those that cannot (found so far: at open, or when read)."""
        rows = self._query(summary_rows)
        return summarize(rows, set(self._bad))

    def shapes(
        self, limit: int | None = None, *, seq_len: int | None = None, check: Callable[[], None] | None = None
    ) -> list[BatchShape]:
        """The most recent ``limit`` batches (all if None) recorded at ``seq_len`` (any if
        None), oldest first.

        Decoded shapes are kept between calls (rows never change once written), so
        repeated what-if requests only decode batches recorded since the last one.

        Args:
            limit: how many of the most recent batches.
            seq_len: only batches recorded with this row capacity.
            check: called before each row is decoded; it raises to stop (the sidecar's
                deadline and disconnects), or None.
        """

        def seen(i: int) -> bool:
            return i in self._decoded or i in self._bad

        ids, rows, alive = self._query(
            lambda c: (*shape_rows(c, limit, seen, seq_len), {r[0] for r in c.execute("SELECT id FROM batches")})
        )
        fresh = {}
        for bid, blob, checksum in rows:
            if check is not None:
                check()
            if checksum_or_none(blob) != checksum:
                self._skip(bid, "its shape does not match its checksum")
                continue
            shape = decode_row(bid, blob)
            if shape is None:
                self._skip(bid, "its shape does not decode")
            else:
                fresh[bid] = shape
        with self._lock:  # the cache keeps every retained row any reader decoded
            known = {**self._decoded, **fresh}
            self._decoded = {i: s for i, s in known.items() if i in alive}
        return [known[i] for i in reversed(ids) if i in known]

    def check(self, *, detail: bool = False) -> str:
        """``"ok"`` when the database answers a query, else why not (readiness).

        Skipped rows are reported after the ``ok`` (``"ok; 2 stored shapes skipped ..."``).

        Args:
            detail: name the file (for authenticated readers); else the short reason only.
        """
        if self.damaged is not None:
            return f"damaged: {self.damaged if detail else self.damaged_reason}"
        try:
            self._query(lambda c: c.execute("SELECT 1 FROM batches LIMIT 1").fetchall())
        except HistoryDamaged as exc:
            return f"damaged: {exc if detail else exc.reason}"
        if self._bad:
            n = len(self._bad)
            return f"ok; {n} stored shape{'s' * (n > 1)} skipped (failed the checksum or did not decode)"
        return "ok"

    def checkpoint(self) -> None:
        """Fold the WAL into the database file (the file alone is then complete)."""
        if self.path is not None and self.damaged is None:
            self._query(lambda c: c.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchall())

    def close(self) -> None:
        """Checkpoint (when healthy) and close the database."""
        try:
            self.checkpoint()
        except HistoryDamaged:
            pass  # already logged; closing is all that is left
        with self._lock:
            self._conn.close()
