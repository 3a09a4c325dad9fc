"""``treepack plan FILE --seq-len N``: plan a JSONL batch on the embedded planner.

The input: one sequence per line, ``{"tokens": [...], "trainable": [0/1, ...]}``,
``{"tokens": [...], "trainable": true|false}`` or ``{"tokens": [...], "prompt_len": n}``,
optional ``"group"``; blank lines are skipped; ``-`` reads stdin. A line that gives neither
``prompt_len`` nor ``trainable`` is an error unless ``--no-trainable`` or ``--all-trainable``
says what it means. Every planner option is a flag (``--min-shared-len``, ``--share-trainable``,
``--repair-ms`` ...). Errors name the file, the line and the element (``line 3.tokens[7]``),
not the sequence index, spell options as the flags that set them (``--on-overflow truncate``,
not ``on_overflow='truncate'``), and exit with status 2.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Iterable
from typing import Any

import numpy as np

from treepack.proto.errors import RequestError
from treepack.proto.options import CP_ATTENTION, ON_OVERFLOW, OPTION_NAMES, PLACEMENTS, REPAIR_MS
from treepack.service.cli.report import plan_summary, plans_table, rows_table
from treepack.service.planner import plan_batch

__all__ = ["read_jsonl", "run_plan", "add_plan_parser", "as_flags"]

_FIELDS = {"tokens", "trainable", "prompt_len", "group"}

#: ``--no-trainable`` / ``--all-trainable``: what a line that says nothing about training means.
_DEFAULTS = {None: None, "none": False, "all": True}


def _tokens_of(obj: dict[str, Any], where: str) -> np.ndarray:
    """The line's token ids; errors name the element (``line 3.tokens[7]``)."""
    if "tokens" not in obj:
        raise RequestError('"tokens" is missing', path=f"{where}.tokens", rule="missing")
    toks = obj["tokens"]
    if not isinstance(toks, list):
        raise RequestError(
            f'"tokens" must be a list of integers, got {type(toks).__name__}', path=f"{where}.tokens", rule="type"
        )
    for i, t in enumerate(toks):
        if not isinstance(t, int) or isinstance(t, bool):
            raise RequestError(f"expected an integer token id, got {t!r}", path=f"{where}.tokens[{i}]", rule="type")
        if not 0 <= t < 2**32:
            raise RequestError(f"token id must be in [0, 2**32), got {t}", path=f"{where}.tokens[{i}]", rule="range")
    return np.asarray(toks, dtype=np.int64) if toks else np.zeros(0, dtype=np.int64)


def _trainable_of(obj: dict[str, Any], where: str, length: int, default: bool | None) -> Any:
    """The line's trainable flags or prompt length (``prompt_len == length``: nothing trainable)."""
    if "trainable" in obj and "prompt_len" in obj:
        raise RequestError('give "trainable" or "prompt_len", not both', path=where, rule="exclusive")
    if "trainable" in obj:
        tr = obj["trainable"]
        if isinstance(tr, bool):  # the whole sequence, said explicitly
            return np.full(length, tr, dtype=bool)
        if not isinstance(tr, list):
            raise RequestError(
                f'"trainable" must be a list of 0/1 or true/false, got {type(tr).__name__}',
                path=f"{where}.trainable",
                rule="type",
            )
        for i, t in enumerate(tr):
            if t not in (0, 1) or isinstance(t, float):
                raise RequestError(f"expected 0 or 1, got {t!r}", path=f"{where}.trainable[{i}]", rule="type")
        return np.asarray(tr, dtype=bool)
    if "prompt_len" in obj:
        p = obj["prompt_len"]
        if not isinstance(p, int) or isinstance(p, bool):
            raise RequestError(f'"prompt_len" must be an integer, got {p!r}', path=f"{where}.prompt_len", rule="type")
        return p
    if default is None:
        raise RequestError(
            'give "prompt_len" or "trainable" (a 0/1 list, or true/false for the whole sequence), '
            "or pass --no-trainable / --all-trainable for lines that give neither",
            path=f"{where}.trainable",
            rule="missing",
        )
    return np.full(length, default, dtype=bool)


def read_jsonl(
    lines: Iterable[str], default_trainable: bool | None = None
) -> tuple[list[np.ndarray], list[Any], list[Any] | None]:
    """Parse the ``treepack plan`` input format.

    Args:
        lines: the file's lines (blank ones are skipped).
        default_trainable: the trainable flag of every token of a line that gives neither
            ``prompt_len`` nor ``trainable``; None (default) makes such a line an error.

    Returns:
        (token arrays, trainable per sequence, groups or None when no line gives one).

    Raises:
        RequestError: naming the line (and the element) for malformed JSON or fields.
    """
    seqs: list[np.ndarray] = []
    trainable: list[Any] = []
    groups: list[Any] = []
    any_group = False
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
        toks = _tokens_of(obj, where)
        seqs.append(toks)
        trainable.append(_trainable_of(obj, where, len(toks), default_trainable))
        groups.append(obj.get("group"))
        any_group |= obj.get("group") is not None
    return seqs, trainable, (groups if any_group else None)


def _line_of(path: str, line_numbers: list[int]) -> str:
    """The planner's ``$.sequences[i]...`` as the input line it came from."""
    m = re.match(r"\$\.sequences\[(\d+)\](.*)", path)
    if m and int(m.group(1)) < len(line_numbers):
        rest = m.group(2)
        return f"line {line_numbers[int(m.group(1))]}{'.tokens' if rest.startswith('[') else ''}{rest}"
    return path


def _flag(option: str) -> str:
    return "--" + option.replace("_", "-")


def as_flags(text: str) -> str:
    """A planner message with its option names spelled as this command's flags.

    ``min_shared_len must be >= 1`` -> ``--min-shared-len must be >= 1``;
    ``set on_overflow='truncate' or 'drop'`` -> ``set --on-overflow truncate or --on-overflow drop``.
    """
    for name in sorted(OPTION_NAMES, key=len, reverse=True):
        flag = _flag(name)
        text = re.sub(rf"\b{name}=(['\"]?)([\w.]+)\1", rf"{flag} \2", text)
        text = re.sub(rf"\b{name}\b", flag, text)
    return re.sub(r"(--[\w-]+) ([\w.]+) or '([\w.]+)'", r"\1 \2 or \1 \3", text)


def _error_line(exc: RequestError, file: str, line_numbers: list[int]) -> str:
    """``treepack plan: error: <message> - at <file>, line 3.tokens[7] [rule]``; an option's error
    names its flag instead of a place in the file."""
    m = re.fullmatch(r"\$\.(\w+)", exc.path)
    if m and m.group(1) in OPTION_NAMES:
        msg, flag = as_flags(exc.message), _flag(m.group(1))
        return f"treepack plan: error: {msg if flag in msg else f'{flag}: {msg}'} [{exc.rule}]"
    where = "" if file == "-" else f"{file}, "
    return f"treepack plan: error: {as_flags(exc.message)} - at {where}{_line_of(exc.path, line_numbers)} [{exc.rule}]"


def run_plan(args: argparse.Namespace) -> int:
    """Plan the file, print the tables (or ``--json``); 2 on bad input, naming the line."""
    try:
        if args.file == "-":
            raw = sys.stdin.read().splitlines()
        else:
            with open(args.file, encoding="utf-8") as src:
                raw = src.read().splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        print(f"treepack plan: error: cannot read {args.file}: {reason}", file=sys.stderr)
        return 2
    line_numbers = [i for i, ln in enumerate(raw, start=1) if ln.strip()]
    try:
        seqs, trainable, groups = read_jsonl(raw, _DEFAULTS[args.default_trainable])
        plan = plan_batch(
            seqs,
            seq_len=args.seq_len,
            placement=args.placement,
            min_shared_len=args.min_shared_len,
            trainable=trainable,
            groups=groups,
            num_ranks=args.num_ranks,
            cp_size=args.cp_size,
            cp_attention=args.cp_attention,
            on_overflow=args.on_overflow,
            share_trainable=args.share_trainable,
            min_shared_saving=args.min_shared_saving,
            repair_ms=args.repair_ms,
            conv_width=args.conv_width,
        )
    except RequestError as exc:
        print(_error_line(exc, args.file, line_numbers), file=sys.stderr)
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
    p.add_argument("--min-shared-len", type=int, default=64, help="no shared segment shorter than this")
    p.add_argument(
        "--min-shared-saving",
        type=int,
        default=0,
        help="also share a run shorter than --min-shared-len when (sharers - 1) x length >= this (0: off)",
    )
    p.add_argument(
        "--share-trainable",
        action="store_true",
        help="the generalized mode: trainable tokens shared up to a scored divergence",
    )
    p.add_argument(
        "--repair-ms",
        type=float,
        default=REPAIR_MS,
        help=f"CPU-ms budget of auto's repair pass (0: none; default {REPAIR_MS:g})",
    )
    p.add_argument("--conv-width", type=int, default=4, help="GDN short-conv width W (the conv context it plans)")
    p.add_argument("--num-ranks", type=int, default=1, help="data-parallel ranks to deal rows to")
    p.add_argument(
        "--cp-attention",
        default="auto",
        choices=CP_ATTENTION,
        help="attention under CP: ulysses, allgather (shards balanced by attention work) or auto",
    )
    p.add_argument(
        "--cp-size",
        type=int,
        default=1,
        help="context-parallel group size: each row split into this many equal, aligned shards",
    )
    p.add_argument("--on-overflow", default="error", choices=ON_OVERFLOW)
    p.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    dflt = p.add_mutually_exclusive_group()
    dflt.add_argument(
        "--no-trainable",
        dest="default_trainable",
        action="store_const",
        const="none",
        help="a line without prompt_len or trainable has no trainable token (default: such a line is an error)",
    )
    dflt.add_argument(
        "--all-trainable",
        dest="default_trainable",
        action="store_const",
        const="all",
        help="a line without prompt_len or trainable is trainable throughout",
    )
    p.set_defaults(func=run_plan)
    return p
