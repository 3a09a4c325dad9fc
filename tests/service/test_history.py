"""The shape history: retention, reopening, the background recorder.

SIGKILL mid-write: tests/e2e/test_history_sigkill.py.
"""

from __future__ import annotations

import sqlite3
import time

import numpy as np
import pytest

from treepack.proto.history import HistoryStore
from treepack.proto.shape import BatchShape
from treepack.service.cli.workloads import curriculum
from treepack.service.planner.fingerprint import shape_job, shape_of
from treepack.service.recorder import HistoryRecorder

from helpers.trees import plan_result


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
    store.record(
        shape, rows=plan.num_rows, packed_tokens=plan.stats.packed_tokens, saved_fraction=plan.stats.saved_fraction
    )
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
