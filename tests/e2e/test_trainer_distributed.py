"""Ranks: plan encoding round trip, and 2 gloo processes on CPU against one process."""

from __future__ import annotations

import json
import os
from dataclasses import fields
from datetime import timedelta

import numpy as np
import pytest
import torch

from treepack.proto.codec import decode_body, encode_body, parse_message
from treepack.proto.errors import InputTypeError, RequestError
from treepack.proto.pack_messages import PlanMessage
from treepack.proto.plan_wire import plan_to_wire
from treepack.proto.version import WIRE_VERSION
from treepack.service.planner import plan_batch, validate_plan
from treepack.trainer.distributed import decode_plan, encode_plan, obtain_plan

from helpers.ranks import run_ranks
from helpers.trainer_cases import mixed_batch, plan_of

TIMEOUT_S = 240


def _same(a, b, path="plan"):
    if hasattr(a, "__dataclass_fields__"):
        for f in fields(a):
            if f.name in ("tree", "timings_ms"):
                continue
            _same(getattr(a, f.name), getattr(b, f.name), f"{path}.{f.name}")
    elif isinstance(a, np.ndarray):
        assert a.dtype == b.dtype and np.array_equal(a, b), path
    elif isinstance(a, tuple):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            _same(x, y, f"{path}[{i}]")
    else:
        assert a == b, path


def test_encode_decode_round_trip(golden):
    c = mixed_batch()
    plans = [plan_of(c, num_ranks=3), plan_batch(**golden.plan_kwargs(), placement="bfd")]
    rng = np.random.default_rng(0)
    seqs = [rng.integers(0, 50, n) for n in (5, 40, 9)]
    plans.append(plan_batch(seqs, seq_len=16, on_overflow="drop", trainable=[2, 2, 2]))
    plans.append(plan_of(c, share_trainable=True))  # the flag travels too
    for plan in plans:
        extra = {
            "flags": np.arange(5, dtype=np.uint8),
            "empty": np.zeros(0, np.int64),
            "grid": np.arange(6.0).reshape(2, 3),
        }
        buf = encode_plan(plan, extra)
        back, ex = decode_plan(buf)
        _same(plan, back)
        assert (
            np.array_equal(ex["flags"], extra["flags"]) and ex["empty"].shape == (0,) and ex["empty"].dtype == np.int64
        )
        assert ex["grid"].dtype == np.float64 and np.array_equal(ex["grid"], extra["grid"])
        validate_plan(back)
        assert b"pickle" not in buf[:200]
        # The project's encoding: the plan is the PlanMessage of POST /v1/pack, byte for byte.
        msg = decode_body(buf, "msgpack")
        assert set(msg) == {"version", "plan", "extra"} and msg["version"] == WIRE_VERSION
        parse_message(PlanMessage, msg["plan"])
        assert encode_body(msg["plan"], "msgpack") == encode_body(plan_to_wire(plan, "msgpack"), "msgpack")
    with pytest.raises(InputTypeError, match="dtype bool") as e:
        encode_plan(plans[0], {"mask": np.ones(3, bool)})
    assert e.value.path == "$.extra.mask"
    with pytest.raises(RequestError, match="not a broadcast plan"):
        decode_plan(encode_body({"version": 1, "seq_len": 3}, "msgpack"))


def test_obtain_plan_accepts_packer_callable_or_default():
    c = mixed_batch()
    kw = dict(seq_len=64, min_shared_len=6, trainable=c["trainable"])
    calls = []

    class Packer:
        def pack(self, sequences, **k):
            calls.append("pack")
            return plan_batch(sequences, **k)

    def fn(sequences, **k):
        calls.append("fn")
        return plan_batch(sequences, **k)

    a = obtain_plan(c["sequences"], **kw)
    b = obtain_plan(c["sequences"], planner=Packer(), **kw)
    d = obtain_plan(c["sequences"], planner=fn, **kw)
    assert calls == ["pack", "fn"] and a.num_rows == b.num_rows == d.num_rows
    with pytest.raises(TypeError, match="planner must have"):
        obtain_plan(c["sequences"], planner=3, **kw)


def test_obtain_plan_with_the_client_packer():
    """With treepack's client installed, the embedded Packer gives the planner's plan."""
    import importlib

    Packer = getattr(importlib.import_module("treepack.client"), "Packer", None)
    if Packer is None:
        pytest.skip("treepack.client.Packer is not in this build")
    c = mixed_batch()
    kw = dict(seq_len=64, min_shared_len=6, trainable=c["trainable"], groups=c["groups"], num_ranks=2)
    got = obtain_plan(c["sequences"], planner=Packer(), **kw)
    _same(plan_batch(c["sequences"], **kw), got)


def test_obtain_plan_through_a_sidecar_url():
    """A URL plans through treepack.client's HTTP backend: the same plan as the embedded default."""
    from helpers.service import running_server

    c = mixed_batch()
    kw = dict(seq_len=64, min_shared_len=6, trainable=c["trainable"], groups=c["groups"], num_ranks=2)
    with running_server() as (url, _):
        got = obtain_plan(c["sequences"], planner=url, **kw)
    _same(obtain_plan(c["sequences"], **kw), got)


def _worker(rank: int, port: int, out_dir: str) -> None:
    import torch.distributed as dist

    from treepack.trainer import materialize
    from treepack.trainer.distributed import plan_and_broadcast
    from treepack.trainer.hf import packed_forward
    from treepack.trainer.losses import ppo_clip_loss

    from helpers.trainer_cases import tiny_model

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2, timeout=timedelta(seconds=60)
    )
    try:
        c = mixed_batch()
        seqs = c["sequences"]
        rng = np.random.default_rng(7)
        old = [rng.normal(-4.6, 0.4, len(s)) for s in seqs]
        adv = torch.from_numpy(rng.normal(0, 1, len(seqs)))
        read: list[int] = []

        class Lazy:  # every rank can read any sequence, but should read only its own rows'
            def __len__(self):
                return len(seqs)

            def __getitem__(self, s):
                read.append(s)
                return seqs[s]

        req = dict(trainable=c["trainable"], groups=c["groups"]) if rank == 0 else {}
        rp = plan_and_broadcast(seqs if rank == 0 else None, seq_len=64, min_shared_len=6, **req)
        batch = rp.materialize(Lazy(), payloads={"old": old})
        mine = set(np.flatnonzero(np.isin(rp.plan.row_of, rp.rows[rp.rows >= 0])).tolist())
        assert set(read) == mine, (sorted(set(read)), sorted(mine))
        model = tiny_model("qwen3")
        loss = ppo_clip_loss(
            batch.target_logprobs(packed_forward(model, batch)),
            batch,
            advantages=adv,
            old_logprobs="old",
            normalization="sequence",
        )
        loss.backward()
        total = loss.detach().clone()
        dist.all_reduce(total)
        grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        for g in grads.values():
            dist.all_reduce(g)
        # Planner errors reach every rank instead of leaving the others waiting.
        try:
            plan_and_broadcast([[1, 2, 3]] if rank == 0 else None, seq_len=2)
            raised = ""
        except ValueError as e:
            raised = str(e)
        result = {
            "rank": rank,
            "rows": rp.rows.tolist(),
            "loss": float(total),
            "raised": raised,
            "empty_rows": int(batch.empty_rows.sum()),
        }
        if rank == 0:
            # The same step in one process over all rows.
            model.zero_grad(set_to_none=True)
            full = materialize(rp.plan, seqs, payloads={"old": old}, trainable=c["trainable"], groups=c["groups"])
            ref = ppo_clip_loss(
                full.target_logprobs(packed_forward(model, full)),
                full,
                advantages=adv,
                old_logprobs="old",
                normalization="sequence",
            )
            ref.backward()
            result["ref_loss"] = float(ref)
            result["max_grad_rel"] = max(
                float((grads[n] - p.grad).abs().max() / p.grad.abs().max()) for n, p in model.named_parameters()
            )
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
            json.dump(result, f)
        # Both ranks finish their collectives before either tears gloo down: a rank that exits
        # while its peer's pair threads still run makes the peer abort (SIGABRT).
        dist.barrier()
    finally:
        dist.destroy_process_group()


def test_two_gloo_ranks_match_one_process(tmp_path):
    r0, r1 = run_ranks(_worker, tmp_path, TIMEOUT_S)
    assert sorted(x for x in r0["rows"] + r1["rows"] if x >= 0) == [0, 1, 2]
    assert r0["empty_rows"] + r1["empty_rows"] == 1
    assert r0["loss"] == r1["loss"] and abs(r0["loss"] - r0["ref_loss"]) <= 1e-6 * abs(r0["ref_loss"])
    assert r0["max_grad_rel"] <= 1e-4
    assert "longer than seq_len" in r0["raised"] and "longer than seq_len" in r1["raised"]
