"""Wall time of N TRL GRPO training steps, stock ``trl.GRPOTrainer`` vs ``TreepackGRPOTrainer`` (CPU).

A realistic GRPO shape at CPU scale: G prompts of P tokens per step, 8 completions each of
at most C tokens (P several times C), a random Qwen3 (nothing downloaded; a word-level
tokenizer built in code), beta > 0 (the reference pass runs too). Both trainers run the same
seed, so they generate the same completions; the difference is the forward/backward on
padded ``[B, P + C]`` rows (stock) vs tree rows (each prompt once per row). Prints a markdown
row: times, the ratio, and the token ratio (padded tokens / packed tokens of the plans).

    python benchmarks/trl_grpo.py --steps 4 --prompt-len 384 --completion-len 48
"""

from __future__ import annotations

import argparse
import random
import tempfile
import time

import torch


def _tokenizer(words: int):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate(["<pad>", "<eos>", "<unk>"] + [f"w{i}" for i in range(words)])}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")
    fast.padding_side = "left"
    return fast


def _model(vocab: int, hidden: int, layers: int, path: str) -> str:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg = Qwen3Config(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=3 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=hidden // 32,
        num_key_value_heads=max(1, hidden // 64),
        head_dim=32,
        max_position_embeddings=4096,
        pad_token_id=0,
        eos_token_id=1,
        bos_token_id=None,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    Qwen3ForCausalLM(cfg).float().save_pretrained(path)
    return path


def _timed(trainer_cls):
    """``trainer_cls`` with its generation timed (``gen_s``), so training compute = step time - generation."""

    class Timed(trainer_cls):
        gen_s = 0.0

        def _generate_single_turn(self, *args, **kwargs):
            t0 = time.perf_counter()
            try:
                return super()._generate_single_turn(*args, **kwargs)
            finally:
                Timed.gen_s += time.perf_counter() - t0

    return Timed


def run(trainer_cls, a: argparse.Namespace, workdir: str, **extra) -> dict:
    """Train ``trainer_cls`` for ``a.steps`` steps; returns wall time, generation time and the logs."""
    from datasets import Dataset
    from trl import GRPOConfig

    trainer_cls = _timed(trainer_cls)

    rng = random.Random(0)
    prompts = [" ".join(f"w{rng.randrange(a.words)}" for _ in range(a.prompt_len)) for _ in range(a.prompts * a.steps)]
    args = GRPOConfig(
        output_dir=workdir,
        per_device_train_batch_size=8 * a.prompts,
        num_generations=8,
        max_completion_length=a.completion_len,
        max_steps=a.steps,
        learning_rate=1e-4,
        beta=0.04,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        seed=0,
        use_cpu=True,
        disable_tqdm=True,
        # fp32 on both sides (TRL's GRPOConfig defaults to bf16 autocast): the timings compare
        # the same arithmetic, and the packed step's probe takes its bound from fp32.
        bf16=getattr(a, "bf16", False),
    )
    model = _model(a.words + 3, a.hidden, a.layers, f"{workdir}/init")
    trainer = trainer_cls(
        model=model,
        reward_funcs=lambda completions, **k: [len(c) % 7 for c in completions],
        args=args,
        train_dataset=Dataset.from_dict({"prompt": prompts}),
        processing_class=_tokenizer(a.words),
        **extra,
    )
    t0 = time.perf_counter()
    trainer.train()
    end = time.perf_counter()
    return {"s": end - t0, "end": end, "gen_s": trainer_cls.gen_s, "logs": trainer.state.log_history}


def main() -> None:
    import trl

    from treepack.trainer.trl import PackingConfig, TreepackGRPOTrainer

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--prompts", type=int, default=2, help="prompts per step (8 completions each)")
    p.add_argument("--prompt-len", type=int, default=384)
    p.add_argument("--completion-len", type=int, default=48)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--words", type=int, default=1000)
    p.add_argument("--bf16", action="store_true", help="TRL's bf16 autocast on both sides (default: fp32)")
    a = p.parse_args()
    torch.set_num_threads(max(1, torch.get_num_threads()))
    with tempfile.TemporaryDirectory() as d:
        stock = run(trl.GRPOTrainer, a, f"{d}/stock")
        packed = run(TreepackGRPOTrainer, a, f"{d}/packed", packing=PackingConfig(min_shared_len=16))
    steps = lambda r: [h for h in r["logs"] if "loss" in h]  # noqa: E731
    saved = [h["treepack/saved_fraction"] for h in steps(packed)]
    mean = sum(saved) / len(saved)
    train = lambda r: r["s"] - r["gen_s"]  # noqa: E731
    same = [h["reward"] for h in steps(stock)] == [h["reward"] for h in steps(packed)]
    print(
        "| steps | B (prompts x 8) | P / C tokens | model | wall s stock / treepack | generation s stock / treepack | "
        "training s (wall - generation) stock / treepack | training speedup | saved fraction | "
        "token ratio unpacked / packed | same rewards |"
    )
    print("|---:|---:|---|---|---|---|---|---:|---:|---:|---|")
    print(
        f"| {a.steps} | {8 * a.prompts} | {a.prompt_len} / {a.completion_len} | Qwen3 {a.layers}x{a.hidden} | "
        f"{stock['s']:.1f} / {packed['s']:.1f} | "
        f"{stock['gen_s']:.1f} / {packed['gen_s']:.1f} | {train(stock):.1f} / {train(packed):.1f} | "
        f"{train(stock) / train(packed):.2f}x | {mean:.3f} | {1 / (1 - mean):.2f} | {same} |"
    )


if __name__ == "__main__":
    main()
