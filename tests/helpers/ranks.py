"""Running gloo ranks as real processes (tests/e2e): start, join with a deadline, collect."""

from __future__ import annotations

import json
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from helpers.service import free_port


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


def run_ranks(
    worker: Callable[[int, int, str], None], out_dir: Path, timeout_s: float, nprocs: int = 2
) -> list[dict[str, Any]]:
    """Spawn ``worker(rank, port, out_dir)`` on ``nprocs`` gloo ranks and read each ``rank{r}.json``.

    Args:
        worker: a module-level function (spawned); it writes ``out_dir / f"rank{rank}.json"``.
        out_dir: where the ranks write their results.
        timeout_s: wall-clock limit for all ranks together (see :func:`join_ranks`).
        nprocs: number of ranks.

    Returns:
        Each rank's decoded result, rank order.
    """
    import torch.multiprocessing as mp

    ctx = mp.start_processes(worker, args=(free_port(), str(out_dir)), nprocs=nprocs, join=False, start_method="spawn")
    results = [out_dir / f"rank{r}.json" for r in range(nprocs)]
    join_ranks(ctx, timeout_s, results)
    return [json.loads(r.read_text()) for r in results]
