"""The schema 1 -> 2 migration survives a SIGKILL at each of its steps.

A child process opens a schema-1 history (``HistoryStore``) and SIGKILLs itself as the k-th
SQL statement of the open starts (SQLite's trace callback), for every k, and once in the
middle of the checksum backfill (a progress handler). After each kill a fresh open must
find every batch usable: the file is either still schema 1 (migrated again now) or fully
migrated, never a column without its checksums. Before the migration was one transaction,
a kill after ``ALTER TABLE`` left every row without a checksum, skipped for good.

A file an older build left half-migrated (the column added, the checksums not, the version
still 1) is completed on open.
"""

from __future__ import annotations

import shutil
import signal
import sqlite3
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from treepack.proto.history import HistoryStore
from treepack.proto.shape import BatchShape

ROWS = 12

CHILD = textwrap.dedent(
    """
    import os, signal, sqlite3, sys
    from treepack.proto.history import HistoryStore

    path, kill_at, mode = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    real = sqlite3.connect
    count = [0]

    in_backfill, steps = [False], [0]

    def connect(*args, **kwargs):
        c = real(*args, **kwargs)

        def trace(sql):
            count[0] += 1
            in_backfill[0] = sql.startswith("UPDATE batches SET checksum")
            if mode == "statement" and count[0] == kill_at:
                os.kill(os.getpid(), signal.SIGKILL)

        def progress():
            if in_backfill[0] and mode == "backfill":
                steps[0] += 1
                if steps[0] == kill_at:
                    os.kill(os.getpid(), signal.SIGKILL)
            return 0

        c.set_trace_callback(trace)
        c.set_progress_handler(progress, 10)
        return c

    sqlite3.connect = connect
    store = HistoryStore(path, max_batches=1000)
    print(steps[0], count[0], flush=True)
    """
)


def _schema1(path, rows: int = ROWS) -> None:
    """A schema-1 history of ``rows`` batches (~0.4 MB each): the checksum column dropped, version 1."""
    rng = np.random.default_rng(0)
    n = 16_000
    store = HistoryStore(path, max_batches=1000, max_bytes=None)
    for i in range(rows):
        shape = BatchShape(
            seq_len=64,
            min_shared_len=8,
            seq_ptr=np.arange(n + 1, dtype=np.int64),
            run_hash=rng.integers(1, 2**63, n, dtype=np.uint64),
            run_len=np.full(n, 4, np.int64),
            first_trainable=np.full(n, 2, np.int64),
            groups=tuple(range(n)),
        )
        store.record(shape, rows=i + 1, packed_tokens=4 * n, saved_fraction=0.0)
    store.close()
    c = sqlite3.connect(path)
    c.execute("ALTER TABLE batches DROP COLUMN checksum")
    c.execute("PRAGMA user_version=1")
    c.commit()
    c.close()


def _child(path, kill_at: int, mode: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-c", CHILD, str(path), str(kill_at), mode]
    return subprocess.run(cmd, capture_output=True, timeout=120)


def _all_usable(path) -> tuple[int, int]:
    """Open the history; (schema version on disk before the open, batches usable)."""
    c = sqlite3.connect(path)
    version = c.execute("PRAGMA user_version").fetchone()[0]
    assert c.execute("PRAGMA quick_check").fetchone()[0] == "ok"
    c.close()
    store = HistoryStore(path, max_batches=1000)
    try:
        summary = store.summary()
        shapes = store.shapes()
        assert store.undecodable == 0 and summary["skipped"] == 0, summary
        assert summary["batches"] == len(shapes) == ROWS, (summary, len(shapes))
    finally:
        store.close()
    return version, len(shapes)


@pytest.fixture(scope="module")
def schema1(tmp_path_factory):
    path = tmp_path_factory.mktemp("m") / "schema1.sqlite3"
    _schema1(path)
    return path


def test_a_kill_at_every_statement_of_the_migration_loses_nothing(schema1, tmp_path):
    probe = tmp_path / "probe.sqlite3"
    shutil.copy(schema1, probe)
    done = _child(probe, 10**9, "statement")
    assert done.returncode == 0, done.stderr
    statements = int(done.stdout.split()[-1])
    assert statements >= 10, statements  # the check, marks, BEGIN, schema, ALTER, UPDATE, marks, COMMIT, ...
    seen = set()
    for k in range(1, statements + 1):
        path = tmp_path / f"k{k}.sqlite3"
        shutil.copy(schema1, path)
        killed = _child(path, k, "statement")
        assert killed.returncode == -signal.SIGKILL, (k, killed.stderr)
        version, _ = _all_usable(path)
        seen.add(version)
    assert seen == {1, 2}, f"the kills fell only {seen}: before and after the commit must both be hit"


def test_a_kill_in_the_middle_of_the_backfill_loses_nothing(schema1, tmp_path):
    probe = tmp_path / "probe.sqlite3"
    shutil.copy(schema1, probe)
    done = _child(probe, 10**9, "backfill")
    assert done.returncode == 0, done.stderr
    total = int(done.stdout.split()[0])  # progress callbacks inside the backfill
    assert total >= 3, total
    for step in (1, total // 2, total):
        path = tmp_path / f"b{step}.sqlite3"
        shutil.copy(schema1, path)
        killed = _child(path, step, "backfill")
        assert killed.returncode == -signal.SIGKILL, (step, killed.stderr)  # killed inside the UPDATE
        assert _all_usable(path)[0] == 1  # rolled back: still schema 1, migrated now


def test_a_half_migrated_file_of_an_older_build_is_completed(schema1, tmp_path):
    path = tmp_path / "half.sqlite3"
    shutil.copy(schema1, path)
    c = sqlite3.connect(path)
    c.execute("ALTER TABLE batches ADD COLUMN checksum BLOB")  # what the old migration committed alone
    c.commit()
    c.close()
    assert _all_usable(path) == (1, ROWS)
    c = sqlite3.connect(path)
    assert c.execute("PRAGMA user_version").fetchone()[0] == 2
    assert c.execute("SELECT COUNT(*) FROM batches WHERE checksum IS NULL").fetchone()[0] == 0
    c.close()
