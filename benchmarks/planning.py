"""Planning benchmark: tree, placement and layout times and rows for every placement.

Usage:
    python benchmarks/planning.py [--full] [--repeats 3] [--json out.json] [--only NAME]

Same as ``treepack bench``. Workloads come from ``treepack.service.cli.workloads``
(documented there); ``--full`` adds the 10x curriculum (7,680 groups, ~67k completions).
Each (workload, placement) is planned ``repeats`` times and the best time of each phase is
kept; the naive quadratic best fit is timed in the same run as the baseline.
"""

from __future__ import annotations

import argparse

from treepack.service.cli.bench import run_benchmark


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--full", action="store_true")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", metavar="PATH")
    ap.add_argument("--only")
    args = ap.parse_args()
    run_benchmark(full=args.full, repeats=args.repeats, json_path=args.json, only=args.only)


if __name__ == "__main__":
    main()
