"""``treepack check``: the parity report of a model on a batch, from the command line.

Loads a causal LM (a Hugging Face name or a local path), packs a batch (a ``treepack plan``
JSONL file, or a synthetic GRPO-shaped one: four prompts with four completions each, drawn
from the model's vocabulary), and prints :func:`treepack.trainer.parity_report`'s tables:
per-token logprob drift of the packed rows against each sequence alone (max, p99, p50), the
same for other unpacked batch shapes (the model's own noise floor at this precision),
gradient drift per parameter group and PPO clip-band crossings. Paste it into a bug report.

torch, transformers and the trainer are imported only when the command runs: without them
it says which extra to install (``trainer``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from typing import Any

import numpy as np

from treepack.proto.errors import RequestError, TreepackError
from treepack.service.cli.plan import read_jsonl

__all__ = ["add_check_parser", "run_check", "synthetic_batch"]

_DTYPES = ("float32", "bfloat16", "float16", "float64")
_AUTOCAST = {"none": None, "bf16": "bfloat16", "fp16": "float16"}


def synthetic_batch(vocab: int, *, prompts: int = 4, completions: int = 4, seed: int = 0) -> tuple[list, list]:
    """A GRPO-shaped batch: ``prompts`` prompts of 48 tokens, each with ``completions``
    completions of 12 to 40 tokens, token ids in [3, vocab). Returns (sequences, prompt lengths)."""
    rng = np.random.default_rng(seed)
    lo = 3 if vocab > 8 else 0
    seqs, trainable = [], []
    for _ in range(prompts):
        prompt = rng.integers(lo, vocab, 48)
        for _ in range(completions):
            seqs.append(np.concatenate([prompt, rng.integers(lo, vocab, int(rng.integers(12, 41)))]))
            trainable.append(48)
    return seqs, trainable


def _missing(name: str) -> int:
    print(
        f"treepack check: error: it needs the trainer extra ({name} is missing): "
        "pip install 'treepack[trainer]' (or pip install -e '.[trainer]' in the clone)",
        file=sys.stderr,
    )
    return 2


def _batch(args: argparse.Namespace, vocab: int) -> tuple[list, list, Any]:
    if args.batch is None:
        seqs, trainable = synthetic_batch(vocab)
        return seqs, trainable, [i // 4 for i in range(len(seqs))]
    with open(args.batch, encoding="utf-8") as f:
        seqs, trainable, groups = read_jsonl(f.read().splitlines())
    too_big = [i for i, s in enumerate(seqs) if int(s.max(initial=0)) >= vocab]
    if too_big:
        raise RequestError(
            f"token ids of sequence {too_big[0]} reach {int(seqs[too_big[0]].max())}, beyond the model's vocabulary "
            f"of {vocab}",
            path=f"$.sequences[{too_big[0]}]",
            rule="range",
        )
    return seqs, trainable, groups


def run_check(args: argparse.Namespace) -> int:
    """Load, pack, report; 2 on bad input or a missing extra."""
    try:
        import torch
        import transformers
    except ImportError as exc:
        return _missing(exc.name or str(exc))
    from treepack.service.planner import plan_batch
    from treepack.trainer import materialize, naive_varlen_attention, parity_report

    try:
        model = transformers.AutoModelForCausalLM.from_pretrained(args.model, dtype=getattr(torch, args.dtype))
    except (OSError, ValueError) as exc:
        print(f"treepack check: error: cannot load {args.model}: {exc}", file=sys.stderr)
        return 2
    model = model.to(args.device).train(args.mode == "train")
    if args.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    try:
        seqs, trainable, groups = _batch(args, int(model.get_input_embeddings().num_embeddings))
        longest = max(len(s) for s in seqs)
        seq_len = args.seq_len or -(-max(longest, min(sum(len(s) for s in seqs), 4096)) // 128) * 128
        plan = plan_batch(seqs, seq_len=seq_len, trainable=trainable, groups=groups, min_shared_len=16)
        batch = materialize(plan, seqs, trainable=trainable, device=args.device)
        on_cpu = torch.device(args.device).type == "cpu"
        options: dict[str, Any] = {"varlen_fn": naive_varlen_attention} if args.backend == "flash" and on_cpu else {}
        autocast = _AUTOCAST[args.autocast]
        dtype = getattr(torch, autocast) if autocast else None
        with torch.autocast(torch.device(args.device).type, dtype=dtype, enabled=dtype is not None):
            report = parity_report(
                model,
                batch,
                backend=args.backend,
                sequences=args.sequences,
                epsilon=args.epsilon,
                grads=not args.no_grads,
                **options,
            )
    except (OSError, TreepackError) as exc:
        print(f"treepack check: error: {exc}", file=sys.stderr)
        return 2
    if args.json:
        out = {
            "model": report.model,
            "setup": report.setup,
            "compute_dtype": report.compute_dtype,
            "tokens": report.tokens,
            "noise_floor": report.noise_floor,
            "ratio": report.ratio,
            "grad_ratio": report.grad_ratio,
            "drift": {k: dataclasses.asdict(d) for k, d in report.drift.items()},
            "grads": [list(g) for g in report.grads],
        }
        print(json.dumps(out))
    else:
        print(report.table())
    return 0


def add_check_parser(sub: Any) -> None:
    """Register ``treepack check``."""
    p = sub.add_parser("check", help="parity report: packed vs each sequence alone, against the model's noise floor")
    p.description = __doc__.split("\n\n")[0] + "\n\n" + __doc__.split("\n\n")[1]
    p.add_argument("--model", required=True, help="a causal LM: Hugging Face name or local path")
    p.add_argument("--batch", help="a `treepack plan` JSONL batch (default: synthetic GRPO groups)")
    p.add_argument("--seq-len", type=int, default=None, help="row length (default: the batch, up to 4096)")
    p.add_argument("--backend", default="sdpa", choices=("sdpa", "flex", "flash"))
    p.add_argument("--dtype", default="float32", choices=_DTYPES, help="the parameters' dtype")
    p.add_argument("--autocast", default="none", choices=tuple(_AUTOCAST), help="run under autocast")
    p.add_argument("--mode", default="train", choices=("train", "eval"))
    p.add_argument("--gradient-checkpointing", action="store_true")
    p.add_argument("--sequences", type=int, default=16, help="sequences compared (the first ones)")
    p.add_argument("--epsilon", type=float, default=0.2, help="PPO clip band")
    p.add_argument("--device", default="cpu")
    p.add_argument("--no-grads", action="store_true", help="log-probabilities only")
    p.add_argument("--json", action="store_true", help="the figures as one JSON line")
    p.set_defaults(func=run_check)
