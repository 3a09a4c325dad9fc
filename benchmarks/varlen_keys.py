"""Keys and values the varlen (FlashAttention) path materializes per layer: gathered layout vs copy-free levels.

Usage:
    python benchmarks/varlen_keys.py [--json out.json]

Counts from the metadata alone (no model runs): for each workload, planned with ``auto``,

- **gathered** (the reference layout): one varlen sequence per segment over its gathered
  ancestor chain: the keys (and as many values) copied per layer, the queries gathered and
  the outputs scattered back;
- **copy-free levels**: one call over the segments and one per tree depth, reading the rows
  in place: keys copied (0), key rows the calls read (each shared segment once per level it
  serves), queries gathered (0), and the partial outputs the merge holds (the ancestor
  levels' query spans).

Bytes are for one layer of a realistic shape (8 KV heads x 128, bf16: 2 KiB per key row,
the same per value row). Workloads: the golden example (SPEC 4) at full size and divided by
64, and GRPO batches (prompts shared by 8 completions).

``--time N``: also times one attention layer's forward + backward on the CPU (fp32, 8 / 2
heads x 64, one thread) on the golden example / 64 and GRPO batches with rows of 512 to
4,096: the dense tree mask (``sdpa``), the gathered layout and the copy-free levels (both
through the batched CPU kernel), interleaved N times (median and min-max, ms), and checks
that they agree.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from golden_scaled import scaled_golden  # noqa: E402

from treepack.service.planner import plan_batch  # noqa: E402
from treepack.trainer import materialize, tree_attention  # noqa: E402
from treepack.trainer.kernels.masks import varlen_meta  # noqa: E402
from treepack.trainer.kernels.varlen import varlen_attention  # noqa: E402
from treepack.trainer.kernels.varlen_levels import varlen_levels  # noqa: E402

ROW_BYTES = 8 * 128 * 2  # one key (or value) row: 8 KV heads x 128 dims, bf16


def grpo(prompts: int, prompt_len: int, completion_len: int, seed: int = 0) -> dict:
    """``prompts`` prompts of ``prompt_len`` tokens, 8 completions of up to ``completion_len`` each."""
    rng = np.random.default_rng(seed)
    seqs, trainable, groups = [], [], []
    for p in range(prompts):
        prompt = rng.integers(0, 32000, prompt_len)
        for _ in range(8):
            n = int(rng.integers(completion_len // 4, completion_len + 1))
            seqs.append(np.concatenate([prompt, rng.integers(0, 32000, n)]))
            trainable.append(prompt_len)
            groups.append(p)
    return dict(
        sequences=seqs, trainable=trainable, groups=groups, seq_len=prompt_len + 8 * completion_len, min_shared_len=16
    )


WORKLOADS = {
    "golden example": lambda: scaled_golden(1),
    "golden example / 64": lambda: scaled_golden(64),
    "GRPO 2 x 8, prompt 256 / completion 32": lambda: grpo(2, 256, 32),
    "GRPO 16 x 8, prompt 2,048 / completion 512": lambda: grpo(16, 2048, 512),
}


def _plan(case: dict):
    return plan_batch(
        case["sequences"],
        seq_len=case["seq_len"],
        min_shared_len=case["min_shared_len"],
        trainable=case["trainable"],
        groups=case["groups"],
    )


LAYOUTS = ("dense", "gathered", "copy-free")

# Timed with --time (besides the two small workloads above): GRPO rows long enough that the
# dense mask's L x L work shows (P = 8 C, as in the TRL and verl benchmarks).
TIMED = {
    "golden example / 64": WORKLOADS["golden example / 64"],
    "GRPO 2 x 8, prompt 256 / completion 32": WORKLOADS["GRPO 2 x 8, prompt 256 / completion 32"],
    "GRPO 2 x 8, prompt 1,024 / completion 128": lambda: grpo(2, 1024, 128),
    "GRPO 2 x 8, prompt 2,048 / completion 256": lambda: grpo(2, 2048, 256),
}


def time_layer(name: str, case: dict, repeats: int) -> dict:
    """One attention layer, forward + backward, interleaved: the dense tree mask (``sdpa``), the
    gathered varlen layout and the copy-free levels (both through the batched CPU kernel)."""
    plan = _plan(case)
    batch = materialize(plan, case["sequences"], trainable=case["trainable"], groups=case["groups"], advise=False)
    K, L = batch.num_rows, batch.seq_len
    g = torch.Generator().manual_seed(0)
    base = [torch.randn(K, L, h, 64, generator=g).transpose(1, 2) for h in (8, 2, 2)]

    def step(layout: str):
        q, k, v = (t.detach().requires_grad_() for t in base)
        kw = dict(backend="flash", varlen_fn=varlen_attention, gather_keys=layout == "gathered")
        t0 = time.perf_counter()
        out = tree_attention(q, k, v, batch, **(dict(backend="sdpa") if layout == "dense" else kw))
        out.square().sum().backward()
        return (time.perf_counter() - t0) * 1e3, out.detach(), q.grad

    times: dict[str, list[float]] = {x: [] for x in LAYOUTS}
    for x in LAYOUTS:  # warm-up: metadata built, kernels touched
        step(x)
    for r in range(repeats):
        for x in LAYOUTS[r % 3 :] + LAYOUTS[: r % 3]:  # the order rotates
            times[x].append(step(x)[0])
    _, ref, gref = step("dense")
    diffs = {}
    for x in LAYOUTS[1:]:
        _, o, go = step(x)
        diffs[x] = (float((o - ref).abs().max()), float((go - gref).abs().max() / gref.abs().max()))
    return dict(
        workload=name,
        rows=f"{K} x {L:,}",
        ms=times,
        max_out_diff=max(d[0] for d in diffs.values()),
        max_grad_diff=max(d[1] for d in diffs.values()),
    )


def count(name: str, case: dict) -> dict:
    plan = _plan(case)
    rows = np.arange(plan.num_rows)
    meta = varlen_meta(plan, rows)
    lv = varlen_levels(plan, rows)
    tokens = int(plan.segments.row_len.sum())
    gathered = int(meta.k_index.numel())
    return dict(
        workload=name,
        rows=plan.num_rows,
        row_len=plan.seq_len,
        row_tokens=tokens,
        depth_levels=len(lv.levels) - 1,
        gathered_keys=gathered,
        gathered_queries=int(meta.q_index.numel()),
        gathered_mib=2 * gathered * ROW_BYTES / 2**20,
        levels_keys_copied=0,
        levels_keys_read=lv.keys_read,
        levels_partial_outputs=sum(x.q_end - x.q_start for x in lv.levels[1:]),
        keys_per_row_token_before=gathered / tokens,
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", help="write the results here")
    p.add_argument("--time", type=int, default=0, help="time one CPU attention layer, this many repeats")
    a = p.parse_args()
    out = [count(name, make()) for name, make in WORKLOADS.items()]
    print(
        "| workload | rows x L | row tokens | gathered: keys copied (x2 with values) | MiB / layer | "
        "levels: keys copied | key rows read in place | depth levels | partial outputs held |"
    )
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|")
    for r in out:
        print(
            f"| {r['workload']} | {r['rows']} x {r['row_len']:,} | {r['row_tokens']:,} | "
            f"{r['gathered_keys']:,} ({r['keys_per_row_token_before']:.2f} per row token) | "
            f"{r['gathered_mib']:.1f} | 0 | {r['levels_keys_read']:,} | {r['depth_levels']} | "
            f"{r['levels_partial_outputs']:,} |"
        )
    timed = []
    if a.time:
        torch.set_num_threads(1)
        print(
            "\n| workload (CPU, 1 thread) | rows x L | dense mask (sdpa) ms | gathered ms | copy-free ms | "
            "dense / copy-free | max out diff | max grad diff (rel) |"
        )
        print("|---|---|---:|---:|---:|---:|---:|---:|")
        cell = lambda xs: f"{statistics.median(xs):,.0f} ({min(xs):,.0f}-{max(xs):,.0f})"  # noqa: E731
        for name, make in TIMED.items():
            t = time_layer(name, make(), a.time)
            timed.append(t)
            ms = t["ms"]
            ratio = statistics.median(ms["dense"]) / statistics.median(ms["copy-free"])
            print(
                f"| {name} | {t['rows']} | {cell(ms['dense'])} | {cell(ms['gathered'])} | {cell(ms['copy-free'])} | "
                f"{ratio:.2f} | {t['max_out_diff']:.1e} | {t['max_grad_diff']:.1e} |",
                flush=True,
            )
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"counts": out, "timed": timed}, f, indent=1)


if __name__ == "__main__":
    main()
