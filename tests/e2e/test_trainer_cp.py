"""Context parallelism on 2 and 4 gloo CPU ranks against the single-process packed step.

Every rank of the CP group materializes its shard of every row (``materialize(..., cp=)``),
runs ``packed_forward`` (Ulysses or all-gather attention inside), takes its shard's
PPO-clip loss (normalized over the whole batch) and backward; the losses summed and the
gradients summed over the group must equal one process running the whole rows (logprobs
1e-5 absolute, gradients 1e-5 relative to each parameter's largest gradient). Negative
controls: under Ulysses a rank's shard run alone (its queries see only the keys of its
own shard), under all-gather the other ranks' keys and values missing, differ. A GDN
hybrid (Qwen3-Next) whose value heads do not divide over the ranks is refused by name
before compute (the mixers' CP oracle: test_trainer_cp_mixers.py).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
from datetime import timedelta

import numpy as np
import pytest
import torch

from helpers.ranks import run_ranks
from helpers.trainer_cases import VOCAB, mixed_batch, plan_of, tiny_gpt_oss, tiny_llama4, tiny_model

TIMEOUT_S = 420  # a safety net on a loaded machine; the runs take far less
# (CP ranks, {plan's cp_attention: (family, backend) runs}): one spawn per group size
# (process start and imports dominate). "auto" on a contiguous plan runs Ulysses where the heads divide
# (qwen3, 4 heads) and all-gather where they do not (qwen3_3h: 3 heads, 1 key/value head);
# "allgather" plans shards balanced by attention work and runs all-gather on every layer.
# flex runs forward only (PyTorch has no CPU backward for it). A third entry turns on
# activation checkpointing (HF's, reentrant or not) on the CP model.
CASES = [
    (2, {
        "auto": (("qwen3", "sdpa"), ("gemma2", "sdpa"), ("gpt_oss", "sdpa"), ("llama4", "sdpa"), ("qwen3_3h", "sdpa"), ("qwen3", "sdpa", "reentrant")),
        "allgather": (("qwen3_3h", "sdpa"), ("qwen3_3h", "sdpa", "nonreentrant"), ("gemma2", "sdpa"), ("gpt_oss", "sdpa"), ("llama4", "flash"), ("qwen3_3h", "flex")),
    }),
    (4, {"auto": (("qwen3", "sdpa"), ("gpt_oss", "sdpa"), ("qwen3_3h", "sdpa")), "allgather": (("gpt_oss", "flash"),)}),
]  # fmt: skip


def _build(family):
    if family == "qwen3_3h":
        return tiny_model("qwen3", heads=(3, 1))
    return {"gpt_oss": tiny_gpt_oss, "llama4": tiny_llama4}.get(family, lambda: tiny_model(family))()


def _expected_strategy(cp_attention, family, world):
    if cp_attention == "allgather":
        return "allgather"
    heads = 3 if family == "qwen3_3h" else 4
    return "ulysses" if heads % world == 0 else "allgather"


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
    """The shard as a batch of its own: its queries see the keys of their own shard only
    (contiguous shards)."""
    a = batch.cp.rank * batch.seq_len
    se = (batch.subtree_end - a).clamp(max=batch.seq_len)
    return dataclasses.replace(batch, cp=None, cp_full=None, cp_positions=None, cp_strategy=None, subtree_end=se, _cache={})


@contextlib.contextmanager
def _counting_cp_attention(calls):
    """Count the CP attention calls (both strategies), calling through to the real ones."""
    from treepack.trainer.hf import attention

    real = attention.allgather_attention, attention._ulysses

    def spy(fn):
        def counted(*a, **kw):
            calls.append(1)
            return fn(*a, **kw)

        return counted

    attention.allgather_attention, attention._ulysses = map(spy, real)
    try:
        yield
    finally:
        attention.allgather_attention, attention._ulysses = real


@contextlib.contextmanager
def _no_remote_keys():
    """All-gather with the other ranks' keys and values missing (zeros): the negative control."""
    from treepack.trainer.kernels import cp_attention

    real = cp_attention.gather_seq

    def own_only(x, cp):
        return torch.cat([x if r == cp.rank else torch.zeros_like(x) for r in range(cp.size)], dim=1)

    cp_attention.gather_seq = own_only
    try:
        yield
    finally:
        cp_attention.gather_seq = real


def _worker(rank: int, port: int, out_dir: str) -> None:
    import torch.distributed as dist

    cfg = json.load(open(os.path.join(out_dir, "world.json")))
    world = cfg["world"]
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world, timeout=timedelta(seconds=90))
    try:
        out = {mode: _run_mode(world, mode, runs) for mode, runs in cfg["modes"].items()}
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
            json.dump(out, f)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _run_mode(world, cp_attention, runs):
    """One plan (``cp_attention``) on this rank's CP shard: every (family, backend) run against one process."""
    import torch.distributed as dist

    from treepack.proto.errors import UnsupportedModelError
    from treepack.proto.options import CP_ALIGN
    from treepack.trainer import ContextParallel, materialize
    from treepack.trainer.hf import packed_forward
    from treepack.trainer.hf.attention import cp_layer_strategy
    from treepack.trainer.kernels.attention import naive_varlen_attention
    from treepack.trainer.kernels.cp import gather_seq

    cp = ContextParallel()
    c = mixed_batch()
    plan1 = plan_of(c)
    plan = plan_of(c, cp_size=world, cp_attention=cp_attention)
    assert np.array_equal(plan.segments.row, plan1.segments.row)
    rng = np.random.default_rng(7)
    old = [rng.normal(-4.6, 0.4, len(s)) for s in c["sequences"]]
    adv = torch.from_numpy(rng.normal(0, 1, len(c["sequences"])))
    full = materialize(plan1, c["sequences"], payloads={"old": old})
    mine = materialize(plan, c["sequences"], payloads={"old": old}, cp=cp)
    C, Ls = plan.seq_len, plan.ranks.shard_len
    result = {"shard_len": Ls, "seq_len": C, "align": CP_ALIGN, "strategy": mine.cp_strategy, "runs": []}
    result["shape"] = list(mine.input_ids.shape)
    result["entries"] = mine.num_scored
    result["contiguous"] = bool(np.all(np.diff(mine.cp_positions[cp.rank].numpy(), axis=1) == 1))
    for family, backend, *ckpt in runs:
        kw = {"varlen_fn": naive_varlen_attention} if backend == "flash" else {}
        grads = backend != "flex"
        ref_model = _build(family)
        ref_logits = packed_forward(ref_model, full, verify=False)  # the test is its own oracle
        ref_lp = [None if x is None else x.detach() for x in full.unpack_logprobs(ref_logits)]
        ref_loss = _loss(full, ref_logits, adv)
        ref_loss.backward()
        model = _build(family)
        if ckpt:  # activation checkpointing: layers recomputed (collectives included) in backward
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": ckpt[0] == "reentrant"})
            model.train()
        layer = model.model.layers[0].self_attn
        with torch.set_grad_enabled(grads):
            logits = packed_forward(model, mine, backend=backend, verify=False, **kw)
            lps = [None if x is None else x.detach() for x in mine.unpack_logprobs(logits.detach())]
            loss = _loss(mine, logits, adv)
        total = loss.detach().clone()
        dist.all_reduce(total)
        rel, calls = 0.0, []
        if grads:
            with _counting_cp_attention(calls):
                loss.backward()
            for (n, p), (_, q) in zip(model.named_parameters(), ref_model.named_parameters()):
                g = p.grad.detach().clone()
                dist.all_reduce(g)
                scale = float(q.grad.abs().max())
                if scale > 0:
                    rel = max(rel, float((g - q.grad).abs().max()) / scale)
        ran = cp_layer_strategy(mine, model.config.num_attention_heads)
        with torch.no_grad():
            if ran == "ulysses":
                ctl = _local_only(mine)
                ctl_lp = gather_seq(ctl.target_logprobs(packed_forward(model, ctl, verify=False)), cp)[:, :C]
                ctl_lps = full.unpack_logprobs(ctl_lp)
            else:
                with _no_remote_keys():
                    ctl_lps = mine.unpack_logprobs(packed_forward(model, mine, backend=backend, verify=False, **kw))
        result["runs"].append({
            "family": family, "backend": backend, "ckpt": ckpt, "ran": ran, "heads": int(layer.config.num_attention_heads),
            "logits_shape": list(logits.shape), "lp_diff": _lp_diff(lps, ref_lp), "loss": float(total), "ref_loss": float(ref_loss.detach()),
            "grads": grads, "grad_rel": rel, "backward_attention_calls": len(calls), "layers": model.config.num_hidden_layers, "control_lp_diff": _lp_diff(ctl_lps, ref_lp),
        })  # fmt: skip
    if world == 2:
        try:
            packed_forward(_tiny_qwen3_next(), mine)
            result["gdn"] = "ran"
        except UnsupportedModelError as e:
            result["gdn"] = str(e)
    return result


@pytest.mark.parametrize("world,modes", CASES, ids=[f"cp{w}" for w, _ in CASES])
def test_cp_matches_one_process(tmp_path, world, modes):
    (tmp_path / "world.json").write_text(json.dumps({"world": world, "modes": modes}))
    results = run_ranks(_worker, tmp_path, TIMEOUT_S, nprocs=world)
    for cp_attention, runs in modes.items():
        _check_mode(world, cp_attention, runs, [r[cp_attention] for r in results])


def _check_mode(world, cp_attention, runs, results):
    for r in results:
        C, Ls = r["seq_len"], r["shard_len"]
        # Each rank holds 1/cp of every row, plus less than one aligned tile of padding.
        assert r["shape"][1] == Ls and world * Ls < C + world * r["align"] and Ls % r["align"] == 0
        assert r["strategy"] == ("allgather" if cp_attention == "allgather" else "auto")
        if "gdn" in r:  # refused by name, before compute
            why = "contiguous shards only" if cp_attention == "allgather" else f"3 value heads do not divide over {world}"
            assert "linear_attn (Qwen3NextGatedDeltaNet)" in r["gdn"] and why in r["gdn"], r["gdn"]
        assert [(x["family"], x["backend"], *x["ckpt"]) for x in r["runs"]] == [tuple(x) for x in runs]
        for f in r["runs"]:
            what = (cp_attention, f)
            assert f["ran"] == _expected_strategy(cp_attention, f["family"], world), what
            assert f["logits_shape"][1] == Ls, what
            assert f["lp_diff"] <= 1e-5, what
            assert abs(f["loss"] - f["ref_loss"]) <= 1e-5 * max(1.0, abs(f["ref_loss"])), what
            assert not f["grads"] or f["grad_rel"] <= 1e-5, what
            assert f["control_lp_diff"] > 1e-3, what  # remote keys matter
            # Checkpointed layers run attention again in backward (its collectives included).
            assert f["backward_attention_calls"] == (f["layers"] if f["ckpt"] else 0), what
    assert all(r["entries"] > 0 for r in results)  # every shard scores something
    # The all-gather plan's shards are tiles dealt by work, not contiguous ranges (where a
    # shard holds more than one tile).
    if results[0]["shard_len"] > results[0]["align"]:
        assert any(not r["contiguous"] for r in results) == (cp_attention == "allgather")
    for i in range(len(runs)):  # the group's summed loss is the same on every rank
        assert len({r["runs"][i]["loss"] for r in results}) == 1


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
