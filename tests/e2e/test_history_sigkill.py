"""The shape history survives a SIGKILL in the middle of a write (a writer process killed at three moments)."""

from __future__ import annotations

import signal
import sqlite3
import subprocess
import sys
import textwrap
import time

import pytest

from treepack.proto.history import HistoryStore

WRITER = textwrap.dedent(
    """
    import sys
    import numpy as np
    from treepack.proto.history import HistoryStore
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
