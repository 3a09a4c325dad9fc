"""Running gloo ranks as real processes (tests/e2e): start, join with a deadline, collect."""

from __future__ import annotations

import signal
import time
from pathlib import Path

import pytest


def join_ranks(ctx, timeout_s: float, results: list[Path]) -> None:
    """Join ``torch.multiprocessing`` ranks; fail on a timeout or a rank that died before its result.

    gloo on CPU now and then aborts a rank (SIGABRT, "terminate called without an active
    exception") while it tears its pair threads down after ``destroy_process_group``. A rank
    that wrote its result file had finished every collective by then, so that abort is not a
    failure of the code under test; a rank that died earlier (no result) still fails the test.

    Args:
        ctx: the context from ``mp.start_processes(..., join=False)``.
        timeout_s: wall-clock limit for all ranks together.
        results: each rank's result file, written at the end of its work.
    """
    import torch.multiprocessing as mp

    deadline = time.monotonic() + timeout_s
    try:
        while not ctx.join(timeout=max(1.0, deadline - time.monotonic())):
            if time.monotonic() > deadline:
                pytest.fail(f"{len(results)}-rank test did not finish in {timeout_s}s")
    except mp.ProcessExitedException as e:
        if not (e.signal_name == signal.Signals.SIGABRT.name and all(p.exists() for p in results)):
            raise
        for p in ctx.processes:
            p.join(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.terminate()
