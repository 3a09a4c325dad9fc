"""The shape history: retention, restarts, SIGKILL mid-write, the background recorder."""

from __future__ import annotations

import signal
import sqlite3
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

from tests.helpers.trees import plan_result
from treepack.service.history import HistoryRecorder, HistoryStore
from treepack.proto.batch import normalize_batch
from treepack.service.planner import plan_batch
from treepack.proto.shape import BatchShape
from treepack.service.planner.fingerprint import shape_job, shape_of
from treepack.service.planner.workloads import curriculum


def _shape(n_groups: int = 4, seed: int = 0) -> tuple[BatchShape, object]:
    w = curriculum(n_groups, seed=seed, seq_len=32768)
    kw = w.plan_kwargs()
    result = plan_result(**kw)
    return shape_of(result.batch, result.tree, seq_len=w.seq_len, tags=w.tags), result.plan


def _same_shape(a: BatchShape, b: BatchShape) -> None:
    for f in ("seq_ptr", "run_hash", "run_len", "first_trainable"):
        assert np.array_equal(getattr(a, f), getattr(b, f)), f
    assert a.groups == b.groups and a.tags == b.tags and (a.seq_len, a.min_shared_len) == (b.seq_len, b.min_shared_len)


def test_record_and_read_back_across_a_reopen(tmp_path):
    path = tmp_path / "h" / "history.sqlite3"
    shape, plan = _shape()
    store = HistoryStore(path, max_batches=10)
    store.record(shape, rows=plan.num_rows, packed_tokens=plan.stats.packed_tokens, saved_fraction=plan.stats.saved_fraction)
    store.close()
    store = HistoryStore(path, max_batches=10)
    (back,) = store.shapes()
    _same_shape(shape, back)
    s = store.summary()
    assert s["batches"] == 1 and s["sequences"] == shape.num_sequences and s["tokens"] == shape.num_tokens
    assert s["mean_rows"] == plan.num_rows and sum(s["tags"].values()) == s["groups"] == 4
    assert sqlite3.connect(path).execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    store.close()


def test_retention_by_count_and_age(tmp_path):
    shape, _ = _shape(2)
    store = HistoryStore(tmp_path / "h.sqlite3", max_batches=3, max_age_s=100.0)
    now = time.time()
    ids = [store.record(shape, rows=i, packed_tokens=1, saved_fraction=0.0, created=now) for i in range(5)]
    assert store.count() == 3
    assert [r[0] for r in store._conn.execute("SELECT id FROM batches ORDER BY id")] == ids[-3:]
    store.record(shape, rows=9, packed_tokens=1, saved_fraction=0.0, created=now + 150)  # the others are now 150 s old
    assert store.count() == 1 and store.summary()["mean_rows"] == 9
    store.prune(now + 300)
    assert store.count() == 0
    store.close()


def test_most_recent_batches_come_oldest_first(tmp_path):
    store = HistoryStore(None, max_batches=10)
    shapes = [_shape(2, seed=s)[0] for s in range(3)]
    for s in shapes:
        store.record(s, rows=1, packed_tokens=1, saved_fraction=0.0)
    got = store.shapes(2)
    assert len(got) == 2
    _same_shape(got[0], shapes[1])
    _same_shape(got[1], shapes[2])
    store.close()


def test_unknown_schema_version_is_refused(tmp_path):
    path = tmp_path / "h.sqlite3"
    c = sqlite3.connect(path)
    c.execute("PRAGMA user_version=99")
    c.close()
    with pytest.raises(RuntimeError, match="schema version 99"):
        HistoryStore(path)


WRITER = textwrap.dedent(
    """
    import sys
    import numpy as np
    from treepack.service.history import HistoryStore
    from treepack.proto.shape import BatchShape

    rng = np.random.default_rng(0)
    n = 60_000  # ~1.5 MB per record: every write takes a while
    shape = BatchShape(seq_len=1 << 20, min_shared_len=64, seq_ptr=np.arange(n + 1, dtype=np.int64),
                       run_hash=rng.integers(1, 2**63, n, dtype=np.uint64), run_len=np.full(n, 7, np.int64),
                       first_trainable=np.full(n, 7, np.int64), groups=tuple(range(n)), tags=None)
    store = HistoryStore(sys.argv[1], max_batches=20)
    i = 0
    while True:
        store.record(shape, rows=i, packed_tokens=i, saved_fraction=0.5)
        i += 1
        if i == 3:
            print("ready", flush=True)
    """
)


@pytest.mark.parametrize("delay", [0.0, 0.13, 0.31])
def test_sigkill_mid_write_leaves_a_readable_history(tmp_path, delay):
    path = tmp_path / "h.sqlite3"
    proc = subprocess.Popen([sys.executable, "-c", WRITER, str(path)], stdout=subprocess.PIPE)
    assert proc.stdout.readline().strip() == b"ready"
    time.sleep(delay)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=10)
    assert proc.returncode == -signal.SIGKILL
    conn = sqlite3.connect(path)
    assert conn.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    conn.close()
    store = HistoryStore(path, max_batches=20)
    n = store.count()
    assert 3 <= n <= 20
    shapes = store.shapes()  # every committed record decodes in full
    assert len(shapes) == n and all(s.num_sequences == 60_000 for s in shapes)
    store.record(shapes[0], rows=1, packed_tokens=1, saved_fraction=0.0)  # and it takes writes again
    assert store.count() == min(n + 1, 20)
    store.close()


def test_recorder_skips_rather_than_waits_when_the_backlog_is_full():
    shape_store = HistoryStore(None, max_batches=10)
    rec = HistoryRecorder(shape_store, max_pending=1)
    w = curriculum(2)
    kw = w.plan_kwargs()
    result = plan_result(**kw)
    job = shape_job(result, w.tags)
    with shape_store._lock:  # the writer blocks inside its first write
        assert rec.submit(job, result.plan.stats) is True
        assert rec.submit(job, result.plan.stats) is False
    rec.flush(timeout=10)
    assert (rec.recorded, rec.skipped, rec.failed, rec.pending) == (1, 1, 0, 0)
    assert shape_store.summary()["groups"] == 2 and shape_store.count() == 1
    rec.close()


def test_shapes_are_decoded_once_and_follow_retention():
    store = HistoryStore(None, max_batches=2)
    shapes = [_shape(2, seed=s)[0] for s in range(3)]
    store.record(shapes[0], rows=1, packed_tokens=1, saved_fraction=0.0)
    first = store.shapes()
    store.record(shapes[1], rows=1, packed_tokens=1, saved_fraction=0.0)
    second = store.shapes()
    assert second[0] is first[0]  # cached, not decoded again
    _same_shape(second[1], shapes[1])
    store.record(shapes[2], rows=1, packed_tokens=1, saved_fraction=0.0)  # evicts the first
    third = store.shapes()
    assert len(third) == 2 and third[0] is second[1]
    _same_shape(third[1], shapes[2])
    store.close()
