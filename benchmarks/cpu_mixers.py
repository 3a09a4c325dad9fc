"""CPU benchmark: training step of a Mamba2 hybrid (Bamba), tree-packed vs unpacked.

Usage:
    python benchmarks/cpu_mixers.py [--scale 64] [--hidden 128] [--layers 4]
                                    [--repeats 3] [--json out.json] [--smoke]

Workload: the golden example with every length divided by ``--scale``
(benchmarks/golden_scaled.py), planned with ``conv_width`` = the model's conv kernel.
Model: a random ``BambaForCausalLM`` (Mamba2 mixers with one attention layer in four),
fp32, HF's torch slow path for the unpacked baseline. One step = forward, SFT NLL over the
trainable tokens (token mean), backward. Variants, in the same run:

- ``unpacked``: every sequence alone through the stock model (batched by equal length, no
  padding), the baseline;
- ``tree``: the tree-packed rows through ``packed_forward`` (Mamba2 mixers patched: per
  depth level one varlen conv and one chunked SSD scan forked from the parents' states;
  attention over gathered ancestor keys, pure-torch varlen kernel).

Reported: median step time of ``--repeats`` timed steps after a warm-up, tokens, time /
unpacked next to tokens / unpacked, and the largest relative gradient difference from the
baseline (the oracle, measured in the benchmark itself).
"""

from __future__ import annotations

import argparse
import math
import os
import platform
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from cpu_train_step import packed_step, report, timed, unpacked_step  # noqa: E402
from golden_scaled import scaled_golden  # noqa: E402

from treepack.service.planner import plan_batch, validate_plan  # noqa: E402
from treepack.trainer import materialize  # noqa: E402

CONV = 4


def build_model(vocab: int, hidden: int, layers: int, chunk: int):
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
        mamba_d_conv=CONV,
        mamba_expand=2,
        mamba_chunk_size=chunk,
        max_position_embeddings=8192,
    )
    model = BambaForCausalLM(cfg).float()
    with torch.no_grad():
        for layer in model.model.layers:
            if hasattr(layer, "mamba"):
                layer.mamba.A_log.uniform_(math.log(0.02), math.log(0.3))
    model.set_attn_implementation("sdpa")
    return model


def run(scale: int, hidden: int, layers: int, vocab: int, repeats: int, chunk: int) -> dict:
    case = scaled_golden(scale, vocab=vocab)
    model = build_model(vocab, hidden, layers, chunk)
    kw = dict(
        seq_len=case["seq_len"],
        min_shared_len=case["min_shared_len"],
        trainable=case["trainable"],
        groups=case["groups"],
    )
    plan = plan_batch(case["sequences"], placement="auto", conv_width=CONV, **kw)
    validate_plan(plan, case["sequences"], trainable=case["trainable"])
    batch = materialize(plan, case["sequences"], trainable=case["trainable"], groups=case["groups"])
    unpacked_tokens = sum(len(s) for s in case["sequences"])
    t_base, base_loss, base_grads = timed(lambda: unpacked_step(model, case), model, repeats)
    t, loss, grads = timed(lambda: packed_step(model, batch, "flash"), model, repeats)
    rel = max(float((grads[n] - g).abs().max() / g.abs().max()) for n, g in base_grads.items() if g.abs().max() > 0)
    rows = [
        dict(
            variant="unpacked",
            rows=len(case["sequences"]),
            tokens=unpacked_tokens,
            time_s=t_base,
            loss=float(base_loss),
            max_grad_rel=0.0,
        ),
        dict(
            variant="tree",
            rows=batch.num_rows,
            tokens=int(plan.stats.packed_tokens),
            time_s=t,
            loss=float(loss),
            max_grad_rel=rel,
        ),
    ]
    for r in rows:
        r["time_ratio"] = r["time_s"] / t_base
        r["token_ratio"] = r["tokens"] / unpacked_tokens
    return dict(
        machine=(
            f"{platform.machine()} {os.cpu_count()} cores, torch {torch.__version__}, {torch.get_num_threads()} threads"
        ),
        scale=scale,
        seq_len=case["seq_len"],
        levels=len(plan.gdn.levels),
        segments=int(plan.segments.num_segments),
        model=dict(
            family="bamba",
            hidden=hidden,
            layers=layers,
            vocab=vocab,
            chunk=chunk,
            mamba_layers=sum(hasattr(x, "mamba") for x in model.model.layers),
        ),
        repeats=repeats,
        results=rows,
    )


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--scale", type=int, default=64)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--chunk", type=int, default=64, help="the Mamba2 scan's chunk size")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", metavar="PATH")
    ap.add_argument("--smoke", action="store_true", help="tiny and fast: proves the script runs")
    args = ap.parse_args(argv)
    if args.smoke:
        args.scale, args.hidden, args.layers, args.vocab, args.repeats, args.chunk = 512, 32, 2, 128, 1, 16
    out = run(args.scale, args.hidden, args.layers, args.vocab, args.repeats, args.chunk)
    m = out["model"]
    print(
        f"# {out['machine']}; golden / {out['scale']} "
        f"(rows of {out['seq_len']}, {out['levels']} depth levels, {out['segments']} segments), "
        f"Bamba hidden {m['hidden']} x {m['layers']} layers ({m['mamba_layers']} Mamba2, chunk {m['chunk']}), "
        f"median of {args.repeats}"
    )
    report(out, args.json)
    return out


if __name__ == "__main__":
    main()
