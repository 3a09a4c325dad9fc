"""PEFT aLoRA under context parallelism on 2 gloo CPU ranks against one process and each sequence alone.

Each rank runs a tiny Qwen3 with an aLoRA adapter (a ``PeftModelForCausalLM``) on its CP shard
of the mixed batch (:mod:`helpers.cp_oracle`), under Ulysses and all-gather attention: the
shard's per-sequence logprobs equal each sequence run alone, and the losses and adapter
gradients summed over the group equal one process on whole rows. Two invocations: sequence
0's completion tokens 22-23 (on from there for sequence 0 only, inside rank 0's shard) and
tokens 3-4 of the prompt the first tree's sequences share (on from there for all of them,
across both shards). Negative control: without treepack's per-sequence activation PEFT finds the invocation once
per input row of the shard, counted from the shard's end, and the logprobs differ.
"""

from __future__ import annotations

import functools
import importlib
import json

import torch

from helpers import cp_oracle as oracle
from helpers.ranks import run_ranks
from helpers.trainer_cases import mixed_batch, reference_logprobs, tiny_model, trainable_flags

TIMEOUT_S = 420  # a safety net on a loaded machine; the runs take far less
MODES = ("auto", "allgather")  # auto: Ulysses (4 heads over 2 ranks); allgather: balanced tiles
AT = {"completion": 22, "prompt": 3}  # where in sequence 0 the invocation (2 tokens) is taken


def _build(at: int) -> torch.nn.Module:
    import peft

    s0 = mixed_batch()["sequences"][0]
    torch.manual_seed(0)
    cfg = peft.LoraConfig(
        r=4,
        target_modules=["q_proj", "v_proj", "down_proj"],
        alora_invocation_tokens=[int(s0[at]), int(s0[at + 1])],
        task_type="CAUSAL_LM",
    )
    model = peft.get_peft_model(tiny_model("qwen3"), cfg).eval()
    torch.manual_seed(1)
    with torch.no_grad():  # off their init (LoRA's B = 0 would make the adapter vanish)
        for p in model.parameters():
            if p.requires_grad:
                p.add_(0.05 * torch.randn_like(p))
    return model


def _run(world: int, cp_attention: str, at: int) -> dict:
    """This rank's CP step with the aLoRA model, and its logprobs against each sequence alone
    (with treepack's activation, and with PEFT's own per-row offsets: the control)."""
    from treepack.trainer.hf import packed_forward

    build = functools.partial(_build, at)
    s = oracle.shard_mixed_batch(world, cp_attention=cp_attention)
    ref = oracle.reference_step(build, s)
    c = mixed_batch()
    with torch.no_grad():
        alone = oracle.detached(reference_logprobs(build(), c["sequences"], trainable_flags(c)))
    step = oracle.step_record(build(), s, ref)
    with torch.no_grad():
        mine = s.mine.unpack_logprobs(packed_forward(build(), s.mine, verify=False))
    run = importlib.import_module("treepack.trainer.hf.run")
    stock, run.alora_inputs = run.alora_inputs, lambda model, batch: {}
    try:
        with torch.no_grad():
            ctl = s.mine.unpack_logprobs(packed_forward(build(), s.mine, verify=False))
    finally:
        run.alora_inputs = stock
    return {
        **step,
        **oracle.shard_record(s),
        "alone_lp_diff": oracle.lp_diff(oracle.detached(mine), alone),
        "control_lp_diff": oracle.lp_diff(oracle.detached(ctl), alone),
    }


def _worker(rank: int, port: int, out_dir: str) -> None:
    with oracle.gloo_group(rank, port, 2, timeout_s=90):
        runs = {f"{mode}/{case}": _run(2, mode, at) for mode in MODES for case, at in AT.items()}
        oracle.write_result(out_dir, rank, runs)


def test_alora_on_cp_ranks_matches_one_process_and_each_sequence_alone(tmp_path):
    results = run_ranks(_worker, tmp_path, TIMEOUT_S, nprocs=2)
    (tmp_path / "summary.json").write_text(json.dumps(results))  # the figures, for a report
    for what in results[0]:
        records = [r[what] for r in results]
        for f in records:
            oracle.assert_shard_size(f, 2)
            oracle.assert_step_matches(f, f["shard_len"], what)
            assert f["alone_lp_diff"] <= oracle.TOL, (what, f)
            # PEFT's own offsets, per row of a shard: the activation of another sequence, or none.
            assert f["control_lp_diff"] > oracle.CONTROL_GAP, (what, f)
        oracle.assert_same_summed_loss(records)
