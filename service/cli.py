"""The ``treepack`` command line.

- ``treepack demo [--groups N] [--png PATH]`` — the golden example and a realistic
  multi-task batch on the embedded planner: rows, tokens, savings, bound and timings per
  placement.
- ``treepack plan FILE --seq-len N [--placement P] [--min-shared-len K] [--json]`` — plan
  a JSONL batch (one sequence per line: ``{"tokens": [...], "trainable": [0/1, ...]}`` or
  ``{"tokens": [...], "prompt_len": n}``, optional ``"group"``; ``-`` reads stdin).
- ``treepack bench [--full] [--repeats K] [--json PATH]`` — the planning benchmark.
- ``treepack serve ...`` — the HTTP sidecar (needs the ``service`` extra).

Exit codes: 0 ok, 2 bad input or usage (the message names the line and the rule).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from typing import Any, Sequence

import numpy as np

from treepack.proto.errors import RequestError
from treepack.service.planner import plan_batch
from treepack.service.planner.placement import PLACEMENTS
from treepack.service.planner.workloads import curriculum, golden_example
from treepack.service.report import draw_rows, format_table, plan_summary

__all__ = ["main", "build_parser", "read_jsonl"]


def read_jsonl(lines: Sequence[str] | Any) -> tuple[list[np.ndarray], list[Any] | None, list[Any] | None]:
    """Parse the ``treepack plan`` input format.

    Returns:
        (token arrays, trainable per sequence or None if no line gives any, groups or None).

    Raises:
        RequestError: naming the line for malformed JSON or fields.
    """
    seqs: list[np.ndarray] = []
    trainable: list[Any] = []
    groups: list[Any] = []
    any_train = any_group = False
    for n, raw in enumerate(lines, start=1):
        if not raw.strip():
            continue
        where = f"line {n}"
        try:
            obj = json.loads(raw)
        except json.JSONDecodeError as exc:
            raise RequestError(f"invalid JSON: {exc.msg} (column {exc.colno})", path=where, rule="json") from None
        if not isinstance(obj, dict):
            raise RequestError(f"expected a JSON object, got {type(obj).__name__}", path=where, rule="type")
        unknown = set(obj) - {"tokens", "trainable", "prompt_len", "group"}
        if unknown:
            raise RequestError(f"unknown field(s) {sorted(unknown)}", path=where, rule="unknown_field")
        toks = obj.get("tokens")
        if not isinstance(toks, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in toks):
            raise RequestError('"tokens" must be a list of integers', path=f"{where}.tokens", rule="type")
        seqs.append(np.asarray(toks, dtype=np.int64) if toks else np.zeros(0, dtype=np.int64))
        if "trainable" in obj and "prompt_len" in obj:
            raise RequestError('give "trainable" or "prompt_len", not both', path=where, rule="exclusive")
        if "trainable" in obj:
            tr = obj["trainable"]
            if not isinstance(tr, list) or not all(t in (0, 1) for t in tr):
                raise RequestError('"trainable" must be a list of 0/1', path=f"{where}.trainable", rule="type")
            trainable.append(np.asarray(tr, dtype=bool))
            any_train = True
        elif "prompt_len" in obj:
            p = obj["prompt_len"]
            if not isinstance(p, int) or isinstance(p, bool):
                raise RequestError('"prompt_len" must be an integer', path=f"{where}.prompt_len", rule="type")
            trainable.append(p)
            any_train = True
        else:
            trainable.append(len(toks))  # nothing trainable
        g = obj.get("group")
        groups.append(g)
        any_group |= g is not None
    return seqs, (trainable if any_train else None), (groups if any_group else None)


def _line_of(path: str, line_numbers: list[int]) -> str:
    m = re.match(r"\$\.sequences\[(\d+)\](.*)", path)
    if m and int(m.group(1)) < len(line_numbers):
        return f"line {line_numbers[int(m.group(1))]}{m.group(2)}"
    return path


def _cmd_plan(args: argparse.Namespace) -> int:
    src = sys.stdin if args.file == "-" else open(args.file, encoding="utf-8")
    with src:
        raw = src.read().splitlines()
    line_numbers = [i for i, ln in enumerate(raw, start=1) if ln.strip()]
    try:
        seqs, trainable, groups = read_jsonl(raw)
        plan = plan_batch(
            seqs,
            seq_len=args.seq_len,
            placement=args.placement,
            min_shared_len=args.min_shared_len,
            trainable=trainable,
            groups=groups,
            num_ranks=args.num_ranks,
            on_overflow=args.on_overflow,
        )
    except RequestError as exc:
        print(f"treepack plan: error: {exc.message} - at {_line_of(exc.path, line_numbers)} [{exc.rule}]", file=sys.stderr)
        return 2
    summary = plan_summary(plan)
    if args.json:
        print(json.dumps(summary))
        return 0
    print(_plan_table([("input", plan)]))
    print()
    print(format_table(["row", "tokens", "fill %", "segments"], [
        (r, int(plan.row_len[r]), 100.0 * plan.row_len[r] / plan.seq_len, int(plan.segments.row_ptr[r + 1] - plan.segments.row_ptr[r]))
        for r in range(plan.num_rows)
    ]))
    for e in plan.overflow:
        print(f"note: sequence at line {line_numbers[e.index]} ({e.length} tokens) was {e.action}d", file=sys.stderr)
    return 0


def _plan_table(items: list[tuple[str, Any]]) -> str:
    rows = []
    for name, p in items:
        st = p.stats
        rows.append((
            name, p.placement if p.placement != "auto" else f"auto:{p.strategy}", st.rows, st.lower_bound_rows,
            st.packed_tokens, st.unpacked_tokens, st.tree_tokens, 100.0 * st.saved_fraction,
            st.timings_ms["tree"], st.timings_ms["placement"], st.timings_ms["total"],
        ))
    return format_table(
        ["batch", "placement", "rows", "bound", "packed", "unpacked", "tree", "saved %", "tree ms", "place ms", "total ms"], rows
    )


def _cmd_demo(args: argparse.Namespace) -> int:
    gold = golden_example()
    print("Golden example (SPEC section 4): 32 sequences, 4 groups, C = 131,072")
    plans = [(p, plan_batch(**gold.plan_kwargs(), placement=p)) for p in PLACEMENTS]
    print(_plan_table([("golden", p) for _, p in plans]))
    for name, p in plans:
        print(f"  {name:9s} row tokens: {', '.join(f'{int(x):,}' for x in p.row_len)}")
    print()
    w = curriculum(args.groups, seed=args.seed)
    print(
        f"Multi-task GRPO curriculum: {args.groups} groups, {len(w.sequences):,} completions, "
        f"{w.num_tokens:,} tokens, C = {w.seq_len:,}"
    )
    realistic = [(p, plan_batch(**w.plan_kwargs(), placement=p)) for p in PLACEMENTS]
    print(_plan_table([(w.name, p) for _, p in realistic]))
    base = dict(realistic)["no_share"].num_rows
    best = dict(realistic)["auto"]
    print(
        f"\nauto needs {best.num_rows} rows where plain packing needs {base}: "
        f"{100.0 * (1 - best.num_rows / base):.1f}% fewer rows, {100.0 * best.stats.saved_fraction:.1f}% fewer tokens to compute."
    )
    if args.png:
        draw_rows(dict(plans)["auto"], args.png, groups=gold.groups, title="golden example, auto")
        root, dot, ext = args.png.rpartition(".")
        other = f"{root}-curriculum.{ext}" if dot else f"{args.png}-curriculum"
        draw_rows(best, other, groups=w.groups, title=f"{w.name}, auto")
        print(f"wrote {args.png} and {other}")
    return 0


def _cmd_bench(args: argparse.Namespace) -> int:
    from treepack.service.bench import run_benchmark

    run_benchmark(full=args.full, repeats=args.repeats, only=args.only, json_path=args.json)
    return 0


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="treepack", description="Prefix-tree packing of LLM training batches.")
    sub = ap.add_subparsers(dest="command", required=True)

    d = sub.add_parser("demo", help="golden example + a realistic batch on the embedded planner")
    d.add_argument("--groups", type=int, default=768, help="groups in the realistic batch (default 768, ~25M tokens)")
    d.add_argument("--seed", type=int, default=0)
    d.add_argument("--png", metavar="PATH", help="draw the rows (golden to PATH, the realistic batch to PATH-curriculum)")
    d.set_defaults(func=_cmd_demo)

    p = sub.add_parser("plan", help="plan a JSONL batch")
    p.add_argument("file", help="JSONL file, one sequence per line ('-' for stdin)")
    p.add_argument("--seq-len", type=int, required=True, help="row capacity C")
    p.add_argument("--placement", default="auto", choices=PLACEMENTS)
    p.add_argument("--min-shared-len", type=int, default=64)
    p.add_argument("--num-ranks", type=int, default=1)
    p.add_argument("--on-overflow", default="error", choices=("error", "truncate", "drop"))
    p.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    p.set_defaults(func=_cmd_plan)

    b = sub.add_parser("bench", help="the planning benchmark")
    b.add_argument("--full", action="store_true", help="add the 10x curriculum (7,680 groups, ~250M tokens)")
    b.add_argument("--repeats", type=int, default=3)
    b.add_argument("--only", help="only workloads whose name contains this")
    b.add_argument("--json", metavar="PATH", help="also write the records as JSON")
    b.set_defaults(func=_cmd_bench)

    try:
        import treepack.service.settings  # noqa: F401  (pydantic-settings: the service extra)
        from treepack.service.serve import add_serve_parser
    except ImportError as exc:  # planner-only install: say what to install, do not break demo/plan
        missing = exc.name or str(exc)
        srv = sub.add_parser("serve", help="the HTTP sidecar (needs: pip install 'treepack[service]')")
        srv.set_defaults(func=lambda _args: _missing_service(missing))
    else:
        add_serve_parser(sub)
    return ap


def _missing_service(missing: str) -> int:
    print(f"treepack serve: error: the service extra is not installed ({missing} is missing): pip install 'treepack[service]'", file=sys.stderr)
    return 2


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
