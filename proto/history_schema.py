"""The shape history's file: its SQL schema, its marks, its checksums and how a file is judged.

One table, one row per batch: summary columns (time, seq_len, counts, rows, savings,
groups per tag) plus the shape itself as a msgpack blob (``BatchShapeMessage``, no
tokens) and a checksum of that blob (BLAKE2b-128). ``PRAGMA user_version`` marks the
schema and ``PRAGMA application_id`` the file as a treepack history.

:func:`prepare_file` is the one judgement of an opened file: a file from an unknown
version, another application's database (its own tables, or another application id) or
one that fails ``PRAGMA quick_check`` raises :class:`HistoryDamaged` before anything is
written to it; a file of schema 1 gains its checksums, in the one transaction that also
creates the schema and sets the marks (a kill at any point leaves it as it was, or
current). :class:`HistoryPathError` is the other failure, a path that cannot be created
or written (:func:`history_path_problem` finds it before a server starts);
:func:`move_aside` is the recovery from a damaged file. The store itself
(:class:`~treepack.proto.history.HistoryStore`) opens the connection.
"""

from __future__ import annotations

import hashlib
import os
import sqlite3
import time
from pathlib import Path
from typing import Any

__all__ = [
    "SCHEMA_VERSION",
    "APPLICATION_ID",
    "HistoryDamaged",
    "HistoryPathError",
    "history_path_problem",
    "move_aside",
    "shape_checksum",
    "checksum_or_none",
    "prepare_file",
    "one_line",
    "clip",
]

SCHEMA_VERSION = 2  # 2: a checksum per row
APPLICATION_ID = 0x74706B68  # "tpkh": this file is a treepack history
_SCHEMA = (
    """CREATE TABLE IF NOT EXISTS batches (
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
)""",
    "CREATE INDEX IF NOT EXISTS batches_created ON batches (created)",
)


def shape_checksum(blob: bytes) -> bytes:
    """The checksum stored beside a shape blob (BLAKE2b, 16 bytes)."""
    return hashlib.blake2b(blob, digest_size=16).digest()


def checksum_or_none(blob: Any) -> bytes | None:
    """:func:`shape_checksum` of a stored blob, or None when the column holds no blob (SQL function too)."""
    return shape_checksum(bytes(blob)) if isinstance(blob, (bytes, bytearray, memoryview)) else None


def one_line(exc: BaseException) -> str:
    """An exception's message on one line (its type's name when it has none)."""
    return " ".join(str(exc).split()) or type(exc).__name__


def clip(text: str, limit: int = 120) -> str:
    """``text`` on one line, at most ``limit`` characters (cut with ``...``)."""
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


class HistoryDamaged(RuntimeError):
    """The history database cannot be used; the message names the file and the cause in one line.

    Attributes:
        reason: the cause alone, short and without the path (for unauthenticated readers).
    """

    def __init__(self, message: str, reason: str | None = None) -> None:
        super().__init__(message)
        self.reason = clip(reason if reason is not None else message)


class HistoryPathError(RuntimeError):
    """The history path cannot be created or written: one line naming it and what to do."""


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


def _refuse_foreign(c: sqlite3.Connection, path: str | None) -> int:
    """Raise :class:`HistoryDamaged` for a file that fails the check or is not (this version of) a history.

    Returns:
        The file's schema version (0: a new file).
    """
    check = c.execute("PRAGMA quick_check").fetchall()
    if check != [("ok",)]:
        cause = f"integrity check failed: {one_line(Exception(check[0][0]))}"
        raise HistoryDamaged(f"history database {path}: {cause}", cause)
    version = int(c.execute("PRAGMA user_version").fetchone()[0])
    app_id = c.execute("PRAGMA application_id").fetchone()[0]
    tables = {
        r[0] for r in c.execute("SELECT name FROM sqlite_master WHERE type = 'table' AND name NOT LIKE 'sqlite_%'")
    }
    foreign = sorted(tables - {"batches"}) if version == 0 else []
    if app_id not in (0, APPLICATION_ID) or foreign:
        held = f" (it holds tables {', '.join(foreign[:4])})" if foreign else f" (application id {app_id:#x})"
        raise HistoryDamaged(
            f"history database {path} is another application's database{held}",
            "another application's database",
        )
    if version not in (0, 1, SCHEMA_VERSION):
        cause = f"schema version {version}; this build reads {SCHEMA_VERSION}"
        raise HistoryDamaged(f"history database {path} has {cause}", cause)
    return version


def _migrate(c: sqlite3.Connection, version: int) -> None:
    """Make the schema current, inside the caller's transaction.

    A file below :data:`SCHEMA_VERSION` gains the checksum column (schema 1 -> 2) and a
    checksum on every row that has none, its rows trusted as they are: that also
    completes a file an older build left half-migrated (the column added, the checksums
    not yet, the version not bumped) when it was killed.
    """
    for statement in _SCHEMA:
        c.execute(statement)
    if version < SCHEMA_VERSION:
        if "checksum" not in {r[1] for r in c.execute("PRAGMA table_info(batches)")}:
            c.execute("ALTER TABLE batches ADD COLUMN checksum BLOB")
        c.execute("UPDATE batches SET checksum = treepack_checksum(shape) WHERE checksum IS NULL")
    c.execute(f"PRAGMA user_version={SCHEMA_VERSION}")
    c.execute(f"PRAGMA application_id={APPLICATION_ID}")


def prepare_file(c: sqlite3.Connection, path: str | None) -> list[int]:
    """Judge an opened file, then make it a current history (journal, schema, marks).

    The schema, any migration and the marks are one transaction: a process killed at any
    point leaves the file as it was before, or current (never a column without its
    checksums, or checksums without the version that says they are there).

    Args:
        c: the connection (autocommit: ``isolation_level=None``), with the SQL function
            ``treepack_checksum`` (:func:`checksum_or_none`).
        path: the file, or None for an in-memory store (no WAL then).

    Returns:
        The ids of the rows whose shape does not match its checksum.

    Raises:
        HistoryDamaged: the file is damaged, foreign or of another schema (left as it was).
        sqlite3.Error: the database failed under a statement (rolled back).
    """
    version = _refuse_foreign(c, path)
    # Only now the file is written to (a refused file is left exactly as it was). The
    # journal mode cannot change inside a transaction; it changes nothing else.
    if path is not None:
        c.execute("PRAGMA journal_mode=WAL")
    c.execute("PRAGMA synchronous=NORMAL")
    c.execute("BEGIN IMMEDIATE")
    try:
        _migrate(c, version)
        c.execute("COMMIT")
    except BaseException:
        if c.in_transaction:
            c.execute("ROLLBACK")
        raise
    bad = c.execute("SELECT id FROM batches WHERE checksum IS NULL OR checksum IS NOT treepack_checksum(shape)")
    return [bid for (bid,) in bad.fetchall()]
