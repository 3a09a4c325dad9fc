"""CPU benchmark: packed drift and a broken mask's drift against the model's own noise floor, per precision.

Usage:
    python benchmarks/precision_parity.py [--scale 64] [--hidden 64] [--layers 2] [--sequences 16] [--json out.json]
                                          [--quick] [--report]

For each precision (float32; bf16 and fp16 autocast over float32 parameters; bf16 parameters;
float64), backend (``sdpa``; ``flash`` through the CPU varlen reference) and mode (eval; train;
train with gradient checkpointing) it runs :func:`treepack.trainer.parity_report` on the
golden example scaled by ``--scale`` (32 sequences, four groups sharing a system prompt)
with a random Qwen3, and prints one Markdown row: the packed rows' largest per-token
logprob drift from each sequence alone over the noise floor (the largest drift of two
unpacked batch shapes, at least the compute dtype's rounding floor), the largest gradient
drift ratio of a parameter group, and the same logprob ratio with a broken mask (the rows
run as plain causal packing: every token sees every earlier token of its row), which must
stay far above the probe's acceptance multiple. ``--report`` also prints the full report of
the bf16-autocast train row. ``--quick`` runs a few rows (the tests' smoke run).

:func:`broken_mask` is the negative control the tests use too.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from typing import Any

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from golden_scaled import scaled_golden  # noqa: E402

from treepack.service.planner import plan_batch, validate_plan  # noqa: E402
from treepack.trainer import PackedBatch, materialize, naive_varlen_attention, parity_report  # noqa: E402
from treepack.trainer.hf.admission.tolerance import MULTIPLE  # noqa: E402
from treepack.trainer.kernels import masks  # noqa: E402
from treepack.trainer.kernels.varlen_levels import VarlenLevels, _level  # noqa: E402

PRECISIONS = {
    "float32": (torch.float32, None),
    "bf16 autocast": (torch.float32, torch.bfloat16),
    "fp16 autocast": (torch.float32, torch.float16),
    "bfloat16": (torch.bfloat16, None),
    "float64": (torch.float64, None),
}
MODES = ("eval", "train", "train+ckpt")


def _nonpad(batch: PackedBatch, meta: Any) -> torch.Tensor:
    flat = torch.zeros(batch.num_rows * batch.seq_len, dtype=torch.bool)
    flat[meta.q_index.cpu()] = True
    return flat.view(batch.num_rows, batch.seq_len).to(batch.subtree_end.device)


@contextmanager
def broken_mask() -> Iterator[None]:
    """Every packed batch's attention runs as plain causal packing inside the block: each token
    sees every earlier token of its row (the classic packing bug), on every backend."""
    dense, block, varlen = PackedBatch.dense_mask, PackedBatch.block_mask, PackedBatch.varlen_meta

    def causal(self: PackedBatch) -> PackedBatch:
        keep = _nonpad(self, varlen(self))
        ends = torch.where(keep, torch.full_like(self.subtree_end, self.seq_len), self.subtree_end)
        return dataclasses.replace(self, subtree_end=ends, _cache={})

    def causal_varlen(self: PackedBatch, chunk_size: int | None = None) -> Any:
        q = np.sort(varlen(self).q_index.cpu().numpy())
        rows = q // self.seq_len
        lens = np.bincount(rows, minlength=self.num_rows)
        return masks._meta(self.num_rows * self.seq_len, self.device, np.arange(self.num_rows), q, q, lens, lens)

    def causal_levels(self: PackedBatch) -> VarlenLevels:
        # The copy-free path's own level as one causal sequence per row, and no ancestor levels.
        L = self.seq_len
        starts = np.arange(self.num_rows, dtype=np.int64) * L
        own = _level(starts, starts + L, starts, starts + L, True, self.device)
        return VarlenLevels(size=self.num_rows * L, levels=(own,))

    levels = PackedBatch.varlen_levels
    PackedBatch.dense_mask = lambda self, *a, **k: dense(causal(self), *a, **k)  # type: ignore[method-assign]
    PackedBatch.block_mask = lambda self, *a, **k: block(causal(self), *a, **k)  # type: ignore[method-assign]
    PackedBatch.varlen_meta = causal_varlen  # type: ignore[method-assign]
    PackedBatch.varlen_levels = causal_levels  # type: ignore[method-assign]
    try:
        yield
    finally:
        PackedBatch.dense_mask, PackedBatch.block_mask, PackedBatch.varlen_meta = dense, block, varlen
        PackedBatch.varlen_levels = levels  # type: ignore[method-assign]


def build(vocab: int, hidden: int, layers: int, dtype: torch.dtype) -> torch.nn.Module:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg = Qwen3Config(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=hidden // 4,
        max_position_embeddings=4096,
    )
    torch.manual_seed(0)
    return Qwen3ForCausalLM(cfg).to(dtype)


def golden_batch(scale: int, vocab: int) -> PackedBatch:
    case = scaled_golden(scale, vocab=vocab)
    kw = {k: case[k] for k in ("seq_len", "min_shared_len", "trainable", "groups")}
    plan = plan_batch(case["sequences"], **kw)
    validate_plan(plan, case["sequences"], trainable=case["trainable"])
    return materialize(plan, case["sequences"], trainable=case["trainable"], groups=case["groups"])


def measure(model: torch.nn.Module, batch: PackedBatch, precision: str, backend: str, mode: str, n: int) -> dict:
    """One row: the parity report's ratios, and the broken mask's logprob ratio."""
    model.train(mode != "eval")
    if mode == "train+ckpt":
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_disable()
    ac = PRECISIONS[precision][1]
    kw: dict[str, Any] = {"varlen_fn": naive_varlen_attention} if backend == "flash" else {}
    with torch.autocast("cpu", dtype=ac) if ac is not None else nullcontext():
        good = parity_report(model, batch, backend=backend, sequences=n, **kw)
        with broken_mask():
            bad = parity_report(model, batch, backend=backend, sequences=n, grads=False, **kw)
    return {
        "precision": precision,
        "backend": backend,
        "mode": mode,
        "compute": good.compute_dtype,
        "noise_floor": good.noise_floor,
        "packed_lp": good.ratio,
        "packed_grad": good.grad_ratio,
        "broken_lp": bad.drift["packed"].max / good.noise_floor,
        "clipped": good.drift["packed"].clipped,
        "broken_clipped": bad.drift["packed"].clipped,
        "tokens": good.tokens,
        "report": good.table(),
    }


def row(r: dict) -> str:
    return (
        f"| {r['precision']} | {r['backend']} | {r['mode']} | {r['compute']} | {r['noise_floor']:.2g} "
        f"| {r['packed_lp']:.2f}x | {r['packed_grad']:.2f}x | {r['broken_lp']:.0f}x "
        f"| {r['clipped']} / {r['broken_clipped']} of {r['tokens']} |"
    )


HEADER = (
    "| precision | backend | mode | computes in | noise floor (nats) | packed / floor (logprob) "
    "| packed / floor (grad, worst group) | broken mask / floor (logprob) | clip crossings packed / broken |\n"
    "|---|---|---|---|---|---|---|---|---|"
)


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--scale", type=int, default=64)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--vocab", type=int, default=1000)
    ap.add_argument("--sequences", type=int, default=16)
    ap.add_argument("--quick", action="store_true", help="a few rows only")
    ap.add_argument("--report", action="store_true", help="print the bf16-autocast train report in full")
    ap.add_argument("--json", help="write the rows here")
    args = ap.parse_args(argv)
    batch = golden_batch(args.scale, args.vocab)
    grid = [
        (p, b, m)
        for p in PRECISIONS
        for b in ("sdpa", "flash")
        for m in MODES
        if p in ("float32", "bf16 autocast", "fp16 autocast") or (b == "sdpa" and m == "train")
    ]
    if args.quick:
        grid = [("bf16 autocast", "sdpa", "train"), ("float32", "flash", "eval")]
    models: dict[str, torch.nn.Module] = {}
    rows = []
    print(HEADER)
    for p, b, m in grid:
        model = models.setdefault(p, build(args.vocab, args.hidden, args.layers, PRECISIONS[p][0]))
        r = measure(model, batch, p, b, m, args.sequences)
        rows.append(r)
        print(row(r), flush=True)
    print(f"\nacceptance: packed / floor <= {MULTIPLE:g}x; a broken mask must stay far above it")
    if args.report:
        print("\n" + next(r["report"] for r in rows if r["precision"] == "bf16 autocast" and r["mode"] == "train"))
    if args.json:
        with open(args.json, "w") as f:
            json.dump([{k: v for k, v in r.items() if k != "report"} for r in rows], f, indent=1)
    return rows


if __name__ == "__main__":
    main()
