"""The planning benchmark (``treepack bench`` and ``benchmarks/planning.py``).

For every workload of :mod:`treepack.service.cli.workloads` and every placement, it
plans the batch ``repeats`` times and reports the best time of each phase (tree,
placement, layout+metadata, total), the rows and the packed tokens. In the same run it
times the naive quadratic best fit (:func:`~treepack.service.planner.baselines.naive_place`,
every open row checked for every leaf) as the baseline, and reports ``auto``/``bfd`` and
``naive``/``bfd`` time ratios: this machine is shared and noisy, so ratios measured in one
run are the figures to trust, not absolute times.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from functools import partial
from typing import Any, TextIO

from treepack.proto.batch import SequenceBatch, normalize_batch
from treepack.proto.options import PLACEMENTS, PlanOptions
from treepack.service.cli.workloads import Workload, agentic, curriculum, distillation, golden_example
from treepack.service.planner.api import plan_with_tree
from treepack.service.planner.baselines import naive_place
from treepack.service.planner.options import check_options
from treepack.service.planner.tree import build_tree

__all__ = ["run_benchmark", "add_bench_parser"]


def _suite(full: bool) -> list[tuple[str, Callable[[], Workload]]]:
    items: list[tuple[str, Callable[[], Workload]]] = [("golden", golden_example)]
    for n in (12, 48, 192, 768, 3072) + ((7680,) if full else ()):
        items.append((f"curriculum-{n}", partial(curriculum, n)))
    items.append(("agentic-256", lambda: agentic(256)))
    items.append(("distill-512", lambda: distillation(512)))
    return items


def _bench_placement(name: str, w: Workload, batch: SequenceBatch, placement: str, repeats: int) -> dict[str, Any]:
    """Plan ``batch`` ``repeats`` times with ``placement``; the record keeps each phase's best time."""
    phases: dict[str, float] = {}
    plan = None
    for _ in range(repeats):
        t0 = time.perf_counter()
        plan = plan_with_tree(batch, check_options(PlanOptions(seq_len=w.seq_len, placement=placement)), t0=t0).plan
        for k, v in plan.stats.timings_ms.items():
            phases[k] = min(phases.get(k, float("inf")), v)
    assert plan is not None
    return {
        "workload": name,
        "sequences": len(w.sequences),
        "tokens": w.num_tokens,
        "placement": placement,
        "strategy": plan.strategy,
        "rows": plan.num_rows,
        "lower_bound_rows": plan.stats.lower_bound_rows,
        "tree_tokens": plan.stats.tree_tokens,
        "packed_tokens": plan.stats.packed_tokens,
        "tree_ms": phases["tree"],
        "placement_ms": phases["placement"],
        "layout_ms": phases["layout"] + phases["metadata"],
        "total_ms": phases["total"],
        "tree_mtok_per_s": w.num_tokens / phases["tree"] / 1e3 if phases["tree"] else float("inf"),
    }


def _bench_workload(name: str, w: Workload, repeats: int, naive_max_leaves: int, out: TextIO) -> list[dict[str, Any]]:
    """One record per placement for workload ``w``, with the naive best fit's time and the ratios."""
    batch = normalize_batch(w.sequences, seq_len=w.seq_len, trainable=w.trainable, groups=w.groups)
    best: dict[str, dict[str, Any]] = {}
    for placement in PLACEMENTS:
        rec = best[placement] = _bench_placement(name, w, batch, placement, repeats)
        print(
            f"  {placement:9s} rows {rec['rows']:5d} (bound {rec['lower_bound_rows']})  tree {rec['tree_ms']:8.1f} ms"
            f"  placement {rec['placement_ms']:8.1f} ms  layout+meta {rec['layout_ms']:7.1f} ms"
            f"  total {rec['total_ms']:8.1f} ms",
            file=out,
            flush=True,
        )
    naive_ms = None
    if len(w.sequences) <= naive_max_leaves:
        tree = build_tree(batch, 64)
        t0 = time.perf_counter()
        naive_place(tree, batch, w.seq_len, "bfd")
        naive_ms = (time.perf_counter() - t0) * 1e3
        print(f"  naive best-fit (every row per leaf): {naive_ms:,.1f} ms", file=out, flush=True)
    bfd = best["bfd"]["placement_ms"]
    for rec in best.values():
        rec["naive_bfd_ms"] = naive_ms
        rec["auto_over_bfd_time"] = best["auto"]["placement_ms"] / bfd if bfd else None
        rec["naive_over_bfd_time"] = naive_ms / bfd if (naive_ms and bfd) else None
    return list(best.values())


def run_benchmark(
    *,
    full: bool = False,
    repeats: int = 3,
    naive_max_leaves: int = 70_000,
    only: str | None = None,
    out: TextIO = sys.stdout,
    json_path: str | None = None,
) -> list[dict[str, Any]]:
    """Run the suite, printing progress to ``out``; return one record per (workload, placement).

    Args:
        full: add the 10x curriculum (7,680 groups, ~67k completions, ~250M tokens).
        repeats: plans per (workload, placement); the best time of each phase is kept.
        naive_max_leaves: skip the naive best-fit baseline above this many sequences.
        only: run only workloads whose name contains this string.
        out: where progress and the table go.
        json_path: also write the records as JSON there.
    """
    records: list[dict[str, Any]] = []
    for name, make in _suite(full):
        if only and only not in name:
            continue
        t = time.perf_counter()
        w = make()
        print(
            f"[{name}] generated {len(w.sequences):,} sequences, {w.num_tokens:,} tokens "
            f"in {time.perf_counter() - t:.1f}s",
            file=out,
            flush=True,
        )
        records += _bench_workload(name, w, repeats, naive_max_leaves, out)
        del w  # freed before the next workload is generated, not after
    if json_path:
        with open(json_path, "w") as f:
            json.dump(records, f, indent=1)
    return records


def _run_bench(args: argparse.Namespace) -> int:
    run_benchmark(full=args.full, repeats=args.repeats, only=args.only, json_path=args.json)
    return 0


def add_bench_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``bench`` on an argparse sub-parser collection; returns the new parser."""
    b = subparsers.add_parser("bench", help="the planning benchmark")
    b.add_argument("--full", action="store_true", help="add the 10x curriculum (7,680 groups, ~250M tokens)")
    b.add_argument("--repeats", type=int, default=3)
    b.add_argument("--only", help="only workloads whose name contains this")
    b.add_argument("--json", metavar="PATH", help="also write the records as JSON")
    b.set_defaults(func=_run_bench)
    return b
