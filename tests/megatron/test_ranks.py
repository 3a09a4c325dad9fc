"""DP x TP on gloo: the packed step on several ranks equals one process and HF running each sequence alone.

Each configuration starts its ranks as processes (``ranks_worker.py``): 2 ranks TP=2, 2 ranks
DP=2, 4 ranks DP=2 x TP=2. Every rank's tree rows run through ``from_hf(hf, tp)`` and
``packed_forward``; the GRPO loss reads vocab-parallel logits (this rank's vocabulary slice);
the gradients are summed over DP (and the qk-norm weights over TP) as Megatron's
``finalize_model_grads`` does, and gathered to HF names by Bridge's export. Checked: the
per-sequence log-probabilities (each from the rank holding it), the loss (the DP ranks' losses
add up), every gradient, against HF alone and against this process (TP = DP = 1).

Negative control (DP): one rank's gradients before the DP sum (its rows alone) miss HF's.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time

import oracle
import pytest
import torch

from treepack.trainer.megatron import from_hf

from helpers.tolerance import assert_close

HERE = os.path.dirname(os.path.abspath(__file__))
CONFIGS = {  # name: (world, tp, families)
    "tp2": (2, 2, ["llama-gqa", "qwen3-qknorm"]),
    "dp2": (2, 1, ["qwen2-bias"]),
    "dp2xtp2": (4, 2, ["qwen3-qknorm"]),
}


def run_ranks(world: int, tp: int, families: list[str], timeout_s: float = 300) -> tuple[list[dict], float]:
    """Start ``world`` worker ranks, wait for them, read their results (and the wall time)."""
    out = tempfile.mkdtemp(prefix="treepack-megatron-ranks-")
    init = tempfile.mktemp(prefix="treepack-megatron-gloo-")
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE")}
    env["OMP_NUM_THREADS"] = "1"
    t0 = time.monotonic()
    procs = [
        subprocess.Popen(
            [sys.executable, "-W", "ignore", os.path.join(HERE, "ranks_worker.py"), str(r), str(world), str(tp), init]
            + [out, *families],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for r in range(world)
    ]
    logs = []
    for p in procs:
        try:
            logs.append(p.communicate(timeout=timeout_s)[0])
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
    for r, (p, log) in enumerate(zip(procs, logs)):
        assert p.returncode == 0, f"rank {r} failed:\n{log[-4000:]}"
    results = [torch.load(os.path.join(out, f"rank{r}.pt"), weights_only=False) for r in range(world)]
    return results, time.monotonic() - t0


@pytest.fixture(scope="module")
def case():
    return oracle.tree_case(0)


@pytest.fixture(scope="module")
def one_process(case):
    """Per family: (HF alone, this process's TP = DP = 1 step: lps, loss, HF-named grads)."""
    cache: dict = {}

    def get(family):
        if family not in cache:
            seqs, prompts, plan, adv = case
            hf = oracle.hf_model(family)
            ref = oracle.hf_alone(hf, seqs, prompts, adv)
            model = from_hf(hf, tp=1)
            r = oracle.step(model, plan, seqs, adv)
            cache[family] = ref, (r["lps"], r["loss"], oracle.hf_grads(model, oracle.hf_bridge(hf)))
        return cache[family]

    return get


@pytest.mark.parametrize("config", list(CONFIGS))
def test_ranks_equal_one_process_and_hf_alone(config, case, one_process):
    world, tp, families = CONFIGS[config]
    results, seconds = run_ranks(world, tp, families)
    dp = world // tp
    assert all(r["tp"] == tp and r["dp"] == dp for r in results)
    seqs = case[0]
    for fam in families:
        per_rank = [r["families"][fam] for r in results]
        assert all(x["vocab_shard"] * tp == oracle.VOCAB for x in per_rank)  # each TP rank holds its slice
        lps: list = [None] * len(seqs)
        for x in per_rank:
            for i, v in enumerate(x["lps"]):
                if v is not None:
                    lps[i] = v
        loss = sum(x["loss"] for x in per_rank) / tp  # TP ranks hold the same loss; DP ranks' losses add up
        grads = per_rank[0]["grads"]
        for x in per_rank[1:]:
            assert_close(f"{fam} grads agree across ranks", grads, x["grads"], atol=0.0)
        ref, (one_lps, one_loss, one_g) = one_process(fam)
        oracle.compare(fam, tp, dp, "sdpa", ref, lps, loss, grads)
        assert_close(f"{fam} {config} logprobs vs one process", one_lps, lps, atol=oracle.TOL)
        assert_close(f"{fam} {config} loss vs one process", one_loss, loss, atol=oracle.TOL)
        assert_close(f"{fam} {config} grads vs one process", one_g, grads, ratio=oracle.TOL)
        if dp > 1:
            local, ref_g = per_rank[0]["local_grads"], ref[2]
            err = max(float((local[k] - ref_g[k]).abs().max() / ref_g[k].abs().max()) for k in ref_g)
            oracle.CONTROLS.append((f"{fam} {config}: rank 0's gradients before the DP sum (relative)", err))
            assert err > oracle.CONTROL_GAP, err
    oracle.TIMINGS.append((f"{config}: {world} ranks, {len(families)} families", seconds))
