"""CPU benchmark: the cost of the run-time probe against one training step.

Usage:
    python benchmarks/probe_cost.py [--scale 64] [--hidden 256] [--layers 4] [--repeats 3] [--json out.json] [--smoke]

The model and step are those of ``benchmarks/cpu_train_step.py`` (a Qwen3 of ``--hidden`` x
``--layers``, the golden example scaled by ``--scale``, one tree-packed SDPA step: forward,
SFT loss, backward). Measured in the same run, each ``--repeats`` times:

- ``step``: one packed training step (the probe already done for this setup);
- ``probe``: :func:`~treepack.trainer.hf.forward.verify_model` on a fresh setup (the
  remembered probes dropped first), in eval and in train mode with gradient checkpointing.

Time: median and range of the repeats. Memory: the growth of the peak resident set of a
fresh process over the same model and batch, for one step and for one probe (each in its
own child process, ``ru_maxrss``), so each figure is that operation's own peak.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from cpu_train_step import build_model, packed_step  # noqa: E402
from golden_scaled import scaled_golden  # noqa: E402

from treepack.service.planner import plan_batch, validate_plan  # noqa: E402
from treepack.trainer import materialize  # noqa: E402
from treepack.trainer.hf.forward import verify_model  # noqa: E402
from treepack.trainer.hf.probe import forget_probes  # noqa: E402


def setup(scale: int, hidden: int, layers: int, vocab: int):
    case = scaled_golden(scale, vocab=vocab)
    model = build_model(vocab, hidden, layers)
    plan = plan_batch(case["sequences"], seq_len=case["seq_len"], min_shared_len=case["min_shared_len"], trainable=case["trainable"], groups=case["groups"])
    validate_plan(plan, case["sequences"], trainable=case["trainable"])
    return model, materialize(plan, case["sequences"], trainable=case["trainable"], groups=case["groups"])


def _times(fn, repeats: int) -> list[float]:
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def _peak_kib() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


def child(what: str, scale: int, hidden: int, layers: int, vocab: int) -> int:
    """Peak RSS growth (KiB) of one ``step`` or one ``probe`` in this fresh process."""
    model, batch = setup(scale, hidden, layers, vocab)
    with torch.no_grad():
        model(input_ids=batch.input_ids[:1, :16])  # imports and lazy inits out of the figure
    before = _peak_kib()
    if what == "step":
        packed_step_unverified(model, batch)
    else:
        verify_model(model)
    return _peak_kib() - before


def packed_step_unverified(model, batch) -> None:
    from treepack.trainer.hf import packed_forward
    from treepack.trainer.losses import sft_loss

    logits = packed_forward(model, batch, verify=False)
    sft_loss(batch.target_logprobs(logits), batch, normalization="token").backward()


def run(scale: int, hidden: int, layers: int, vocab: int, repeats: int) -> dict:
    model, batch = setup(scale, hidden, layers, vocab)
    model.eval()
    packed_step(model, batch, "sdpa")  # warm-up, and this setup's probe
    step = _times(lambda: packed_step(model, batch, "sdpa"), repeats)

    def fresh_probe() -> None:
        forget_probes(model)
        verify_model(model)

    probe_eval = _times(fresh_probe, repeats)
    model.train()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    probe_train = _times(fresh_probe, repeats)
    args = [str(scale), str(hidden), str(layers), str(vocab)]
    mem = {w: int(subprocess.run([sys.executable, __file__, "--child", w, *args], check=True, capture_output=True, text=True).stdout.split()[-1]) for w in ("step", "probe")}
    rows = [
        dict(what="one training step (tree / sdpa)", times=step),
        dict(what="probe, eval mode", times=probe_eval),
        dict(what="probe, train + checkpointing", times=probe_train),
    ]
    med = statistics.median(step)
    for r in rows:
        r["median_s"] = statistics.median(r["times"])
        r["ratio"] = r["median_s"] / med
    return dict(
        machine=f"{platform.machine()} {os.cpu_count()} cores, torch {torch.__version__}, {torch.get_num_threads()} threads",
        model=dict(hidden=hidden, layers=layers, vocab=vocab),
        scale=scale,
        rows_x_len=f"{batch.num_rows} x {batch.seq_len}",
        repeats=repeats,
        results=rows,
        peak_rss_growth_kib=mem,
    )


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--scale", type=int, default=64)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", metavar="PATH")
    ap.add_argument("--smoke", action="store_true", help="tiny and fast: proves the script runs")
    ap.add_argument("--child", nargs=5, metavar=("WHAT", "SCALE", "HIDDEN", "LAYERS", "VOCAB"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        print(child(args.child[0], *map(int, args.child[1:])))
        return {}
    if args.smoke:
        args.scale, args.hidden, args.layers, args.vocab, args.repeats = 512, 32, 1, 128, 1
    out = run(args.scale, args.hidden, args.layers, args.vocab, args.repeats)
    print(f"# {out['machine']}; golden / {out['scale']} ({out['rows_x_len']} rows), Qwen3 hidden {args.hidden} x {args.layers} layers, {args.repeats} repeats")
    print("| what | median s | range s | / one step |")
    print("|---|---:|---:|---:|")
    for r in out["results"]:
        print(f"| {r['what']} | {r['median_s']:.3f} | {min(r['times']):.3f}-{max(r['times']):.3f} | {r['ratio']:.2f} |")
    m = out["peak_rss_growth_kib"]
    print(f"\npeak RSS growth: one step {m['step'] / 1024:.1f} MiB, one probe {m['probe'] / 1024:.1f} MiB ({m['probe'] / max(m['step'], 1):.2f} of a step)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)
    return out


if __name__ == "__main__":
    main()
