"""``treepack plan FILE --seq-len N``: plan a JSONL batch on the embedded planner.

The input: one sequence per line, ``{"tokens": [...], "trainable": [0/1, ...]}`` or
``{"tokens": [...], "prompt_len": n}``, optional ``"group"``; blank lines are skipped;
``-`` reads stdin. Errors name the line (``line 3.trainable``), not the sequence index.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from typing import Any, Iterable

import numpy as np

from treepack.proto.errors import RequestError
from treepack.service.cli.report import plan_summary, plans_table, rows_table
from treepack.service.planner import plan_batch
from treepack.proto.options import PLACEMENTS

__all__ = ["read_jsonl", "run_plan", "add_plan_parser"]

_FIELDS = {"tokens", "trainable", "prompt_len", "group"}


def _trainable_of(obj: dict[str, Any], where: str, length: int) -> tuple[Any, bool]:
    """(the line's trainable flags or prompt length, whether the line gave one)."""
    if "trainable" in obj and "prompt_len" in obj:
        raise RequestError('give "trainable" or "prompt_len", not both', path=where, rule="exclusive")
    if "trainable" in obj:
        tr = obj["trainable"]
        if not isinstance(tr, list) or not all(t in (0, 1) for t in tr):
            raise RequestError('"trainable" must be a list of 0/1', path=f"{where}.trainable", rule="type")
        return np.asarray(tr, dtype=bool), True
    if "prompt_len" in obj:
        p = obj["prompt_len"]
        if not isinstance(p, int) or isinstance(p, bool):
            raise RequestError('"prompt_len" must be an integer', path=f"{where}.prompt_len", rule="type")
        return p, True
    return length, False  # nothing trainable


def read_jsonl(lines: Iterable[str]) -> tuple[list[np.ndarray], list[Any] | None, list[Any] | None]:
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
        unknown = set(obj) - _FIELDS
        if unknown:
            raise RequestError(f"unknown field(s) {sorted(unknown)}", path=where, rule="unknown_field")
        toks = obj.get("tokens")
        if not isinstance(toks, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in toks):
            raise RequestError('"tokens" must be a list of integers', path=f"{where}.tokens", rule="type")
        seqs.append(np.asarray(toks, dtype=np.int64) if toks else np.zeros(0, dtype=np.int64))
        flags, given = _trainable_of(obj, where, len(toks))
        trainable.append(flags)
        any_train |= given
        groups.append(obj.get("group"))
        any_group |= obj.get("group") is not None
    return seqs, (trainable if any_train else None), (groups if any_group else None)


def _line_of(path: str, line_numbers: list[int]) -> str:
    """The planner's ``$.sequences[i]...`` as the input line it came from."""
    m = re.match(r"\$\.sequences\[(\d+)\](.*)", path)
    if m and int(m.group(1)) < len(line_numbers):
        return f"line {line_numbers[int(m.group(1))]}{m.group(2)}"
    return path


def run_plan(args: argparse.Namespace) -> int:
    """Plan the file, print the tables (or ``--json``); 2 on bad input, naming the line."""
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
    if args.json:
        print(json.dumps(plan_summary(plan)))
        return 0
    print(plans_table([("input", plan)]))
    print()
    print(rows_table(plan))
    for e in plan.overflow:
        print(f"note: sequence at line {line_numbers[e.index]} ({e.length} tokens) was {e.action}d", file=sys.stderr)
    return 0


def add_plan_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``plan`` on an argparse sub-parser collection; returns the new parser."""
    p = subparsers.add_parser("plan", help="plan a JSONL batch")
    p.add_argument("file", help="JSONL file, one sequence per line ('-' for stdin)")
    p.add_argument("--seq-len", type=int, required=True, help="row capacity C")
    p.add_argument("--placement", default="auto", choices=PLACEMENTS)
    p.add_argument("--min-shared-len", type=int, default=64)
    p.add_argument("--num-ranks", type=int, default=1)
    p.add_argument("--on-overflow", default="error", choices=("error", "truncate", "drop"))
    p.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    p.set_defaults(func=run_plan)
    return p
