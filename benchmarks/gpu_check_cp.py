"""The ``cp`` section of ``benchmarks/gpu_check.py``: context parallelism over the GPUs of one machine.

On P = min(GPUs, 4) ranks (NCCL, one GPU each): a tree batch in rows of 4,096 tokens, a
random Qwen3 with 4 query heads (Ulysses under ``auto``) and one with 3 (all-gather), each
planned ``auto`` and ``allgather``; every rank materializes its shard and runs forward,
loss and backward; the losses summed and the gradients summed over the group are checked
against one GPU running whole rows (``sdpa``; bf16 tolerance on fp32 models: 1e-4), then
the CP step is timed. Where there is at most one GPU the section says so and does not run.
"""

from __future__ import annotations

import json
import os
import socket
import tempfile
import time
from datetime import timedelta

import numpy as np
import torch

VOCAB = 512
MODELS = {"qwen3_4h": (4, 2), "qwen3_3h": (3, 1)}


def _batch():
    rng = np.random.default_rng(0)
    seqs = []
    for _ in range(6):
        prompt = rng.integers(0, VOCAB, 1024)
        seqs += [np.concatenate([prompt, rng.integers(0, VOCAB, n)]) for n in (700, 900, 1100)]
    return seqs, [1024] * len(seqs)


def _model(heads, device):
    import transformers as tf

    torch.manual_seed(0)
    cfg = tf.Qwen3Config(
        vocab_size=VOCAB,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=heads[0],
        num_key_value_heads=heads[1],
        head_dim=32,
        max_position_embeddings=8192,
    )
    return tf.Qwen3ForCausalLM(cfg).float().to(device)


def _step(model, batch):
    from treepack.trainer.hf import packed_forward

    model.zero_grad(set_to_none=True)
    lp = batch.entry_logprobs(packed_forward(model, batch, verify=False))
    loss = -lp.sum() / float(batch.score_counts.sum())
    loss.backward()
    return loss.detach()


def _worker(rank: int, world: int, port: int, out: str, backend: str) -> None:
    import torch.distributed as dist

    from treepack.service.planner import plan_batch
    from treepack.trainer import ContextParallel, materialize

    device = torch.device(f"cuda:{rank}") if backend == "nccl" else torch.device("cpu")
    if backend == "nccl":
        torch.cuda.set_device(device)
    dist.init_process_group(
        backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world, timeout=timedelta(seconds=300)
    )
    try:
        seqs, prompts = _batch()
        cp = ContextParallel()
        res = {}
        for mode in ("auto", "allgather"):
            plan1 = plan_batch(seqs, seq_len=4096, min_shared_len=64, trainable=prompts)
            plan = plan_batch(
                seqs, seq_len=4096, min_shared_len=64, trainable=prompts, cp_size=world, cp_attention=mode
            )
            full = materialize(plan1, seqs, trainable=prompts, device=device, advise=False)
            mine = materialize(plan, seqs, trainable=prompts, device=device, cp=cp, advise=False)
            for name, heads in MODELS.items():
                ref, model = _model(heads, device), _model(heads, device)
                ref_loss = _step(ref, full)
                loss = _step(model, mine)
                dist.all_reduce(loss)
                rel = 0.0
                for p, q in zip(model.parameters(), ref.parameters()):
                    g = p.grad.clone()
                    dist.all_reduce(g)
                    rel = max(rel, float((g - q.grad).abs().max() / q.grad.abs().max().clamp_min(1e-30)))
                if backend == "nccl":
                    torch.cuda.synchronize()
                t0 = time.perf_counter()
                for _ in range(3):
                    _step(model, mine)
                if backend == "nccl":
                    torch.cuda.synchronize()
                res[f"{mode}/{name}"] = dict(
                    loss_diff=abs(float(loss) - float(ref_loss)),
                    grad_rel=rel,
                    step_ms=(time.perf_counter() - t0) / 3 * 1e3,
                )
        if rank == 0:
            with open(os.path.join(out, "cp.json"), "w") as f:
                json.dump(res, f)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def run(world: int, backend: str = "nccl", tol: float = 1e-4) -> dict:
    """Spawn ``world`` ranks and check CP against one device (module docstring)."""
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as out:
        mp.start_processes(_worker, args=(world, port, out, backend), nprocs=world, start_method="spawn", join=True)
        res = json.load(open(os.path.join(out, "cp.json")))
    ok = all(r["loss_diff"] <= tol * 10 and r["grad_rel"] <= tol for r in res.values())
    return dict(ok=ok, ranks=world, backend=backend, results=res)


def section(cpu_smoke: bool) -> dict:
    """The gpu_check section: runs on more than one GPU, says so otherwise."""
    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if cpu_smoke or n < 2:
        return dict(ok=None, skipped=f"context parallelism needs more than one GPU; this machine has {n}")
    return run(min(n, 4))
