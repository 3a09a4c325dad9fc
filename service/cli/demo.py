"""``treepack demo``: the golden example and a realistic multi-task batch on the embedded planner.

For each batch and each placement: rows, the lower bound, tokens, savings and timings;
then how many fewer rows ``auto`` needs than plain packing. ``--png`` draws the rows.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from typing import Any

from treepack.proto.options import PLACEMENTS
from treepack.service.cli.report import PLOT_HINT, draw_rows, plans_table
from treepack.service.cli.workloads import curriculum, golden_example
from treepack.service.planner import plan_batch

__all__ = ["run_demo", "add_demo_parser"]


def run_demo(args: argparse.Namespace) -> int:
    """Print both batches' tables (and draw them with ``--png``); 0, or 2 when ``--png`` cannot draw."""
    if args.png and importlib.util.find_spec("matplotlib") is None:  # say so before any work
        print(f"treepack demo: error: --png needs matplotlib, which is not installed: {PLOT_HINT}", file=sys.stderr)
        return 2
    gold = golden_example()
    print("Golden example: 32 sequences, 4 groups, C = 131,072")
    plans = [(p, plan_batch(**gold.plan_kwargs(), placement=p)) for p in PLACEMENTS]
    print(plans_table([("golden", p) for _, p in plans]))
    for name, p in plans:
        print(f"  {name:9s} row tokens: {', '.join(f'{int(x):,}' for x in p.row_len)}")
    print()
    w = curriculum(args.groups, seed=args.seed)
    print(
        f"Multi-task GRPO curriculum: {args.groups} groups, {len(w.sequences):,} completions, "
        f"{w.num_tokens:,} tokens, C = {w.seq_len:,}"
    )
    realistic = [(p, plan_batch(**w.plan_kwargs(), placement=p)) for p in PLACEMENTS]
    print(plans_table([(w.name, p) for _, p in realistic]))
    base = dict(realistic)["no_share"].num_rows
    best = dict(realistic)["auto"]
    print(
        f"\nauto needs {best.num_rows} rows where plain packing needs {base}: "
        f"{100.0 * (1 - best.num_rows / base):.1f}% fewer rows, "
        f"{100.0 * best.stats.saved_fraction:.1f}% fewer tokens to compute."
    )
    if args.png:
        draw_rows(dict(plans)["auto"], args.png, groups=gold.groups, title="golden example, auto")
        root, dot, ext = args.png.rpartition(".")
        other = f"{root}-curriculum.{ext}" if dot else f"{args.png}-curriculum"
        draw_rows(best, other, groups=w.groups, title=f"{w.name}, auto")
        print(f"wrote {args.png} and {other}")
    return 0


def add_demo_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``demo`` on an argparse sub-parser collection; returns the new parser."""
    d = subparsers.add_parser("demo", help="golden example + a realistic batch on the embedded planner")
    d.add_argument("--groups", type=int, default=768, help="groups in the realistic batch (default 768, ~25M tokens)")
    d.add_argument("--seed", type=int, default=0)
    d.add_argument(
        "--png", metavar="PATH", help="draw the rows (golden to PATH, the realistic batch to PATH-curriculum)"
    )
    d.set_defaults(func=run_demo)
    return d
