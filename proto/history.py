"""The shape history: an embedded SQLite store of recorded batch shapes.

The file both planners write: the sidecar (through :class:`~treepack.service.recorder.HistoryRecorder`)
and the embedded client (``Packer(history_path=...)``), so it lives in the contract;
it needs nothing of treepack beyond the shape codec.

One table, one row per batch: summary columns (time, seq_len, counts, rows, savings,
groups per tag) plus the shape itself as a msgpack blob (``BatchShapeMessage``, no
tokens). Durability:

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
  :class:`HistoryDamaged`, one line naming the file and the cause, with a short
  path-free :attr:`HistoryDamaged.reason` for unauthenticated readers
  (:func:`move_aside` is the recovery: rename it and start fresh). A path that cannot be
  created or written raises :class:`HistoryPathError` instead (moving nothing aside
  helps; :func:`history_path_problem` finds it before a server starts). A database
  error later marks the store damaged (:attr:`HistoryStore.damaged`, for readiness) and
  raises :class:`HistoryDamaged` too.
- :meth:`HistoryStore.checkpoint` (at shutdown, and in :meth:`HistoryStore.close`) folds
  the WAL into the database file, so the file alone is complete after a clean stop.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import sqlite3
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgpack

from treepack.proto.codec import parse_message
from treepack.proto.errors import TreepackError
from treepack.proto.shape import BatchShape
from treepack.proto.shape_wire import shape_from_wire, shape_to_wire
from treepack.proto.whatif_messages import BatchShapeMessage

__all__ = [
    "HistoryStore",
    "HistoryDamaged",
    "HistoryPathError",
    "SCHEMA_VERSION",
    "APPLICATION_ID",
    "empty_summary",
    "move_aside",
    "history_path_problem",
    "shape_checksum",
]

log = logging.getLogger("treepack.history")

SCHEMA_VERSION = 2  # 2: a checksum per row
APPLICATION_ID = 0x74706B68  # "tpkh": this file is a treepack history
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
    shape BLOB NOT NULL,
    checksum BLOB
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


def shape_checksum(blob: bytes) -> bytes:
    """The checksum stored beside a shape blob (BLAKE2b, 16 bytes)."""
    return hashlib.blake2b(blob, digest_size=16).digest()


class HistoryDamaged(RuntimeError):
    """The history database cannot be used; the message names the file and the cause in one line.

    Attributes:
        reason: the cause alone, short and without the path (for unauthenticated readers).
    """

    def __init__(self, message: str, reason: str | None = None) -> None:
        super().__init__(message)
        self.reason = _clip(reason if reason is not None else message)


class HistoryPathError(RuntimeError):
    """The history path cannot be created or written: one line naming it and what to do."""


def _clip(text: str, limit: int = 120) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def history_path_problem(path: str | Path) -> str | None:
    """Why a history file cannot be created or written at ``path`` (one line, with what to do), or None.

    Checks the folder (created if missing) and the file's permissions; it opens no database.
    """
    p = Path(path)
    advice = (
        "make that folder writable by this user, set TREEPACK_HISTORY_PATH (--history-path) to a writable file, "
        "or run without a history (--no-history)"
    )
    try:
        p.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        return f"cannot create the folder of the history database {p}: {exc.strerror or exc}; {advice}"
    if p.exists():
        if p.is_dir():
            return f"the history path {p} is a folder; set TREEPACK_HISTORY_PATH (--history-path) to a file in it"
        if not os.access(p, os.R_OK | os.W_OK):
            return f"cannot read and write the history database {p} (permission denied); {advice}"
    if not os.access(p.parent, os.W_OK | os.X_OK):
        return (
            f"cannot create the history database {p} "
            f"(its folder is not writable; SQLite also writes -wal/-shm files there); {advice}"
        )
    return None


def move_aside(path: str | Path) -> Path | None:
    """Rename a damaged history file (and its ``-wal``/``-shm``) to ``<file>.damaged-<unix time>``.

    Returns:
        The new path of the database file, or None when there was no file.
    """
    src = Path(path)
    stamp = int(time.time())
    target = src.with_name(f"{src.name}.damaged-{stamp}")
    moved = None
    for suffix in ("", "-wal", "-shm"):
        f = src.with_name(src.name + suffix)
        if f.exists():
            f.rename(target.with_name(target.name + suffix))
            moved = moved or target
    return moved


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split()) or type(exc).__name__


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
                f"history database {where}: cannot open: {_one_line(exc)}", f"cannot open: {_one_line(exc)}"
            ) from None
        self._conn.create_function("treepack_checksum", 1, _checksum_or_none, deterministic=True)
        try:
            self._open()
        except (sqlite3.Error, HistoryDamaged) as exc:
            self._conn.close()
            if isinstance(exc, HistoryDamaged):
                raise
            raise HistoryDamaged(f"history database {where}: {_one_line(exc)}", _one_line(exc)) from None

    @property
    def undecodable(self) -> int:
        """Stored shapes skipped: they fail their checksum or do not decode."""
        return len(self._bad)

    def _open(self) -> None:
        with self._lock:
            c = self._conn
            check = c.execute("PRAGMA quick_check").fetchall()
            if check != [("ok",)]:
                cause = f"integrity check failed: {_one_line(Exception(check[0][0]))}"
                raise HistoryDamaged(f"history database {self.path}: {cause}", cause)
            version = c.execute("PRAGMA user_version").fetchone()[0]
            app_id = c.execute("PRAGMA application_id").fetchone()[0]
            tables = {
                r[0]
                for r in c.execute("SELECT name FROM sqlite_master WHERE type = 'table' AND name NOT LIKE 'sqlite_%'")
            }
            foreign = sorted(tables - {"batches"}) if version == 0 else []
            if app_id not in (0, APPLICATION_ID) or foreign:
                held = f" (it holds tables {', '.join(foreign[:4])})" if foreign else f" (application id {app_id:#x})"
                raise HistoryDamaged(
                    f"history database {self.path} is another application's database{held}",
                    "another application's database",
                )
            if version not in (0, 1, SCHEMA_VERSION):
                cause = f"schema version {version}; this build reads {SCHEMA_VERSION}"
                raise HistoryDamaged(f"history database {self.path} has {cause}", cause)
            # Only now the file is written to (a refused file is left exactly as it was).
            if self.path is not None:
                c.execute("PRAGMA journal_mode=WAL")
            c.execute("PRAGMA synchronous=NORMAL")
            c.executescript(_SCHEMA)
            if "checksum" not in {r[1] for r in c.execute("PRAGMA table_info(batches)")}:
                # A file of schema 1: add the checksums, trusting the rows as they are.
                c.execute("ALTER TABLE batches ADD COLUMN checksum BLOB")
                c.execute("UPDATE batches SET checksum = treepack_checksum(shape)")
            c.execute(f"PRAGMA user_version={SCHEMA_VERSION}")
            c.execute(f"PRAGMA application_id={APPLICATION_ID}")
            bad = c.execute(
                "SELECT id FROM batches WHERE checksum IS NULL OR checksum IS NOT treepack_checksum(shape)"
            ).fetchall()
            for (bid,) in bad:
                self._skip(bid, "its shape does not match its checksum")

    def _skip(self, bid: int, why: str) -> None:
        """Count a stored row as skipped (once) and log why."""
        if bid not in self._bad:
            self._bad.add(bid)
            log.warning("history row %d skipped: %s", bid, why)

    def _failed(self, exc: sqlite3.Error) -> HistoryDamaged:
        """Mark the store damaged after a database error (readiness reports it)."""
        self.damaged = f"history database {self.path or ':memory:'}: {_one_line(exc)}"
        self.damaged_reason = _clip(_one_line(exc))
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
            shape_checksum(blob),
        )
        with self._lock:
            c = self._conn
            try:
                c.execute("BEGIN IMMEDIATE")
                try:
                    cur = c.execute(
                        "INSERT INTO batches (created, seq_len, min_shared_len, sequences, groups, tokens, rows,"
                        " packed_tokens, saved_fraction, tags, shape, checksum) VALUES (?,?,?,?,?,?,?,?,?,?,?,?)",
                        row,
                    )
                    self._prune(now)
                    c.execute("COMMIT")
                except BaseException:
                    if c.in_transaction:
                        c.execute("ROLLBACK")
                    raise
            except sqlite3.DatabaseError as exc:
                raise self._failed(exc) from None
            return int(cur.lastrowid)

    def _prune(self, now: float) -> None:
        c = self._conn
        c.execute(
            "DELETE FROM batches WHERE id <= (SELECT id FROM batches ORDER BY id DESC LIMIT 1 OFFSET ?)",
            (self.max_batches,),
        )
        if self.max_age_s is not None:
            c.execute("DELETE FROM batches WHERE created < ?", (now - self.max_age_s,))
        if self.max_bytes is not None:
            # Oldest first, until the shapes from the newest back fit; the newest always stays.
            c.execute(
                "DELETE FROM batches WHERE id < (SELECT MAX(id) FROM batches) AND id IN (SELECT id FROM"
                " (SELECT id, SUM(LENGTH(shape)) OVER (ORDER BY id DESC) AS kept FROM batches) WHERE kept > ?)",
                (self.max_bytes,),
            )

    def prune(self, now: float | None = None) -> None:
        """Apply retention now (recording does it too; this serves an idle store)."""
        with self._lock:
            try:
                self._prune(time.time() if now is None else now)
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
        """Counts, time span, seq_lens, groups per tag and means over the retained batches."""

        def read(c: sqlite3.Connection) -> tuple[Any, ...]:
            head = c.execute(
                "SELECT COUNT(*), COALESCE(SUM(sequences),0), COALESCE(SUM(groups),0), COALESCE(SUM(tokens),0),"
                " MIN(created), MAX(created), AVG(rows), AVG(saved_fraction) FROM batches"
            ).fetchone()
            seq_lens = [int(r[0]) for r in c.execute("SELECT DISTINCT seq_len FROM batches ORDER BY seq_len")]
            return head, seq_lens, c.execute("SELECT tags FROM batches").fetchall()

        (n, seqs, groups, toks, oldest, newest, mean_rows, mean_saved), seq_lens, tag_rows = self._query(read)
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

    def shapes(self, limit: int | None = None) -> list[BatchShape]:
        """The most recent ``limit`` batches (all if None), oldest first.

        Decoded shapes are kept between calls (rows never change once written), so
        repeated what-if requests only decode batches recorded since the last one.
        """

        def read(c: sqlite3.Connection) -> tuple[list[int], list[Any]]:
            ids = [
                r[0]
                for r in c.execute(
                    "SELECT id FROM batches ORDER BY id DESC LIMIT ?", (-1 if limit is None else int(limit),)
                )
            ]
            missing = [i for i in ids if i not in self._decoded and i not in self._bad]
            rows = []
            for k in range(0, len(missing), 500):  # stay under SQLite's bound-parameter limit
                part = missing[k : k + 500]
                rows += c.execute(
                    f"SELECT id, shape, checksum FROM batches WHERE id IN ({','.join('?' * len(part))})", part
                ).fetchall()
            return ids, rows

        ids, rows = self._query(read)
        fresh = {}
        for bid, blob, checksum in rows:
            if _checksum_or_none(blob) != checksum:
                self._skip(bid, "its shape does not match its checksum")
                continue
            shape = _decode_row(bid, blob)
            if shape is None:
                self._skip(bid, "its shape does not decode")
            else:
                fresh[bid] = shape
        known = {**self._decoded, **fresh}
        self._decoded = {i: known[i] for i in ids if i in known}
        return [self._decoded[i] for i in reversed(ids) if i in self._decoded]

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


def _checksum_or_none(blob: Any) -> bytes | None:
    return shape_checksum(bytes(blob)) if isinstance(blob, (bytes, bytearray, memoryview)) else None


def _decode_row(bid: int, blob: Any) -> BatchShape | None:
    """A stored shape, or None (logged) when the row does not decode or is inconsistent."""
    try:
        return shape_from_wire(parse_message(BatchShapeMessage, msgpack.unpackb(blob, raw=False)), f"history[{bid}]")
    except (TreepackError, ValueError, TypeError, msgpack.UnpackException) as exc:
        log.warning("history row %d does not decode (%s)", bid, _one_line(exc))
        return None


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
