"""CPU benchmark: forward+backward of a small HF model, tree-packed vs unpacked.

Usage:
    python benchmarks/cpu_train_step.py [--scale 64] [--hidden 256] [--layers 4]
                                        [--repeats 3] [--json out.json] [--smoke]

Workload: the golden example with every length divided by ``--scale``
(benchmarks/golden_scaled.py). One training step = forward, SFT NLL over the trainable
tokens (token mean), backward. Variants, all in the same run:

- ``unpacked``: every sequence alone (stock HF SDPA, causal), batched by equal length
  (no padding: the golden example's groups have equal lengths), the baseline;
- ``tree / varlen``: the tree-packed rows, attention over gathered ancestor keys per
  segment (the FlashAttention path; on CPU ``--varlen batched``, the default, runs
  ``treepack.trainer.kernels.varlen.varlen_attention``, one batched SDPA per bucket of
  similar lengths, and ``--varlen naive`` the loop reference);
- ``tree / sdpa``: the tree-packed rows, SDPA with the dense [L, L] tree mask (attention
  cost is the full L^2 of each row, whatever the sharing);
- ``no_share / varlen``: classic sequence packing of the same sequences (no tree).

Reported: the median step time of ``--repeats`` timed steps (after one warm-up), tokens
each variant processes, and the ratios time / unpacked time next to tokens / unpacked
tokens. Losses and gradients of every variant are checked against the baseline.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from typing import Any

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from golden_scaled import scaled_golden  # noqa: E402

from treepack.service.planner import plan_batch, validate_plan  # noqa: E402
from treepack.trainer import materialize, naive_varlen_attention  # noqa: E402
from treepack.trainer.hf import packed_forward  # noqa: E402
from treepack.trainer.kernels.varlen import varlen_attention  # noqa: E402
from treepack.trainer.losses import sft_loss  # noqa: E402


def build_model(vocab: int, hidden: int, layers: int):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    heads = max(2, hidden // 64)
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


def unpacked_step(model, case) -> torch.Tensor:
    """Every sequence alone, batched by equal length; SFT token-mean NLL; backward."""
    seqs, prompt = case["sequences"], case["trainable"]
    total = sum(len(s) - max(p, 1) for s, p in zip(seqs, prompt))
    by_len: dict[int, list[int]] = {}
    for i, s in enumerate(seqs):
        by_len.setdefault(len(s), []).append(i)
    loss = torch.zeros(())
    for n, idx in by_len.items():
        x = torch.as_tensor(np.stack([seqs[i] for i in idx]), dtype=torch.int64)
        logits = model(input_ids=x, use_cache=False).logits
        # Log-softmax only where the loss reads it, as the packed path does.
        keep = torch.stack([torch.arange(1, n) >= prompt[i] for i in idx])
        sel = logits[:, :-1][keep].float()
        lp = sel.gather(1, x[:, 1:][keep][:, None]).squeeze(1) - torch.logsumexp(sel, -1)
        part = -lp.sum() / total
        part.backward()
        loss = loss + part.detach()
    return loss


VARLEN = {"batched": varlen_attention, "naive": naive_varlen_attention}


def packed_step(model, batch, backend: str, varlen: str = "batched") -> torch.Tensor:
    logits = packed_forward(model, batch, backend=backend, varlen_fn=VARLEN[varlen])
    loss = sft_loss(batch.target_logprobs(logits), batch, normalization="token")
    loss.backward()
    return loss.detach()


CLOCK = {"wall": time.perf_counter, "cpu": time.process_time}


def timed(fn, model, repeats: int, now=time.perf_counter) -> tuple[float, torch.Tensor, dict]:
    model.zero_grad(set_to_none=True)
    loss = fn()  # warm-up (and the values to check)
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    times = []
    for _ in range(repeats):
        model.zero_grad(set_to_none=True)
        t0 = now()
        fn()
        times.append(now() - t0)
    return statistics.median(times), loss, grads


def golden_plans(scale: int, vocab: int) -> tuple[dict, dict]:
    """(the scaled golden case, its validated ``tree`` (auto) and ``no_share`` plans)."""
    case = scaled_golden(scale, vocab=vocab)
    kw = dict(
        seq_len=case["seq_len"],
        min_shared_len=case["min_shared_len"],
        trainable=case["trainable"],
        groups=case["groups"],
    )
    plans = {
        "tree": plan_batch(case["sequences"], placement="auto", **kw),
        "no_share": plan_batch(case["sequences"], placement="no_share", **kw),
    }
    for p in plans.values():
        validate_plan(p, case["sequences"], trainable=case["trainable"])
    return case, plans


def run(
    scale: int,
    hidden: int,
    layers: int,
    vocab: int,
    repeats: int,
    variants: list[str],
    varlen: str = "batched",
    clock: str = "wall",
) -> dict:
    case, plans = golden_plans(scale, vocab)
    model = build_model(vocab, hidden, layers)
    batches = {
        k: materialize(p, case["sequences"], trainable=case["trainable"], groups=case["groups"])
        for k, p in plans.items()
    }
    unpacked_tokens = sum(len(s) for s in case["sequences"])
    now = CLOCK[clock]
    t_base, base_loss, base_grads = timed(lambda: unpacked_step(model, case), model, repeats, now)
    rows = [
        dict(
            variant="unpacked",
            rows=len(case["sequences"]),
            tokens=unpacked_tokens,
            time_s=t_base,
            loss=float(base_loss),
            max_grad_rel=0.0,
        )
    ]
    for name in variants:
        layout, backend = name.split("/")
        batch = batches[layout]
        t, loss, grads = timed(
            lambda: packed_step(model, batch, "flash" if backend == "varlen" else backend, varlen), model, repeats, now
        )
        rel = max(float((grads[n] - g).abs().max() / g.abs().max()) for n, g in base_grads.items())
        rows.append(
            dict(
                variant=f"{layout} / {backend}",
                rows=batch.num_rows,
                tokens=int(plans[layout].stats.packed_tokens),
                time_s=t,
                loss=float(loss),
                max_grad_rel=rel,
            )
        )
    for r in rows:
        r["time_ratio"] = r["time_s"] / t_base
        r["token_ratio"] = r["tokens"] / unpacked_tokens
    return dict(
        machine=machine(),
        scale=scale,
        seq_len=case["seq_len"],
        model=dict(hidden=hidden, layers=layers, vocab=vocab),
        repeats=repeats,
        varlen=varlen,
        clock=clock,
        results=rows,
    )


def machine() -> str:
    """The machine line of a CPU benchmark's output."""
    return f"{platform.machine()} {os.cpu_count()} cores, torch {torch.__version__}, {torch.get_num_threads()} threads"


def workload_args(description: str, argv: list[str] | None, extra: Any = None) -> argparse.Namespace:
    """The workload options every CPU training benchmark takes (``--smoke``: tiny and fast)."""
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--scale", type=int, default=64)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument(
        "--varlen", choices=sorted(VARLEN), default="batched", help="CPU varlen kernel of the varlen variants"
    )
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument(
        "--clock",
        choices=sorted(CLOCK),
        default="wall",
        help="cpu: process CPU time (for a machine shared with other work; use --threads 1)",
    )
    ap.add_argument("--json", metavar="PATH")
    ap.add_argument("--smoke", action="store_true", help="tiny and fast: proves the script runs")
    if extra is not None:
        extra(ap)
    args = ap.parse_args(argv)
    if args.smoke:
        args.scale, args.hidden, args.layers, args.vocab, args.repeats = 512, 32, 1, 128, 1
    return args


def main(argv: list[str] | None = None) -> dict:
    args = workload_args(__doc__.splitlines()[0], argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    variants = ["tree/varlen", "tree/sdpa", "no_share/varlen"]
    out = run(args.scale, args.hidden, args.layers, args.vocab, args.repeats, variants, args.varlen, args.clock)
    print(
        f"# {out['machine']}; golden / {out['scale']} (rows of {out['seq_len']}), "
        f"Qwen3 hidden {args.hidden} x {args.layers} layers, median of {args.repeats}, "
        f"{args.varlen} varlen kernel, {args.clock} clock"
    )
    report(out, args.json)
    return out


def report(out: dict, json_path: str | None) -> None:
    """Print the results table (markdown, as BENCHMARKS.md has it) and write the JSON if asked."""
    print("| variant | rows | tokens | step s | time / unpacked | tokens / unpacked | loss | max grad rel diff |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for r in out["results"]:
        print(
            f"| {r['variant']} | {r['rows']} | {r['tokens']:,} | {r['time_s']:.3f} | {r['time_ratio']:.2f} | "
            f"{r['token_ratio']:.2f} | {r['loss']:.6f} | {r['max_grad_rel']:.1e} |"
        )
    if json_path:
        with open(json_path, "w") as f:
            json.dump(out, f, indent=2)


if __name__ == "__main__":
    main()
