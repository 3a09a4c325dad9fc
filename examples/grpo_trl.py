"""GRPO with TRL on tree-packed rows: ``trl.GRPOTrainer`` -> ``TreepackGRPOTrainer``.

    python examples/grpo_trl.py                      # CPU: a tiny random Qwen3 built here, 3 steps
    python examples/grpo_trl.py --check              # the same, next to stock TRL: losses must agree
    python examples/grpo_trl.py --bf16 --check       # bf16 mixed precision (TRL's default), CPU or GPU
    python examples/grpo_trl.py --model Qwen/Qwen3-0.6B --backend flex --bf16   # a GPU, a real model

Nothing is downloaded for the CPU form: the tokenizer (one token per word), the model, the
prompts and the reward are built in this file. With ``--model`` the model and its tokenizer
are loaded by name or path (Hugging Face cache or hub). ``--check`` trains stock TRL and
treepack from the same seed and data and compares, step by step, the loss and the gradient
norm and the sampled completions (identical); it exits 1 on a mismatch. The tolerance is
that of the precision: in fp32 1e-5 absolute or 1e-4 relative; with ``--bf16`` the probe's
stated multiple (4) of bf16's rounding unit (eps/2 = 2^-8), relative, since bf16 sums round
differently in any two batch shapes. Guide: docs/trl.md.
"""

from __future__ import annotations

import argparse
import math
import random
import sys
import tempfile
from typing import Any

import torch

VOCAB = ["<pad>", "<eos>", "<unk>"] + [f"w{i}" for i in range(40)]


def word_tokenizer() -> Any:
    """One token per whitespace-separated word of :data:`VOCAB`; pad 0, eos 1, prompts left-padded."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.WordLevel(vocab={w: i for i, w in enumerate(VOCAB)}, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")
    tok.padding_side = "left"
    return tok


def random_qwen3(path: str) -> str:
    """Save a random 2-layer Qwen3 (hidden 32) to ``path``; returns the path (TRL loads the reference from it)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen3Config(
        vocab_size=len(VOCAB),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=512,
        pad_token_id=0,
        eos_token_id=1,
        bos_token_id=None,
        tie_word_embeddings=False,
    )
    Qwen3ForCausalLM(cfg).float().save_pretrained(path)
    return path


def prompt_set(n: int, words: int) -> list[str]:
    """``n`` prompts of ``words`` words (from :data:`VOCAB`, readable by any tokenizer too)."""
    rng = random.Random(0)
    return [" ".join(rng.choice(VOCAB[3:]) for _ in range(words)) for _ in range(n)]


def reward(completions: list[str], **_: Any) -> list[float]:
    """Prefer short completions that say 'w1' (any non-constant reward will do)."""
    return [c.count("w1") - 0.1 * len(c.split()) for c in completions]


def train(trainer_cls: type, args: argparse.Namespace, model: str, workdir: str, packing: Any = None) -> dict[str, Any]:
    """Train ``trainer_cls`` for ``args.steps`` steps; per-step loss, grad_norm, the completions and logs."""
    from datasets import Dataset
    from transformers import AutoTokenizer, PrinterCallback
    from trl import GRPOConfig

    seen: list[str] = []

    def scored(completions: list[str], **kw: Any) -> list[float]:
        seen.extend(completions)
        return reward(completions)

    config = GRPOConfig(
        output_dir=workdir,
        per_device_train_batch_size=8,
        num_generations=4,
        max_completion_length=args.completion_len,
        max_steps=args.steps,
        learning_rate=args.lr,
        beta=args.beta,
        loss_type=args.loss_type,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        seed=0,
        use_cpu=not torch.cuda.is_available(),
        bf16=args.bf16,
        disable_tqdm=True,
        dataloader_num_workers=0,
        **({"gradient_checkpointing": True} if args.gradient_checkpointing else {}),
    )
    tokenizer = (
        word_tokenizer() if args.model is None else AutoTokenizer.from_pretrained(args.model, padding_side="left")
    )
    kwargs = {} if packing is None else {"packing": packing}
    trainer = trainer_cls(
        model=model,
        reward_funcs=scored,
        args=config,
        processing_class=tokenizer,
        train_dataset=Dataset.from_dict({"prompt": prompt_set(8, args.prompt_words)}),
        **kwargs,
    )
    trainer.remove_callback(PrinterCallback)  # main prints its own line per step
    trainer.train()
    steps = [h for h in trainer.state.log_history if "loss" in h]
    return {
        "loss": [h["loss"] for h in steps],
        "grad_norm": [h["grad_norm"] for h in steps],
        "completions": seen,
        "logs": steps,
    }


# (relative, absolute) tolerance of --check: fp32 rounding, or 4x bf16's rounding unit (the probe's multiple).
FP32_TOL, BF16_TOL = (1e-4, 1e-5), (4 * 2.0**-8, 1e-5)


def compare(packed: dict[str, Any], stock: dict[str, Any], tol: tuple[float, float] = FP32_TOL) -> list[str]:
    """Every difference between two :func:`train` results beyond ``tol`` (relative, absolute), one line each."""
    bad = [
        f"step {i}: {name} {p:.8g} (treepack) vs {s:.8g} (stock)"
        for name in ("loss", "grad_norm")
        for i, (p, s) in enumerate(zip(packed[name], stock[name]), start=1)
        if not math.isclose(p, s, rel_tol=tol[0], abs_tol=tol[1])
    ]
    if len(packed["loss"]) != len(stock["loss"]) or packed["completions"] != stock["completions"]:
        bad.append(
            "the runs sampled different completions or ran different steps (the random stream or generation changed)"
        )
    return bad


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="GRPO with TRL on tree-packed rows (docs/trl.md)")
    ap.add_argument("--model", help="a causal LM name or path (default: a tiny random Qwen3 built here)")
    ap.add_argument("--steps", type=int, default=3, help="optimizer steps")
    ap.add_argument(
        "--check", action="store_true", help="also train stock TRL and compare every step; exit 1 on a mismatch"
    )
    ap.add_argument(
        "--backend", default="auto", choices=("auto", "sdpa", "flex", "flash"), help="tree attention backend"
    )
    ap.add_argument("--seq-len", type=int, default=None, help="row length (default: chosen per batch)")
    ap.add_argument("--min-shared-len", type=int, default=16)
    ap.add_argument("--beta", type=float, default=0.05, help="KL weight (> 0: reference log-probabilities too)")
    ap.add_argument("--loss-type", default="dapo")
    ap.add_argument("--lr", type=float, default=1e-2)
    ap.add_argument("--bf16", action="store_true", help="bf16 mixed precision (TRL's default; CPU or GPU)")
    ap.add_argument("--gradient-checkpointing", action="store_true")
    ap.add_argument("--prompt-words", type=int, default=20)
    ap.add_argument("--completion-len", type=int, default=6)
    args = ap.parse_args(argv)

    import trl
    from transformers.utils import logging as hf_logging

    from treepack.trainer.trl import PackingConfig, TreepackGRPOTrainer

    hf_logging.disable_progress_bar()
    packing = PackingConfig(seq_len=args.seq_len, min_shared_len=args.min_shared_len, backend=args.backend)
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model or random_qwen3(f"{tmp}/model")
        packed = train(TreepackGRPOTrainer, args, model, f"{tmp}/packed", packing)
        for i, h in enumerate(packed["logs"], start=1):
            print(
                f"step {i}: loss {h['loss']:.6f}  grad_norm {h['grad_norm']:.6f}  "
                f"saved {100 * h['treepack/saved_fraction']:.1f}%  rows {h['treepack/rows']:.0f}  "
                f"plan {h['treepack/plan_ms']:.1f} ms"
            )
        if not args.check:
            return 0
        stock = train(trl.GRPOTrainer, args, model, f"{tmp}/stock")
    tol = BF16_TOL if args.bf16 else FP32_TOL
    within = "1e-5 abs / 0.0156 rel (4x bf16 rounding)" if args.bf16 else "1e-5 abs / 1e-4 rel"
    bad = compare(packed, stock, tol)
    for line in bad:
        print(f"check: MISMATCH {line}")
    print(
        f"check: {'FAILED' if bad else 'ok'}: {len(stock['loss'])} steps, "
        f"loss and grad_norm within {within} of stock TRL, same completions"
    )
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
