"""The sidecar's history writer: shapes recorded from one background thread.

A pack response never waits for hashing or the disk: :class:`HistoryRecorder` queues each
planned batch's shape job for one writer thread over a
:class:`~treepack.proto.history.HistoryStore`; :meth:`HistoryRecorder.flush` lets readers
see every earlier write.

A batch is recorded only once its answer is final (the sidecar answered 2xx), yet the
answer says whether it is recorded: so the two steps are apart. :meth:`HistoryRecorder.admit`
decides (before the answer is encoded) and :meth:`HistoryRecorder.record` queues (after it
is). Nothing is held in between, so an answer that fails to encode, or is never sent,
leaves nothing behind; the price is that the backlog may pass ``max_pending`` by the
answers admitted at once (at most the planner pool's workers).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from treepack.proto.history import HistoryStore
from treepack.proto.plan import PlanStats
from treepack.proto.shape import BatchShape

__all__ = ["HistoryRecorder"]

log = logging.getLogger("treepack.history")


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
            self.store.record(
                shape, rows=stats.rows, packed_tokens=stats.packed_tokens, saved_fraction=stats.saved_fraction
            )
            self.recorded += 1
        except Exception:
            self.failed += 1
            log.exception("could not record a batch shape")
        finally:
            with self._lock:
                self._pending -= 1

    def admit(self) -> bool:
        """Whether a batch answered now may be recorded: the backlog has room (else a skip is counted).

        Returns:
            True when the caller may :meth:`record` the batch once it has answered.
        """
        with self._lock:
            if self._pending >= self.max_pending:
                self.skipped += 1
                return False
            return True

    def record(self, make_shape: Callable[[], BatchShape], stats: PlanStats) -> None:
        """Queue an admitted batch's shape (module docstring: not refused for a full backlog).

        Args:
            make_shape: computes the shape on the writer thread (the planner's
                ``fingerprint.shape_job``).
            stats: the plan's figures, recorded beside the shape.
        """
        with self._lock:
            self._pending += 1
        self._executor.submit(self._write, make_shape, stats)

    def submit(self, make_shape: Callable[[], BatchShape] | None, stats: PlanStats) -> bool:
        """:meth:`admit` and :meth:`record` at once (for a caller with no answer to wait for).

        Args:
            make_shape: as for :meth:`record`; None when there is nothing to record.
            stats: as for :meth:`record`.

        Returns:
            True if queued; False if the backlog is full or there was nothing to record.
        """
        if make_shape is None or not self.admit():
            return False
        self.record(make_shape, stats)
        return True

    def flush(self, timeout: float | None = None) -> None:
        """Block until every earlier submission is written (the writer is FIFO)."""
        self._executor.submit(lambda: None).result(timeout)

    def close(self) -> None:
        self._executor.shutdown(wait=True)
        self.store.close()
