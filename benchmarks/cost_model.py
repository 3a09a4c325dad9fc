"""Cost model accuracy: calibrate on one set of batches, predict the step time of others.

Usage:
    python benchmarks/cost_model.py [--models qwen3,bamba] [--hidden 64] [--layers 2]
                                    [--seq-len 512] [--rounds 5] [--threads 1]
                                    [--clock cpu] [--json out.json] [--smoke]

For each model (a random tiny Qwen3: attention only; a random tiny Bamba: Mamba2 mixers
and one attention layer), the training step of ``treepack.trainer.calibrate``
(``time_step``: forward, SFT token-mean loss, backward; ``flash`` backend, on CPU the
batched varlen kernel) is timed on the calibration plans (``calibration_batches``, tree
and plain plan of each) and on held-out plans, and the cost model is fitted
(``fit_cost_model``, as ``calibrate`` does) on the calibration plans only. Held-out batches:

- ``golden``: the golden example divided by 256 (high sharing);
- ``medium``: GRPO groups whose prompts are an eighth of the rows;
- ``none``: unrelated sequences (no sharing);

each as the tree plan, plain packing (``no_share``) and the larger-``min_shared_len``
candidates ``auto`` would weigh. Every plan is timed once per round, in interleaved
rounds, after a warm-up pass, and its median over the rounds is kept (``spread`` = (max -
min) / median): a change in the machine's load then reaches calibration and held-out plans
alike. ``--clock cpu`` (the default) times the process's CPU time with one torch thread:
on a machine shared with other work the wall clock measures the neighbours as much as the
step. Last, each batch is planned with ``placement="auto"`` and the fitted model, and the
measured time of the plan it picked is set beside plain packing's and the fastest.
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

from treepack.proto.cost import CostModel, CostWarning, cost_terms  # noqa: E402
from treepack.proto.cost_fit import fit_cost_model  # noqa: E402
from treepack.service.planner import plan_batch, validate_plan  # noqa: E402
from treepack.service.planner.by_time import time_candidates  # noqa: E402
from treepack.trainer import time_step  # noqa: E402
from treepack.trainer.cost import calibration_batches, model_conv_width, model_mixers  # noqa: E402


def qwen3(vocab: int, hidden: int, layers: int):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    heads = max(2, hidden // 32)
    cfg = Qwen3Config(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=hidden * 3,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=max(1, heads // 2),
        head_dim=hidden // heads,
        max_position_embeddings=8192,
    )
    return Qwen3ForCausalLM(cfg).float()


def bamba(vocab: int, hidden: int, layers: int):
    from transformers import BambaConfig, BambaForCausalLM

    torch.manual_seed(0)
    heads = max(2, hidden // 32)
    cfg = BambaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=hidden * 3,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=max(1, heads // 2),
        attn_layer_indices=list(range(1, layers, 4)),
        mamba_n_heads=heads * 2,
        mamba_d_head=hidden // heads,
        mamba_n_groups=1,
        mamba_d_state=16,
        mamba_d_conv=4,
        mamba_expand=2,
        mamba_chunk_size=32,
        max_position_embeddings=8192,
    )
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
        "golden": dict(
            sequences=g["sequences"], trainable=g["trainable"], groups=g["groups"], min_shared_len=g["min_shared_len"]
        ),
        "medium": dict(sequences=med, trainable=med_prompt, groups=med_groups, min_shared_len=8),
        "none": dict(sequences=none, trainable=[n // 2 for n in lens], groups=None, min_shared_len=8),
    }


def _plans(model, seq_len: int, vocab: int, conv: int) -> tuple[list, list]:
    """(calibration plans, held-out plans): ``(batch, label, plan, sequences)`` each."""
    msl = min(64, max(1, seq_len // 64))
    cal = []
    for b in calibration_batches(seq_len, vocab=vocab, seed=0):
        for placement in ("auto", "no_share"):
            plan = plan_batch(
                b["sequences"],
                trainable=b["trainable"],
                groups=b["groups"],
                seq_len=seq_len,
                min_shared_len=msl,
                conv_width=conv,
                placement=placement,
            )
            cal.append((b["name"], placement, plan, b["sequences"]))
    held = []
    for bname, b in held_out(seq_len, vocab).items():
        kw = dict(
            trainable=b["trainable"],
            groups=b["groups"],
            seq_len=seq_len,
            min_shared_len=b["min_shared_len"],
            conv_width=conv,
        )
        tree = plan_batch(b["sequences"], **kw)
        held.append((bname, "tree", tree, b["sequences"]))
        for label, opts in time_candidates(tree):
            plan = plan_batch(b["sequences"], opts, trainable=b["trainable"], groups=b["groups"])
            held.append((bname, "plain" if label == "no_share" else label, plan, b["sequences"]))
    for _, _, plan, seqs in cal + held:
        validate_plan(plan, seqs)
    return cal, held


def run(name: str, hidden: int, layers: int, vocab: int, seq_len: int, rounds: int, clock: str) -> dict:
    model = MODELS[name](vocab, hidden, layers)
    conv = model_conv_width(model)
    cal, held = _plans(model, seq_len, vocab, conv)
    everything = cal + held
    t0 = time.perf_counter()
    for _, _, plan, seqs in everything:  # warm-up
        time_step(model, plan, seqs, repeats=1, warmup=0, clock=clock)
    # Interleaved rounds: each plan once per round, so a change in the machine's load
    # reaches calibration and held-out plans alike; the median over rounds is kept.
    times = np.zeros((rounds, len(everything)))
    for r in range(rounds):
        for i, (_, _, plan, seqs) in enumerate(everything):
            times[r, i] = time_step(model, plan, seqs, repeats=1, warmup=0, clock=clock)
    measured = np.median(times, axis=0)
    spread = (times.max(axis=0) - times.min(axis=0)) / measured
    probe = CostModel(
        backend="flash",
        mixers=model_mixers(model),
        chunk_size=_chunk(model),
        coefficients={t: 0.0 for t in cost_terms("flash", model_mixers(model))},
    )
    X = np.stack([probe.features(p) for _, _, p, _ in cal])
    cost = fit_cost_model(
        X,
        measured[: len(cal)],
        backend="flash",
        mixers=probe.mixers,
        chunk_size=probe.chunk_size,
        description=f"{name} benchmark",
    )
    bench_s = time.perf_counter() - t0
    rows = []
    for j, (bname, label, plan, _seqs) in enumerate(held):
        m = measured[len(cal) + j]
        p = cost.predict_ms(plan)
        rows.append(
            dict(
                batch=bname,
                plan=label,
                rows=plan.num_rows,
                segments=plan.segments.num_segments,
                saved=plan.stats.saved_fraction,
                measured_ms=m,
                spread=spread[len(cal) + j],
                predicted_ms=p,
                error=p / m - 1,
            )
        )
    choices = []
    for bname in dict.fromkeys(r["batch"] for r in rows):
        b = held_out(seq_len, vocab)[bname]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", CostWarning)
            chosen = plan_batch(
                b["sequences"],
                trainable=b["trainable"],
                groups=b["groups"],
                seq_len=seq_len,
                min_shared_len=b["min_shared_len"],
                conv_width=conv,
                cost_model=cost,
            )
        mine = [r for r in rows if r["batch"] == bname]
        label = chosen.strategy.split(" by time")[0]
        hit = next((r for r in mine if r["plan"] == label or (r["plan"] == "plain" and label == "no_share")), mine[0])
        fastest = min(mine, key=lambda r: r["measured_ms"])
        choices.append(
            dict(
                batch=bname,
                strategy=chosen.strategy,
                chosen=hit["plan"],
                chosen_ms=hit["measured_ms"],
                plain_ms=next(r["measured_ms"] for r in mine if r["plan"] == "plain"),
                fastest=fastest["plan"],
                fastest_ms=fastest["measured_ms"],
            )
        )
    return dict(
        model=name,
        seconds=bench_s,
        rounds=rounds,
        fit=dict(cost.fit),
        cost=cost.to_dict(),
        results=rows,
        choices=choices,
    )


def _chunk(model) -> int:
    cfg = model.config
    return int(getattr(cfg, "mamba_chunk_size", None) or 64)


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="qwen3,bamba")
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--vocab", type=int, default=1024)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--rounds", type=int, default=5, help="interleaved rounds; each plan's median over them is kept")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument(
        "--clock", choices=("wall", "cpu"), default="cpu", help="cpu: process CPU time (stable on a shared machine)"
    )
    ap.add_argument("--json", metavar="PATH")
    ap.add_argument("--smoke", action="store_true", help="tiny and fast: proves the script runs")
    args = ap.parse_args(argv)
    if args.smoke:
        args.models, args.hidden, args.layers, args.vocab, args.seq_len, args.rounds = "qwen3", 32, 2, 128, 128, 1
    torch.set_num_threads(args.threads)
    out = []
    print(
        f"# {platform.machine()} {os.cpu_count()} cores, torch {torch.__version__}, {torch.get_num_threads()} threads; "
        f"hidden {args.hidden} x {args.layers} layers, rows of {args.seq_len}, "
        f"median of {args.rounds} interleaved rounds, {args.clock} clock"
    )
    for name in args.models.split(","):
        r = run(name, args.hidden, args.layers, args.vocab, args.seq_len, args.rounds, args.clock)
        out.append(r)
        print(
            f"\n{name}: {r['seconds']:.0f} s; fit on {int(r['fit']['batches'])} calibration plans "
            f"(median error {r['fit']['median_rel_err']:.1%}, max {r['fit']['max_rel_err']:.1%})"
        )
        print("| batch | plan | rows | segments | saved | measured ms | spread | predicted ms | error |")
        print("|---|---|---:|---:|---:|---:|---:|---:|---:|")
        for x in r["results"]:
            print(
                f"| {x['batch']} | {x['plan']} | {x['rows']} | {x['segments']} | {x['saved']:.2f} | "
                f"{x['measured_ms']:.1f} | {x['spread']:.0%} | {x['predicted_ms']:.1f} | {x['error']:+.1%} |"
            )
        worst = max(abs(x["error"]) for x in r["results"])
        print(f"worst |error| {worst:.1%}" + ("" if math.isfinite(worst) else " (not finite)"))
        print("| batch | auto with the cost model | its plan, measured | plain packing, measured | fastest measured |")
        print("|---|---|---:|---:|---|")
        for c in r["choices"]:
            print(
                f"| {c['batch']} | {c['strategy']} | {c['chosen']} {c['chosen_ms']:.1f} ms | "
                f"{c['plain_ms']:.1f} ms | {c['fastest']} {c['fastest_ms']:.1f} ms |"
            )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return out


if __name__ == "__main__":
    main()
