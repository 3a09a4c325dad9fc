"""CPU benchmark: treepack's own share of a tree-packed training step.

Usage:
    python benchmarks/overhead.py [--hidden 256] [--layers 4] [--scale 64] [--rounds 5]
                                  [--variants tree/varlen,tree/sdpa] [--threads 0] [--json out.json]

Workload and model as ``benchmarks/cpu_train_step.py`` (the golden example with every
length divided by ``--scale``, a random Qwen3). One step = ``packed_forward``, SFT
token-mean loss, backward, on a batch materialized fresh for the step (as a data loader
hands a trainer a new batch every step; ``materialize`` itself is timed apart, it runs in
the loader).

Each round runs, per variant, one plain timed step (``--clock``: wall or process CPU time)
and one step under ``torch.profiler`` (wall-clock ranges).
treepack marks its own work with ``record_function`` ranges; the profiled step is cut into:

- ``walk``: the per-call model checks, hook and patch installation, probe lookup;
- ``metadata``: the plan-derived tensors of the kernels (dense mask, varlen index tables,
  recurrent schedules) built for the batch;
- ``layout``: the varlen path's gathers of queries and ancestor keys/values and the scatter
  back to rows, forward and backward;
- ``dispatch``: the per-module hooks that switch a packed call to tree attention;
- ``loss``: the scored positions' gather, log-softmax and the SFT normalisation, forward
  and backward (a loss every trainer pays; shown apart from treepack's share).

Backward work is attributed to the forward range that created it (autograd sequence
numbers). ``share`` = (walk + metadata + layout + dispatch) / profiled step. Rounds are
interleaved over the variants; the medians and the spread (max - min) / median of the
rounds are reported.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, record_function

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from cpu_train_step import CLOCK, VARLEN, build_model, golden_plans, machine, workload_args  # noqa: E402

from treepack.trainer import materialize  # noqa: E402
from treepack.trainer.hf import packed_forward  # noqa: E402
from treepack.trainer.losses import sft_loss  # noqa: E402

OURS = ("walk", "metadata", "layout", "dispatch")
CATEGORIES = OURS + ("loss",)
PREFIX = "treepack::"
_BACKWARD = "autograd::engine::evaluate_function: "


def step(model, batch, backend: str) -> torch.Tensor:
    logits = packed_forward(model, batch, backend=backend, varlen_fn=VARLEN["batched"])
    with record_function(PREFIX + "loss"):
        loss = sft_loss(batch.target_logprobs(logits), batch, normalization="token")
    loss.backward()
    return loss.detach()


def _range_of(e) -> str | None:
    """The outermost treepack range around event ``e`` (itself included), or None."""
    found = None
    while e is not None:
        if e.name.startswith(PREFIX):
            found = e.name[len(PREFIX) :]
        e = e.cpu_parent
    return found


def breakdown(events) -> dict[str, float]:
    """Milliseconds of each category in one profiled step (module docstring)."""
    ms: dict[str, float] = defaultdict(float)
    # An op that creates no autograd node still reports the next node's sequence number:
    # the last forward op (in start order) with a number is the one that made that node.
    # The forward ends where the first backward node starts (ops inside backward nodes
    # carry their node's number too).
    made_by: dict[tuple[int, int], str | None] = {}
    backward_start = min((e.time_range.start for e in events if e.name.startswith(_BACKWARD)), default=float("inf"))
    for e in sorted(events, key=lambda e: e.time_range.start):
        if e.time_range.start >= backward_start:
            break
        cat = _range_of(e)
        if cat is not None and e.name == PREFIX + cat and _range_of(e.cpu_parent) is None:
            ms[cat] += e.cpu_time_total / 1e3
        if e.sequence_nr >= 0 and not e.name.startswith(_BACKWARD):
            made_by[(e.thread, e.sequence_nr)] = cat
    for e in events:
        if e.name.startswith(_BACKWARD) and e.sequence_nr >= 0:
            cat = made_by.get((e.fwd_thread, e.sequence_nr))
            if cat is not None:
                ms[cat] += e.cpu_time_total / 1e3
    return {c: ms.get(c, 0.0) for c in CATEGORIES}


def one_round(model, case, plan, backend: str, now=time.perf_counter, plain: bool = True) -> dict:
    kw = dict(trainable=case["trainable"], groups=case["groups"])
    t0 = time.perf_counter()
    batch = materialize(plan, case["sequences"], **kw)
    t_mat = time.perf_counter() - t0
    t_step = float("nan")
    if plain:
        model.zero_grad(set_to_none=True)
        t0 = now()
        step(model, batch, backend)
        t_step = now() - t0
        batch = materialize(plan, case["sequences"], **kw)
    model.zero_grad(set_to_none=True)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        t0 = time.perf_counter()
        step(model, batch, backend)
        t_prof = time.perf_counter() - t0
    parts = breakdown(prof.events())
    ours = sum(parts[c] for c in OURS)
    return dict(
        step_ms=t_step * 1e3,
        profiled_ms=t_prof * 1e3,
        materialize_ms=t_mat * 1e3,
        **{f"{c}_ms": v for c, v in parts.items()},
        ours_ms=ours,
        share=ours / (t_prof * 1e3),
    )


def run(
    scale: int,
    hidden: int,
    layers: int,
    vocab: int,
    rounds: int,
    variants: list[str],
    clock: str = "wall",
    plain: bool = True,
) -> dict:
    case, plans = golden_plans(scale, vocab)
    model = build_model(vocab, hidden, layers)
    setups = {
        v: (plans[v.split("/")[0]], "flash" if v.split("/")[1] == "varlen" else v.split("/")[1]) for v in variants
    }
    for plan, backend in setups.values():  # warm-up: the first call of a setup probes it
        one_round(model, case, plan, backend, CLOCK[clock], plain)
    seen: dict[str, list[dict]] = {v: [] for v in variants}
    for _ in range(rounds):
        for v, (plan, backend) in setups.items():
            seen[v].append(one_round(model, case, plan, backend, CLOCK[clock], plain))
    results = []
    for v, rs in seen.items():
        row = dict(variant=v, rows=int(plans[v.split("/")[0]].num_rows))
        for key in rs[0]:
            xs = [r[key] for r in rs]
            med = statistics.median(xs)
            row[key] = med
            row[key + "_spread"] = (max(xs) - min(xs)) / med if med == med and med else 0.0
        results.append(row)
    return dict(
        machine=machine(),
        scale=scale,
        seq_len=case["seq_len"],
        model=dict(hidden=hidden, layers=layers, vocab=vocab),
        rounds=rounds,
        clock=clock,
        results=results,
    )


def walk_costs(depths: list[int], calls: int, scale: int, vocab: int) -> list[dict]:
    """Per packed call, the ``walk`` range alone (median over ``calls`` calls after a warm
    one, forward only, no gradients) of a hidden-64 Qwen3 at each depth: what a call costs
    the host before the model runs, whatever the model's width."""
    case, plans = golden_plans(scale, vocab)
    batch = materialize(plans["tree"], case["sequences"], trainable=case["trainable"], groups=case["groups"])
    out = []
    for n in depths:
        model = build_model(vocab, 64, n)
        with torch.no_grad():
            packed_forward(model, batch, backend="flash", varlen_fn=VARLEN["batched"])
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                for _ in range(calls):
                    packed_forward(model, batch, backend="flash", varlen_fn=VARLEN["batched"])
        ms = sorted(e.cpu_time_total / 1e3 for e in prof.events() if e.name == PREFIX + "walk")
        out.append(dict(layers=n, calls=len(ms), walk_ms=statistics.median(ms), walk_ms_min=ms[0], walk_ms_max=ms[-1]))
    return out


def main(argv: list[str] | None = None) -> dict:
    def extra(ap):
        ap.add_argument("--rounds", type=int, default=5)
        ap.add_argument(
            "--variants",
            default="tree/varlen,tree/sdpa",
            help="comma-separated layout/backend pairs (tree|no_share / varlen|sdpa)",
        )
        ap.add_argument(
            "--no-plain", action="store_true", help="profiled steps only (half the time; no unprofiled step time)"
        )
        ap.add_argument(
            "--walk-depths",
            metavar="N,N",
            help="instead: the per-call model walk of hidden-64 Qwen3s this deep (e.g. 4,32,64)",
        )

    args = workload_args(__doc__.splitlines()[0], argv, extra)
    if args.smoke:
        args.rounds = 1
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.walk_depths:
        walks = walk_costs(
            [int(x) for x in args.walk_depths.split(",")], 21 if not args.smoke else 3, args.scale, args.vocab
        )
        print("| layers | walk per call, ms (median) | min | max |\n|---:|---:|---:|---:|")
        for w in walks:
            print(f"| {w['layers']} | {w['walk_ms']:.2f} | {w['walk_ms_min']:.2f} | {w['walk_ms_max']:.2f} |")
        return dict(machine=machine(), walks=walks)
    out = run(
        args.scale,
        args.hidden,
        args.layers,
        args.vocab,
        args.rounds,
        args.variants.split(","),
        args.clock,
        not args.no_plain,
    )
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    out["load_average"] = load
    print(
        f"# {out['machine']}; golden / {out['scale']} (rows of {out['seq_len']}), "
        f"Qwen3 hidden {args.hidden} x {args.layers} layers, median of {args.rounds} rounds (spread), "
        f"step clock {args.clock}, load {load:.1f}"
    )
    print(
        "| variant | step ms | profiled ms | walk | metadata | layout | dispatch | "
        "treepack share | loss | materialize (loader) |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in out["results"]:
        cell = lambda k: f"{r[k]:.1f} ({r[k + '_spread']:.0%})"  # noqa: E731
        print(
            f"| {r['variant']} | {cell('step_ms')} | {cell('profiled_ms')} | "
            f"{r['walk_ms']:.1f} | {r['metadata_ms']:.1f} | {r['layout_ms']:.1f} | "
            f"{r['dispatch_ms']:.1f} | **{r['share']:.1%}** ({r['share_spread']:.0%}) | "
            f"{r['loss_ms']:.1f} | {r['materialize_ms']:.1f} |"
        )
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2))
    return out


if __name__ == "__main__":
    main()
