"""Cost model accuracy: calibrate on one set of batches, predict the step time of others.

Usage:
    python benchmarks/cost_model.py [--models qwen3,bamba] [--hidden 64] [--layers 2]
                                    [--seq-len 512] [--repeats 3] [--threads 1]
                                    [--json out.json] [--smoke]

For each model (a random tiny Qwen3: attention only; a random tiny Bamba: Mamba2 mixers
and one attention layer), ``treepack.trainer.calibrate`` times the training step
(forward, SFT token-mean loss, backward; ``flash`` backend, on CPU the batched varlen
kernel) on its synthetic calibration batches and fits the cost model. Then, on batches it
never saw, the script measures the step (median of ``--repeats`` after a warm-up) and
compares it with ``predict_ms``. ``--clock cpu`` (the default) times the process's CPU
time with one torch thread: on a machine shared with other work the wall clock measures
the neighbours as much as the step.

- ``golden``: the golden example divided by 256 (high sharing), tree plan and plain plan;
- ``medium``: GRPO groups whose prompts are a third of each sequence;
- ``none``: unrelated sequences (no sharing).

It also plans each batch with ``placement="auto"`` and the cost model, and reports which
candidate ``auto`` picked (tree or plain packing) and that plan's measured time.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import time
import warnings

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from golden_scaled import scaled_golden  # noqa: E402

from treepack.proto.cost import CostWarning  # noqa: E402
from treepack.service.planner import plan_batch, validate_plan  # noqa: E402
from treepack.trainer import calibrate, time_step  # noqa: E402
from treepack.trainer.cost import model_conv_width  # noqa: E402


def qwen3(vocab: int, hidden: int, layers: int):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    heads = max(2, hidden // 32)
    cfg = Qwen3Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=hidden * 3, num_hidden_layers=layers, num_attention_heads=heads,
                      num_key_value_heads=max(1, heads // 2), head_dim=hidden // heads, max_position_embeddings=8192)  # fmt: skip
    return Qwen3ForCausalLM(cfg).float()


def bamba(vocab: int, hidden: int, layers: int):
    from transformers import BambaConfig, BambaForCausalLM

    torch.manual_seed(0)
    heads = max(2, hidden // 32)
    cfg = BambaConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=hidden * 3, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=max(1, heads // 2), attn_layer_indices=list(range(1, layers, 4)),
        mamba_n_heads=heads * 2, mamba_d_head=hidden // heads, mamba_n_groups=1, mamba_d_state=16, mamba_d_conv=4,
        mamba_expand=2, mamba_chunk_size=32, max_position_embeddings=8192,
    )  # fmt: skip
    model = BambaForCausalLM(cfg).float()
    model.set_attn_implementation("sdpa")
    return model


MODELS = {"qwen3": qwen3, "bamba": bamba}


def held_out(seq_len: int, vocab: int) -> dict[str, dict]:
    """The batches the cost model is checked on (none of them calibrated on)."""
    scale = max(1, 131072 // seq_len)
    g = scaled_golden(scale, vocab=vocab, seed=7)
    rng = np.random.default_rng(11)
    med, med_prompt, med_groups = [], [], []
    for grp in range(4):
        prompt = rng.integers(0, vocab, seq_len // 8).tolist()
        for _ in range(4):
            med.append(prompt + rng.integers(0, vocab, int(seq_len // 4 * rng.uniform(0.7, 1.3))).tolist())
            med_prompt.append(len(prompt))
            med_groups.append(grp)
    lens = rng.integers(seq_len // 16, seq_len // 2, 14)
    none = [rng.integers(0, vocab, n).tolist() for n in lens]
    return {
        "golden": dict(sequences=g["sequences"], trainable=g["trainable"], groups=g["groups"], min_shared_len=g["min_shared_len"]),
        "medium": dict(sequences=med, trainable=med_prompt, groups=med_groups, min_shared_len=8),
        "none": dict(sequences=none, trainable=[n // 2 for n in lens], groups=None, min_shared_len=8),
    }


def run(name: str, hidden: int, layers: int, vocab: int, seq_len: int, repeats: int, clock: str) -> dict:
    model = MODELS[name](vocab, hidden, layers)
    conv = model_conv_width(model)
    t0 = time.perf_counter()
    cost = calibrate(model, backend="flash", seq_len=seq_len, repeats=repeats, vocab=vocab, clock=clock)
    calib_s = time.perf_counter() - t0
    rows = []
    for bname, b in held_out(seq_len, vocab).items():
        kw = dict(trainable=b["trainable"], groups=b["groups"], seq_len=seq_len, min_shared_len=b["min_shared_len"], conv_width=conv)
        plans = {"tree": plan_batch(b["sequences"], **kw), "plain": plan_batch(b["sequences"], placement="no_share", **kw)}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", CostWarning)
            plans["auto+cost"] = plan_batch(b["sequences"], cost_model=cost, **kw)
        for label, plan in plans.items():
            validate_plan(plan, b["sequences"], trainable=b["trainable"])
            measured = time_step(model, plan, b["sequences"], repeats=repeats, clock=clock)
            predicted = cost.predict_ms(plan)
            rows.append(dict(batch=bname, plan=label, strategy=plan.strategy, rows=plan.num_rows, segments=plan.segments.num_segments,
                             saved=plan.stats.saved_fraction, measured_ms=measured, predicted_ms=predicted, error=predicted / measured - 1))  # fmt: skip
    return dict(model=name, calibration_s=calib_s, fit=dict(cost.fit), cost=cost.to_dict(), results=rows)


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="qwen3,bamba")
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--vocab", type=int, default=1024)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--clock", choices=("wall", "cpu"), default="cpu", help="cpu: process CPU time (stable on a shared machine)")
    ap.add_argument("--json", metavar="PATH")
    ap.add_argument("--smoke", action="store_true", help="tiny and fast: proves the script runs")
    args = ap.parse_args(argv)
    if args.smoke:
        args.hidden, args.layers, args.vocab, args.seq_len, args.repeats = 32, 2, 128, 128, 1
    torch.set_num_threads(args.threads)
    out = []
    print(f"# {platform.machine()} {os.cpu_count()} cores, torch {torch.__version__}, {torch.get_num_threads()} threads; "
          f"hidden {args.hidden} x {args.layers} layers, rows of {args.seq_len}, median of {args.repeats}, {args.clock} clock")  # fmt: skip
    for name in args.models.split(","):
        r = run(name, args.hidden, args.layers, args.vocab, args.seq_len, args.repeats, args.clock)
        out.append(r)
        print(f"\n{name}: calibrated in {r['calibration_s']:.0f} s on {int(r['fit']['batches'])} plans "
              f"(fit: median error {r['fit']['median_rel_err']:.1%}, max {r['fit']['max_rel_err']:.1%})")  # fmt: skip
        print("| batch | plan | strategy | rows | segments | saved | measured ms | predicted ms | error |")
        print("|---|---|---|---:|---:|---:|---:|---:|---:|")
        for x in r["results"]:
            print(f"| {x['batch']} | {x['plan']} | {x['strategy']} | {x['rows']} | {x['segments']} | {x['saved']:.2f} | "
                  f"{x['measured_ms']:.1f} | {x['predicted_ms']:.1f} | {x['error']:+.1%} |")  # fmt: skip
        worst = max(abs(x["error"]) for x in r["results"])
        print(f"worst |error| {worst:.1%}" + ("" if math.isfinite(worst) else " (not finite)"))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return out


if __name__ == "__main__":
    main()
