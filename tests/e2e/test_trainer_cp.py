"""Context parallelism on 2 and 4 gloo CPU ranks against the single-process packed step.

Every rank of the CP group materializes its shard of every row (``materialize(..., cp=)``),
runs ``packed_forward`` (Ulysses or all-gather attention inside), takes its shard's
PPO-clip loss (normalized over the whole batch) and backward; the losses summed and the
gradients summed over the group must equal one process running the whole rows (logprobs
1e-5 absolute, gradients 1e-5 relative to each parameter's largest gradient): Gemma 2
(sliding window, soft-cap), GPT-OSS (sinks) and Llama4 (chunked) under both strategies on
both group sizes, Qwen3 under Ulysses and a Qwen3 with 3 query heads under all-gather.
Negative controls differ: under Ulysses a rank's shard run alone (its queries see only the
keys of its own shard), under all-gather the other ranks' keys and values missing, and
(both) the windows and chunks stretched past the rows. A GDN hybrid (Qwen3-Next) whose
value heads do not divide over the ranks is refused by name before compute (the mixers'
CP oracle: test_trainer_cp_mixers.py).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import os

import numpy as np
import pytest
import torch

from helpers import cp_oracle as oracle
from helpers.ranks import run_ranks
from helpers.trainer_cases import VOCAB, tiny_gpt_oss, tiny_llama4, tiny_model

TIMEOUT_S = 420  # a safety net on a loaded machine; the runs take far less
# (CP ranks, {plan's cp_attention: (family, backend) runs}): one spawn per group size
# (process start and imports dominate). "auto" on a contiguous plan runs Ulysses where the heads divide
# (qwen3, gemma2, gpt_oss, llama4: 4 query heads, 2 key/value heads, replicated on 4 ranks) and
# all-gather where they do not (qwen3_3h: 3 heads, 1 key/value head); "allgather" plans shards
# balanced by attention work and runs all-gather on every layer. Gemma 2's and GPT-OSS's window
# (6) and Llama4's chunk (16) are shorter than the rows (64) and than the sequences that span
# shards, so a mask without them shows. flex runs forward only (PyTorch has no CPU backward for
# it). A third entry turns on activation checkpointing (HF's, reentrant or not) on the CP model.
WINDOWED = ("gemma2", "gpt_oss", "llama4")  # a sliding window or chunked attention on some layer
CASES = [
    (
        2,
        {
            "auto": (
                ("qwen3", "sdpa"),
                ("gemma2", "sdpa"),
                ("gpt_oss", "sdpa"),
                ("llama4", "sdpa"),
                ("qwen3_3h", "sdpa"),
                ("qwen3", "sdpa", "reentrant"),
            ),
            "allgather": (
                ("qwen3_3h", "sdpa"),
                ("qwen3_3h", "sdpa", "nonreentrant"),
                ("gemma2", "sdpa"),
                ("gpt_oss", "sdpa"),
                ("llama4", "flash"),
                ("qwen3_3h", "flex"),
            ),
        },
    ),
    (
        4,
        {
            "auto": (
                ("qwen3", "sdpa"),
                ("gemma2", "sdpa"),
                ("gpt_oss", "sdpa"),
                ("llama4", "sdpa"),
                ("qwen3_3h", "sdpa"),
            ),
            "allgather": (("gemma2", "sdpa"), ("gpt_oss", "flash"), ("llama4", "flash")),
        },
    ),
]


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
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=32,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        linear_num_key_heads=1,
        linear_num_value_heads=3,
        linear_key_head_dim=8,
        linear_value_head_dim=8,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=16,
        shared_expert_intermediate_size=16,
        max_position_embeddings=512,
    )
    torch.manual_seed(0)
    return Qwen3NextForCausalLM(cfg).float().eval()


def _local_only(batch):
    """The shard as a batch of its own: its queries see the keys of their own shard only
    (contiguous shards)."""
    a = batch.cp.rank * batch.seq_len
    se = (batch.subtree_end - a).clamp(max=batch.seq_len)
    return dataclasses.replace(
        batch, cp=None, cp_full=None, cp_positions=None, cp_strategy=None, subtree_end=se, _cache={}
    )


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


@contextlib.contextmanager
def _windows_and_chunks_past_the_rows(model):
    """The layers' sliding windows and Llama4's attention chunk stretched past any row (a
    negative control: at the test's sizes they must matter). Yields whether the model has any."""
    far = 1 << 20
    attns = [layer.self_attn for layer in model.model.layers if getattr(layer.self_attn, "sliding_window", None)]
    windows = [a.sliding_window for a in attns]
    chunk = getattr(model.config, "attention_chunk_size", None)
    for a in attns:
        a.sliding_window = far
    if chunk is not None:
        model.config.attention_chunk_size = far
    try:
        yield bool(attns) or chunk is not None
    finally:
        for a, w in zip(attns, windows):
            a.sliding_window = w
        if chunk is not None:
            model.config.attention_chunk_size = chunk


def _worker(rank: int, port: int, out_dir: str) -> None:
    cfg = json.load(open(os.path.join(out_dir, "world.json")))
    world = cfg["world"]
    with oracle.gloo_group(rank, port, world, timeout_s=90):
        oracle.write_result(out_dir, rank, {mode: _run_mode(world, mode, runs) for mode, runs in cfg["modes"].items()})


def _run_mode(world, cp_attention, runs):
    """One plan (``cp_attention``) on this rank's CP shard: every (family, backend) run against one process."""
    from treepack.proto.errors import UnsupportedModelError
    from treepack.trainer.hf import packed_forward
    from treepack.trainer.hf.attention import cp_layer_strategy
    from treepack.trainer.kernels.attention import naive_varlen_attention
    from treepack.trainer.kernels.cp import gather_seq

    s = oracle.shard_mixed_batch(world, cp_attention=cp_attention)
    cp, mine, C = s.cp, s.mine, s.plan.seq_len
    result = {**oracle.shard_record(s), "strategy": mine.cp_strategy, "runs": []}
    result["contiguous"] = bool(np.all(np.diff(mine.cp_positions[cp.rank].numpy(), axis=1) == 1))
    for family, backend, *ckpt in runs:
        kw = {"varlen_fn": naive_varlen_attention} if backend == "flash" else {}
        ref = oracle.reference_step(functools.partial(_build, family), s)
        model = _build(family)
        if ckpt:  # activation checkpointing: layers recomputed (collectives included) in backward
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": ckpt[0] == "reentrant"})
            model.train()
        calls = []
        # flex runs forward only (PyTorch has no CPU backward for it).
        step = oracle.step_record(
            model, s, ref, grads=backend != "flex", around_backward=_counting_cp_attention(calls), backend=backend, **kw
        )
        ran = cp_layer_strategy(mine, model.config.num_attention_heads)
        with torch.no_grad():
            if ran == "ulysses":
                ctl = _local_only(mine)
                ctl_lp = gather_seq(ctl.target_logprobs(packed_forward(model, ctl, verify=False)), cp)[:, :C]
                ctl_lps = s.full.unpack_logprobs(ctl_lp)
            else:
                with _no_remote_keys():
                    ctl_lps = mine.unpack_logprobs(packed_forward(model, mine, backend=backend, verify=False, **kw))
            with _windows_and_chunks_past_the_rows(model) as masked:
                unmasked = (
                    oracle.lp_diff(
                        mine.unpack_logprobs(packed_forward(model, mine, backend=backend, verify=False, **kw)), ref.lp
                    )
                    if masked
                    else None
                )
        result["runs"].append(
            {
                **step,
                "family": family,
                "backend": backend,
                "ckpt": ckpt,
                "ran": ran,
                "backward_attention_calls": len(calls),
                "layers": model.config.num_hidden_layers,
                "control_lp_diff": oracle.lp_diff(ctl_lps, ref.lp),
                "unmasked_lp_diff": unmasked,
            }
        )
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
        oracle.assert_shard_size(r, world)
        assert r["strategy"] == ("allgather" if cp_attention == "allgather" else "auto")
        if "gdn" in r:  # refused by name, before compute
            why = (
                "contiguous shards only" if cp_attention == "allgather" else f"3 value heads do not divide over {world}"
            )
            assert "linear_attn (Qwen3NextGatedDeltaNet)" in r["gdn"] and why in r["gdn"], r["gdn"]
        assert [(x["family"], x["backend"], *x["ckpt"]) for x in r["runs"]] == [tuple(x) for x in runs]
        for f in r["runs"]:
            what = (cp_attention, f["family"], f["backend"], *f["ckpt"])
            assert f["ran"] == _expected_strategy(cp_attention, f["family"], world), what
            oracle.assert_step_matches(f, r["shard_len"], what)
            assert f["control_lp_diff"] > oracle.CONTROL_GAP, (what, f)  # remote keys matter
            # The windows and chunks matter at these sizes: without them the CP step differs.
            assert (f["unmasked_lp_diff"] is None) == (f["family"] not in WINDOWED), what
            assert f["unmasked_lp_diff"] is None or f["unmasked_lp_diff"] > oracle.CONTROL_GAP, (what, f)
            # Checkpointed layers run attention again in backward (its collectives included).
            assert f["backward_attention_calls"] == (f["layers"] if f["ckpt"] else 0), what
    # The all-gather plan's shards are runs of tiles balanced by work (zigzag at these sizes),
    # not one contiguous range each (where a shard holds more than one tile).
    if results[0]["shard_len"] > results[0]["align"]:
        assert any(not r["contiguous"] for r in results) == (cp_attention == "allgather")
    for i in range(len(runs)):
        oracle.assert_same_summed_loss([r["runs"][i] for r in results])


def _guide_block():
    import re
    from pathlib import Path

    text = (Path(__file__).resolve().parents[2] / "docs" / "context-parallel.md").read_text()
    blocks = [b for b in re.findall(r"^```python\n(.*?)^```", text, re.S | re.M) if "ContextParallel(" in b]
    assert len(blocks) == 1
    return blocks[0]


def _guide_worker(rank: int, port: int, out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2")
    torch.set_num_threads(1)
    ns = {"__name__": "__doc_example__"}
    exec(compile(_guide_block(), "<docs/context-parallel.md example>", "exec"), ns)
    lps = [None if x is None else x.tolist() for x in ns["per_seq"]]
    grads = {n: float(p.grad.abs().sum()) for n, p in ns["model"].named_parameters()}
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(
            {"loss": float(ns["loss"]), "lps": lps, "shape": list(ns["batch"].input_ids.shape), "grads": grads}, f
        )


def test_guide_cp_example_runs_on_two_ranks(tmp_path):
    r0, r1 = run_ranks(_guide_worker, tmp_path, TIMEOUT_S)
    assert r0["lps"] == r1["lps"] and r0["grads"] == r1["grads"]  # whole sequences and summed gradients on both
    assert r0["shape"][1] == 32 and all(x is not None for x in r0["lps"])
