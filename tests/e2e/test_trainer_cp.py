"""Context parallelism on 2 and 4 gloo CPU ranks against the single-process packed step.

Every rank of the CP group materializes its shard of every row (``materialize(..., cp=)``),
runs ``packed_forward`` (Ulysses attention inside), takes its shard's PPO-clip loss
(normalized over the whole batch) and backward; the losses summed and the gradients summed
over the group must equal one process running the whole rows (logprobs 1e-5 absolute,
gradients 1e-5 relative to each parameter's largest gradient). Negative control: a
rank's shard run alone (its queries see only the keys of its own shard) differs. A GDN
hybrid (Qwen3-Next) whose value heads do not divide over the ranks is refused by name
before compute (the mixers' CP oracle: test_trainer_cp_mixers.py).
"""

from __future__ import annotations

import dataclasses
import json
import os
from datetime import timedelta

import numpy as np
import pytest
import torch

from helpers.ranks import run_ranks
from helpers.trainer_cases import VOCAB, mixed_batch, plan_of, tiny_gpt_oss, tiny_llama4, tiny_model

TIMEOUT_S = 240
# (CP ranks, families): one spawn per group size (process start and imports dominate).
CASES = [(2, ("qwen3", "gemma2", "gpt_oss", "llama4")), (4, ("qwen3", "gpt_oss"))]


def _build(family):
    return {"gpt_oss": tiny_gpt_oss, "llama4": tiny_llama4}.get(family, lambda: tiny_model(family))()


def _tiny_qwen3_next():
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    cfg = Qwen3NextConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=32, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
        head_dim=8, linear_num_key_heads=1, linear_num_value_heads=3, linear_key_head_dim=8, linear_value_head_dim=8,
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=16, max_position_embeddings=512,
    )  # fmt: skip
    torch.manual_seed(0)
    return Qwen3NextForCausalLM(cfg).float().eval()


def _loss(batch, logits, adv):
    from treepack.trainer.losses import ppo_clip_loss

    return ppo_clip_loss(batch.target_logprobs(logits), batch, advantages=adv, old_logprobs="old", normalization="sequence")


def _lp_diff(a, b):
    worst = 0.0
    for x, y in zip(a, b):
        if x is None or y is None:
            assert x is None and y is None
            continue
        assert torch.equal(torch.isnan(x), torch.isnan(y))
        m = ~torch.isnan(x)
        if m.any():
            worst = max(worst, float((x[m] - y[m]).abs().max()))
    return worst


def _local_only(batch):
    """The shard as a batch of its own: its queries see the keys of their own shard only."""
    a = batch.cp.rank * batch.seq_len
    se = (batch.subtree_end - a).clamp(max=batch.seq_len)
    return dataclasses.replace(batch, cp=None, cp_full=None, subtree_end=se, _cache={})


def _worker(rank: int, port: int, out_dir: str) -> None:
    import torch.distributed as dist

    from treepack.proto.errors import UnsupportedModelError
    from treepack.proto.options import CP_ALIGN
    from treepack.trainer import ContextParallel, materialize
    from treepack.trainer.hf import packed_forward
    from treepack.trainer.kernels.cp import gather_seq

    cfg = json.load(open(os.path.join(out_dir, "world.json")))
    world, families = cfg["world"], cfg["families"]
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world, timeout=timedelta(seconds=90))
    try:
        cp = ContextParallel()
        c = mixed_batch()
        plan1 = plan_of(c)
        plan = plan_of(c, cp_size=world)
        assert np.array_equal(plan.segments.row, plan1.segments.row)
        rng = np.random.default_rng(7)
        old = [rng.normal(-4.6, 0.4, len(s)) for s in c["sequences"]]
        adv = torch.from_numpy(rng.normal(0, 1, len(c["sequences"])))
        full = materialize(plan1, c["sequences"], payloads={"old": old})
        mine = materialize(plan, c["sequences"], payloads={"old": old}, cp=cp)
        C, Ls = plan.seq_len, plan.ranks.shard_len
        result = {"shard_len": Ls, "seq_len": C, "align": CP_ALIGN, "strategy": cp.strategy, "families": {}}
        result["shape"] = list(mine.input_ids.shape)
        result["entries"] = mine.num_scored
        for family in families:
            ref_model = _build(family)
            ref_logits = packed_forward(ref_model, full)
            ref_lp = [None if x is None else x.detach() for x in full.unpack_logprobs(ref_logits)]
            ref_loss = _loss(full, ref_logits, adv)
            ref_loss.backward()
            model = _build(family)
            logits = packed_forward(model, mine)
            lps = [None if x is None else x.detach() for x in mine.unpack_logprobs(logits.detach())]
            loss = _loss(mine, logits, adv)
            loss.backward()
            total = loss.detach().clone()
            dist.all_reduce(total)
            rel = 0.0
            for (n, p), (_, q) in zip(model.named_parameters(), ref_model.named_parameters()):
                g = p.grad.detach().clone()
                dist.all_reduce(g)
                scale = float(q.grad.abs().max())
                if scale > 0:
                    rel = max(rel, float((g - q.grad).abs().max()) / scale)
            with torch.no_grad():
                ctl = _local_only(mine)
                ctl_lp = gather_seq(ctl.target_logprobs(packed_forward(model, ctl)), cp)[:, :C]
            result["families"][family] = {
                "logits_shape": list(logits.shape),
                "lp_diff": _lp_diff(lps, ref_lp),
                "loss": float(total),
                "ref_loss": float(ref_loss),
                "grad_rel": rel,
                "control_lp_diff": _lp_diff(full.unpack_logprobs(ctl_lp), ref_lp),
            }
        if "qwen3" in families:
            try:
                packed_forward(_tiny_qwen3_next(), mine)
                result["gdn"] = "ran"
            except UnsupportedModelError as e:
                result["gdn"] = str(e)
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
            json.dump(result, f)
        dist.barrier()
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("world,families", CASES, ids=[f"cp{w}-{'-'.join(f)}" for w, f in CASES])
def test_cp_matches_one_process(tmp_path, world, families):
    (tmp_path / "world.json").write_text(json.dumps({"world": world, "families": families}))
    results = run_ranks(_worker, tmp_path, TIMEOUT_S, nprocs=world)
    for r in results:
        C, Ls = r["seq_len"], r["shard_len"]
        # Each rank holds 1/cp of every row, plus less than one aligned tile of padding.
        assert r["shape"][1] == Ls and world * Ls < C + world * r["align"] and Ls % r["align"] == 0
        assert r["strategy"] == "ulysses"
        if "qwen3" in families:  # refused by name, before compute
            assert "linear_attn (Qwen3NextGatedDeltaNet)" in r["gdn"] and f"3 value heads do not divide over {world}" in r["gdn"]
        assert sorted(r["families"]) == sorted(families)
        for family, f in r["families"].items():
            assert f["logits_shape"][1] == Ls, family
            assert f["lp_diff"] <= 1e-5, (family, f)
            assert abs(f["loss"] - f["ref_loss"]) <= 1e-5 * max(1.0, abs(f["ref_loss"])), (family, f)
            assert f["grad_rel"] <= 1e-5, (family, f)
            assert f["control_lp_diff"] > 1e-3, (family, f)  # remote keys matter
    assert all(r["entries"] > 0 for r in results)  # every shard scores something
    for family in families:  # the group's summed loss is the same on every rank
        assert len({r["families"][family]["loss"] for r in results}) == 1


def _readme_block():
    import re
    from pathlib import Path

    text = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    blocks = [b for b in re.findall(r"^```python\n(.*?)^```", text, re.S | re.M) if "ContextParallel(" in b]
    assert len(blocks) == 1
    return blocks[0]


def _readme_worker(rank: int, port: int, out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2")
    torch.set_num_threads(1)
    ns = {"__name__": "__doc_example__"}
    exec(compile(_readme_block(), "<README CP example>", "exec"), ns)
    lps = [None if x is None else x.tolist() for x in ns["per_seq"]]
    grads = {n: float(p.grad.abs().sum()) for n, p in ns["model"].named_parameters()}
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump({"loss": float(ns["loss"]), "lps": lps, "shape": list(ns["batch"].input_ids.shape), "grads": grads}, f)


def test_readme_cp_example_runs_on_two_ranks(tmp_path):
    r0, r1 = run_ranks(_readme_worker, tmp_path, TIMEOUT_S)
    assert r0["lps"] == r1["lps"] and r0["grads"] == r1["grads"]  # whole sequences and summed gradients on both
    assert r0["shape"][1] == 32 and all(x is not None for x in r0["lps"])
