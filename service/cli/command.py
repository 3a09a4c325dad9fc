"""The ``treepack`` command: its parser and :func:`main`.

Each command registers itself (``add_*_parser``) from its own module: :mod:`.demo`,
:mod:`.plan`, :mod:`.bench`, :mod:`.check` (it imports the trainer extra when it runs), and
``serve`` from :mod:`treepack.service.serve` when the ``service`` extra is installed
(otherwise ``serve`` says what to install).
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from collections.abc import Sequence

from treepack.service.cli.bench import add_bench_parser
from treepack.service.cli.check import add_check_parser
from treepack.service.cli.demo import add_demo_parser
from treepack.service.cli.plan import add_plan_parser

__all__ = ["main", "build_parser", "plain_text"]


def build_parser() -> argparse.ArgumentParser:
    """The parser of every command; each sub-parser's ``func`` runs it and returns the exit status."""
    ap = argparse.ArgumentParser(prog="treepack", description="Prefix-tree packing of LLM training batches.")
    sub = ap.add_subparsers(dest="command", required=True)
    add_demo_parser(sub)
    add_plan_parser(sub)
    add_bench_parser(sub)
    add_check_parser(sub)
    try:
        import treepack.service.settings  # noqa: F401  (pydantic-settings: the service extra)
        from treepack.service.serve import add_serve_parser
    except ImportError as exc:  # planner-only install: say what to install, do not break demo/plan
        missing = exc.name or str(exc)
        srv = sub.add_parser(
            "serve", help="the HTTP sidecar (needs the service extra: pip install -e '.[service]' in the clone)"
        )
        srv.set_defaults(func=lambda _args: _missing_service(missing))
    else:
        add_serve_parser(sub)
    for p in [ap, *sub.choices.values()]:  # descriptions come from docstrings: print them plain
        p.description = plain_text(p.description)
    return ap


def plain_text(text: str | None) -> str | None:
    """Docstring reST as plain terminal text: ``:class:`~.settings.Settings` `` -> ``Settings``, ````x```` -> ``x``."""
    if text is None:
        return None
    text = re.sub(r":[a-z]+:`~?\.?([^`]*?)`", lambda m: m.group(1).rsplit(".", 1)[-1], text)
    return text.replace("``", "")


def _missing_service(missing: str) -> int:
    print(
        f"treepack serve: error: the service extra is not installed ({missing} is missing): "
        "pip install -e '.[service]' in the clone",
        file=sys.stderr,
    )
    return 2


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``treepack`` with ``argv`` (default: the process's arguments); returns the exit status."""
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except BrokenPipeError:  # `treepack ... | head`: the reader left; no traceback
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141
