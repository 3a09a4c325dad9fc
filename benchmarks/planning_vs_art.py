"""treepack's planner against ART's prefix-tree packing planner, side by side on one batch.

Usage:
    pip download openpipe-art==0.5.23 --no-deps --python-version 3.12 --only-binary=:all: -d /tmp/art
    unzip -q /tmp/art/openpipe_art-0.5.23-py3-none-any.whl -d /tmp/art/wheel
    python benchmarks/planning_vs_art.py --art /tmp/art/wheel [--groups 768] [--repeats 5] [--json out.json]

ART (OpenPipe's Agent Reinforcement Trainer) plans its prefix-tree packed rows in
``art.preprocessing.pack._prefix_tree_pack_rows``: a radix walk over the sequences
(``art.megatron.prefix_tree_packing``), best fit of leaves grouped by prompt, and each
row's tree built again. Its package imports its whole training stack, so only those two
modules are loaded, from an unpacked wheel, with stand-ins for the names they import but
this call does not use (MoE routing, tokenizer results, a type alias). It is given what it
plans from (token tuples, a prompt id and a shareable length per sequence: the prompt minus
one token, as ART computes it for prompt-only masks), built before timing; treepack's
``plan_batch`` gets the sequences as numpy arrays and does everything from there
(normalization, tree, bound, placement, layout, metadata).

Each repeat times ART once, then treepack three times (treepack's runs are short; their
median is the figure), alternating so that both see the same load. Printed: rows and
wall ms (median, min-max) of each, and the ratio of the medians.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import pathlib
import platform
import statistics
import sys
import time
import types
from typing import NamedTuple

from treepack.service.cli.workloads import curriculum
from treepack.service.planner import plan_batch


class ArtItem(NamedTuple):
    """What ART's row planner reads of a sequence."""

    token_ids: tuple[int, ...]
    prompt_id: int
    shareable_length: int


def load_art(root: pathlib.Path) -> types.ModuleType:
    """ART's ``pack`` module from an unpacked wheel at ``root``, without its package imports."""

    def package(name: str, path: pathlib.Path) -> None:
        mod = types.ModuleType(name)
        mod.__path__ = [str(path)]
        sys.modules[name] = mod

    package("art", root / "art")
    package("art.preprocessing", root / "art" / "preprocessing")
    package("art.megatron", root / "art" / "megatron")
    stand_ins = {
        "art.types": ("Verbosity",),
        "art.preprocessing.tokenize": ("TokenizedResult",),
        "art.preprocessing.moe_routing": (
            "MoeRouteArray",
            "MoeRouteSegments",
            "MoeRoutingPackStats",
            "PackedMoeRoutingReplay",
            "deterministic_moe_routes",
            "moe_route_dtype",
        ),
    }
    for name, names in stand_ins.items():
        mod = types.ModuleType(name)
        for n in names:
            setattr(mod, n, object)
        sys.modules[name] = mod
    for name in ("art.megatron.prefix_tree_packing", "art.preprocessing.pack"):
        spec = importlib.util.spec_from_file_location(name, root / (name.replace(".", "/") + ".py"))
        assert spec is not None and spec.loader is not None, name
        mod = importlib.util.module_from_spec(spec)
        sys.modules[name] = mod
        spec.loader.exec_module(mod)
    return sys.modules["art.preprocessing.pack"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--art", type=pathlib.Path, required=True, help="an unpacked openpipe-art wheel")
    ap.add_argument("--groups", type=int, default=768)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json", metavar="PATH")
    args = ap.parse_args()
    pack = load_art(args.art)
    w = curriculum(args.groups)
    items = [ArtItem(tuple(s.tolist()), g, t - 1) for s, g, t in zip(w.sequences, w.groups, w.trainable)]
    kw = w.plan_kwargs()
    art_ms: list[float] = []
    tp_ms: list[float] = []
    art_rows = tp_rows = 0
    for _ in range(args.repeats):
        t = time.perf_counter()
        rows = pack._prefix_tree_pack_rows(items, seq_len=w.seq_len, pack_results=True, min_shared_segment_length=64)
        art_ms.append((time.perf_counter() - t) * 1e3)
        art_rows = len(rows)
        for _ in range(3):
            t = time.perf_counter()
            plan = plan_batch(**kw)
            tp_ms.append((time.perf_counter() - t) * 1e3)
            tp_rows = plan.num_rows
    a, b = statistics.median(art_ms), statistics.median(tp_ms)
    print(
        f"# {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}  {platform.machine()}  python "
        f"{platform.python_version()}  {w.name}: {len(w.sequences):,} sequences, {w.num_tokens:,} tokens"
    )
    print(f"ART       rows {art_rows:4d}  ms {a:8.1f} ({min(art_ms):.1f}-{max(art_ms):.1f})")
    print(f"treepack  rows {tp_rows:4d}  ms {b:8.1f} ({min(tp_ms):.1f}-{max(tp_ms):.1f})")
    print(f"ratio of medians: {a / b:.1f}x")
    if args.json:
        pathlib.Path(args.json).write_text(
            json.dumps(dict(art_rows=art_rows, art_ms=art_ms, treepack_rows=tp_rows, treepack_ms=tp_ms), indent=1)
        )


if __name__ == "__main__":
    main()
