"""Planning time of the batches the planner's time bounds are stated for, one run.

Usage:
    python benchmarks/planning_batches.py [--repeats 5] [--only NAME ...] [--validate] [--json out.json]

Batches (``auto`` at its default settings, ``plan_batch`` from the sequences):

- ``grpo-256`` / ``grpo-512``: 256 / 512 GRPO groups of 4 (a 64-token prompt and 16-token
  completions; the prompt is shorter than ``min_shared_len`` plus the join token, so
  nothing is shared), C = 8,192: about 102 leaves fill a row;
- ``deep-3000``: 3,000 nested sequences (each a prefix of the next, every token shared,
  ``min_shared_len=1``), C = 4,096: a tree 3,000 levels deep;
- ``grpo-25000``: 25,000 such groups, 100,000 leaves, C = 8,192;
- ``curriculum-768``: the demo's multi-task GRPO curriculum at 768 groups (6,660
  sequences, 25.2M tokens), C = 131,072.

Printed per batch: rows and the lower bound, wall and CPU ms of ``plan_batch`` (CPU: the
planning thread's ``time.thread_time``, which the repair budget counts), median (min-max)
of ``--repeats``, and the repair pass's wall ms. ``--validate`` runs ``validate_plan`` with
the sequences on each batch's last plan (about 15 s for the 100,000 leaves). To compare two
versions of the planner, run this script on each in turn, alternating, on the same machine
(``PYTHONPATH`` pointing at a source export of the other one).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from treepack.service.cli.workloads import curriculum
from treepack.service.planner import plan_batch, validate_plan

from helpers.shapes import grpo_groups  # noqa: E402


def _nested(depth: int, seq_len: int) -> dict:
    base = np.arange(1, depth + 1, dtype=np.uint32)
    seqs = [base[: depth - i] for i in range(depth)]
    return dict(sequences=seqs, trainable=None, seq_len=seq_len, min_shared_len=1)


def _curriculum(groups: int) -> dict:
    w = curriculum(groups)
    return dict(sequences=w.sequences, trainable=w.trainable, groups=w.groups, seq_len=w.seq_len)


BATCHES = {
    "grpo-256": lambda: grpo_groups(256),
    "grpo-512": lambda: grpo_groups(512),
    "deep-3000": lambda: _nested(3000, 4096),
    "grpo-25000": lambda: grpo_groups(25_000),
    "curriculum-768": lambda: _curriculum(768),
}


def _spread(xs: list[float]) -> str:
    return f"{statistics.median(xs):.1f} ({min(xs):.1f}-{max(xs):.1f})"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--only", nargs="+", choices=sorted(BATCHES))
    ap.add_argument("--validate", action="store_true")
    ap.add_argument("--json", metavar="PATH")
    args = ap.parse_args()
    print(
        f"# {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}  {platform.processor() or platform.machine()}  "
        f"python {platform.python_version()}  {' '.join(sys.argv)}"
    )
    out = []
    for name in args.only or list(BATCHES):
        kw = BATCHES[name]()
        wall, cpu, repair = [], [], []
        for _ in range(args.repeats):
            t, c = time.perf_counter(), time.thread_time()
            plan = plan_batch(**kw, placement="auto")
            cpu.append((time.thread_time() - c) * 1e3)
            wall.append((time.perf_counter() - t) * 1e3)
            repair.append(plan.stats.timings_ms.get("repair", 0.0))
        if args.validate:
            validate_plan(plan, kw["sequences"], trainable=kw.get("trainable"))
        rec = dict(
            batch=name,
            sequences=len(kw["sequences"]),
            tokens=int(sum(len(s) for s in kw["sequences"])),
            rows=plan.num_rows,
            bound=plan.stats.lower_bound_rows,
            wall_ms=wall,
            cpu_ms=cpu,
            repair_ms=repair,
            validated=args.validate,
        )
        out.append(rec)
        print(
            f"{name:15s} {rec['sequences']:7,} seqs {rec['tokens']:12,} tokens  rows {plan.num_rows} / bound "
            f"{rec['bound']}  wall ms {_spread(wall)}  CPU ms {_spread(cpu)}  repair wall ms {_spread(repair)}"
            + ("  validated" if args.validate else ""),
            flush=True,
        )
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
