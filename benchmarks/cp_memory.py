"""CPU benchmark: per-rank peak activation memory and bytes moved per layer under context parallelism.

Usage:
    python benchmarks/cp_memory.py [--tokens 16384] [--cp 1 2 4] [--repeats 2]
                                   [--hidden 128] [--layers 2] [--json out.json]

Workload: one tree row of ``--tokens`` tokens: a system prompt of tokens/8, four task
prompts of tokens/16 under it, each with three completions filling the row (the agent
rollout shape: everything shares the system prompt, completions share their task). Model:
a random Qwen3 (``--layers`` layers, ``--hidden`` hidden, 4 query / 2 key-value heads of
32), fp32, the ``flash`` backend with the pure-torch varlen kernel (its scores are per
segment, so no row-squared mask is built). One step = forward, token-mean NLL over the
completions, backward.

Per CP size (1: no CP) and strategy (Ulysses, all-gather; the all-gather plan splits the
row into 16-token tiles, a few runs per rank, balanced by attention work), on ``cp`` gloo
ranks of this machine:

- peak activation memory of each rank: the process's resident set sampled every 2 ms
  during the step, minus the resident set just before it (model, batch and imports
  excluded; freed memory is handed back first, ``malloc_trim``, so the growth is the
  step's own); the figure is the largest rank's, the spread the min..max over repeats;
- bytes each rank receives per layer, forward + backward, counted at the
  ``torch.distributed`` calls the CP path makes (all-to-all and all-gather: (P-1)/P of the
  output; all-reduce: 2 (P-1)/P of the tensor, a ring; on NCCL the all-gather's backward
  is a reduce-scatter, (P-1)/P of its input, half of gloo's all-reduce).
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import platform
import sys
import tempfile
import threading
import time
from datetime import timedelta

import numpy as np
import torch

VOCAB = 512


def _row(tokens: int) -> list[np.ndarray]:
    rng = np.random.default_rng(0)
    system = rng.integers(0, VOCAB, tokens // 8)
    tasks = [rng.integers(0, VOCAB, tokens // 16) for _ in range(4)]
    per = (tokens - len(system) - sum(len(t) for t in tasks)) // 12
    return [np.concatenate([system, t, rng.integers(0, VOCAB, per)]) for t in tasks for _ in range(3)]


def _model(hidden: int, layers: int) -> torch.nn.Module:
    import transformers as tf

    torch.manual_seed(0)
    cfg = tf.Qwen3Config(
        vocab_size=VOCAB,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=1 << 16,
    )
    return tf.Qwen3ForCausalLM(cfg).float()


class _PeakRss:
    """Largest resident set of this process while running, sampled every 2 ms."""

    def __init__(self) -> None:
        self.page = os.sysconf("SC_PAGE_SIZE")
        self.peak = self.now()
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)

    def now(self) -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * self.page

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self.now())
            time.sleep(0.002)

    def __enter__(self) -> _PeakRss:
        self._t.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._t.join()
        self.peak = max(self.peak, self.now())


class _Traffic:
    """Bytes this rank receives in the CP collectives (module docstring)."""

    def __init__(self, world: int) -> None:
        import torch.distributed as dist

        self.dist, self.P, self.bytes = dist, world, 0
        self.real = {
            n: getattr(dist, n) for n in ("all_to_all_single", "all_gather", "all_reduce", "reduce_scatter_tensor")
        }

    def __enter__(self) -> _Traffic:
        P, d = self.P, self.dist
        share = (P - 1) / P
        size = lambda t: t.numel() * t.element_size()  # noqa: E731

        def a2a(out, inp, *a, **k):
            self.bytes += share * size(out)
            return self.real["all_to_all_single"](out, inp, *a, **k)

        def gather(parts, x, *a, **k):
            self.bytes += share * sum(size(p) for p in parts)
            return self.real["all_gather"](parts, x, *a, **k)

        def reduce(t, *a, **k):
            self.bytes += 2 * share * size(t)
            return self.real["all_reduce"](t, *a, **k)

        def rs(out, inp, *a, **k):
            self.bytes += share * size(inp)
            return self.real["reduce_scatter_tensor"](out, inp, *a, **k)

        d.all_to_all_single, d.all_gather, d.all_reduce, d.reduce_scatter_tensor = a2a, gather, reduce, rs
        return self

    def __exit__(self, *exc) -> None:
        for n, f in self.real.items():
            setattr(self.dist, n, f)


def _worker(rank: int, world: int, port: int, args: dict, out: str) -> None:
    import torch.distributed as dist

    from treepack.service.planner import plan_batch
    from treepack.trainer import ContextParallel, materialize
    from treepack.trainer.hf import packed_forward
    from treepack.trainer.kernels.attention import naive_varlen_attention

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world, timeout=timedelta(seconds=1800)
    )
    try:
        seqs = _row(args["tokens"])
        strategy = args["strategy"]
        plan = plan_batch(
            seqs,
            seq_len=args["tokens"],
            min_shared_len=16,
            trainable=[len(s) - 64 for s in seqs],
            cp_size=world,
            cp_attention=strategy if world > 1 else "auto",
        )
        assert plan.num_rows == 1
        cp = ContextParallel(strategy=strategy) if world > 1 else None
        batch = materialize(plan, seqs, trainable=[len(s) - 64 for s in seqs], cp=cp, advise=False)
        model = _model(args["hidden"], args["layers"])
        mem, moved = [], []
        libc = ctypes.CDLL("libc.so.6")
        for _ in range(args["repeats"] + 1):  # the first step warms up
            model.zero_grad(set_to_none=True)
            gc.collect()
            libc.malloc_trim(0)  # freed memory back to the system: the step's growth is its own
            with _PeakRss() as rss, _Traffic(world) as traffic:
                before = rss.now()
                logits = packed_forward(model, batch, backend="flash", varlen_fn=naive_varlen_attention, verify=False)
                lp = batch.entry_logprobs(logits)
                total = torch.tensor(float(batch.score_counts.sum()))
                (-lp.sum() / total).backward()
                del logits, lp
            mem.append(rss.peak - before)
            moved.append(traffic.bytes / args["layers"])
        with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
            json.dump({"mem": mem[1:], "moved": moved[1:], "shard": int(batch.input_ids.shape[1])}, f)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _run(world: int, strategy: str, args: dict) -> dict:
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as out:
        mp.start_processes(
            _worker,
            args=(world, port, {**args, "strategy": strategy}, out),
            nprocs=world,
            start_method="spawn",
            join=True,
        )
        ranks = [json.load(open(os.path.join(out, f"rank{r}.json"))) for r in range(world)]
    peak = [max(r["mem"][i] for r in ranks) for i in range(args["repeats"])]
    moved = [max(r["moved"][i] for r in ranks) for i in range(args["repeats"])]
    return {
        "cp": world,
        "strategy": strategy if world > 1 else "none",
        "shard_tokens": ranks[0]["shard"],
        "peak_mib": [p / 2**20 for p in peak],
        "moved_mib_per_layer": [m / 2**20 for m in moved],
    }


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--cp", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    args = {"tokens": a.tokens, "repeats": a.repeats, "hidden": a.hidden, "layers": a.layers}
    rows = []
    for world in a.cp:
        for strategy in ["ulysses", "allgather"] if world > 1 else ["auto"]:
            rows.append(_run(world, strategy, args))
            r = rows[-1]
            print(
                f"cp={r['cp']} {r['strategy']:>9}: shard {r['shard_tokens']} tokens, peak activation "
                f"{np.median(r['peak_mib']):.0f} MiB ({min(r['peak_mib']):.0f}..{max(r['peak_mib']):.0f}), "
                f"received {np.median(r['moved_mib_per_layer']):.1f} MiB/layer",
                flush=True,
            )
    base = np.median(rows[0]["peak_mib"]) if rows[0]["cp"] == 1 else None
    report = {
        "machine": (
            f"{platform.machine()} {os.cpu_count()} CPUs, torch {torch.__version__}, Python {platform.python_version()}"
        ),
        "args": args,
        "rows": rows,
    }
    if base:
        for r in rows:
            r["peak_ratio"] = float(np.median(r["peak_mib"]) / base)
    print(json.dumps(report, indent=1))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    sys.exit(main())
