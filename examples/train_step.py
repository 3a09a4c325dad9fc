"""One GRPO training step of a small HF model on a tree-packed batch (runs on CPU).

    python examples/train_step.py                            # embedded planner
    python examples/train_step.py --url http://127.0.0.1:8000  # a `treepack serve` sidecar
    python examples/train_step.py --backend flash --check    # varlen-gather path + oracle

The batch looks like RL rollouts: one system prompt shared by every task, a prompt per
task, several completions per prompt (trainable). The plan comes from
``treepack.client.Packer`` through ``obtain_plan`` (the sidecar when ``--url`` is given,
else in-process). The step: behaviour logprobs
from the current policy, group-normalized advantages, packed forward, PPO-clip loss,
backward, AdamW. ``--check`` also runs every sequence alone and compares.
"""

from __future__ import annotations

import argparse
import copy
import time

import numpy as np
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from treepack.trainer import materialize, naive_varlen_attention
from treepack.trainer.distributed import obtain_plan
from treepack.trainer.hf import packed_forward
from treepack.trainer.losses import naive_ppo_clip_loss, ppo_clip_loss

VOCAB = 300


def make_batch(seed: int = 0, tasks: int = 3, completions: int = 4):
    """Sequences, prompt lengths (trainable from there on) and group ids."""
    rng = np.random.default_rng(seed)
    system = rng.integers(0, VOCAB, 48)
    seqs, trainable, groups = [], [], []
    for t in range(tasks):
        prompt = np.concatenate([system, rng.integers(0, VOCAB, int(rng.integers(16, 40)))])
        for _ in range(completions):
            seqs.append(np.concatenate([prompt, rng.integers(0, VOCAB, int(rng.integers(8, 48)))]))
            trainable.append(len(prompt))
            groups.append(f"task{t}")
    return seqs, trainable, groups


def grpo_advantages(rewards: np.ndarray, groups: list[str]) -> torch.Tensor:
    """(r - group mean) / (group std + eps), one value per sequence."""
    out = np.zeros_like(rewards)
    for g in set(groups):
        idx = [i for i, x in enumerate(groups) if x == g]
        r = rewards[idx]
        out[idx] = (r - r.mean()) / (r.std() + 1e-6)
    return torch.from_numpy(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", default=None, help="sidecar URL; default: plan in-process")
    ap.add_argument("--backend", default="sdpa", choices=["sdpa", "flash", "flex"])
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--check", action="store_true", help="compare with every sequence run alone")
    args = ap.parse_args()
    torch.manual_seed(0)

    seqs, trainable, groups = make_batch()
    print(f"planner: {'sidecar at ' + args.url if args.url else 'embedded Packer'}")
    plan = obtain_plan(
        seqs, planner=args.url, seq_len=args.seq_len, min_shared_len=16, trainable=trainable, groups=groups
    )
    st = plan.stats
    print(
        f"plan: {st.sequences} sequences, {st.unpacked_tokens} tokens unpacked -> {st.rows} rows of {plan.seq_len} "
        f"({st.packed_tokens} packed tokens, {st.saved_fraction:.0%} saved, lower bound {st.lower_bound_rows} rows)"
    )

    cfg = Qwen3Config(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=512,
    )
    model = Qwen3ForCausalLM(cfg).float()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ref_model = copy.deepcopy(model) if args.check else None
    # A CPU stand-in for flash-attn when --backend flash runs without a GPU.
    varlen = None if torch.cuda.is_available() else naive_varlen_attention
    if args.backend == "flex":
        model.eval()  # no CPU backward for FlexAttention: forward only below

    t0 = time.perf_counter()
    batch = materialize(plan, seqs, trainable=trainable, groups=groups)
    with torch.no_grad():
        old = batch.unpack_logprobs(packed_forward(model, batch, backend=args.backend, varlen_fn=varlen))
    batch = materialize(plan, seqs, payloads={"old": old}, trainable=trainable, groups=groups)
    rewards = np.random.default_rng(1).normal(size=len(seqs))
    adv = grpo_advantages(rewards, groups)
    t1 = time.perf_counter()

    grad_ctx = torch.no_grad() if args.backend == "flex" else torch.enable_grad()
    with grad_ctx:
        logprobs = batch.target_logprobs(packed_forward(model, batch, backend=args.backend, varlen_fn=varlen))
        loss = ppo_clip_loss(logprobs, batch, advantages=adv, old_logprobs="old", normalization="token")
    if args.backend != "flex":
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        check_grads = {n: p.grad.clone() for n, p in model.named_parameters()} if args.check else None
        opt.step()
        opt.zero_grad()
        print(
            f"step: loss {float(loss.detach()):.6f}, grad norm {float(norm):.4f}, "
            f"materialize+old logprobs {1e3 * (t1 - t0):.0f} ms, "
            f"forward+backward+step {1e3 * (time.perf_counter() - t1):.0f} ms"
        )
    else:
        print(f"forward only (flex on CPU): loss {float(loss.detach()):.6f}")

    if args.check:
        # The weights before the step, each sequence alone through the stock model.
        seq_lp = []
        for seq in seqs:
            x = torch.as_tensor(seq)[None]
            lp = (
                torch.log_softmax(ref_model(input_ids=x, use_cache=False).logits[0, :-1], -1)
                .gather(1, x[0, 1:, None])
                .squeeze(1)
            )
            seq_lp.append(torch.cat([lp.new_zeros(1), lp]))
        flags = [torch.arange(len(s)) >= p for s, p in zip(seqs, trainable)]
        ref = naive_ppo_clip_loss(
            seq_lp,
            flags,
            advantages=adv,
            old_logprobs=[torch.nan_to_num(o) for o in old],
            groups=groups,
            normalization="token",
        )
        diff_lp = max(float((a[1:][f[1:]] - b.detach()[1:][f[1:]]).abs().max()) for a, b, f in zip(old, seq_lp, flags))
        print(
            f"check: packed loss {float(loss.detach()):.8f} vs unpacked {float(ref.detach()):.8f}; "
            f"max |logprob diff| {diff_lp:.2e}"
        )
        if args.backend != "flex":
            ref.backward()
            rel = max(
                float((check_grads[n] - p.grad).abs().max() / p.grad.abs().max())
                for n, p in ref_model.named_parameters()
            )
            print(f"check: max relative gradient difference {rel:.2e}")


if __name__ == "__main__":
    main()
