"""Planning for context parallelism: ``cp_size`` -> equal, aligned shards, recorded in the plan."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys

import numpy as np
import pytest

from treepack.proto.codec import decode_body, encode_body
from treepack.proto.errors import RequestError
from treepack.proto.options import CP_ALIGN, cp_shard_len
from treepack.proto.plan_wire import plan_differences, plan_from_wire, plan_to_wire
from treepack.service.planner import PlanInvariantError, validate_plan

from helpers.trainer_cases import mixed_batch, plan_of


@pytest.mark.parametrize("cp,num_ranks", [(1, 1), (2, 1), (2, 2), (4, 1), (3, 2)])
def test_cp_shards_equal_aligned_and_cover_the_row(cp, num_ranks):
    c = mixed_batch()
    plan = plan_of(c, cp_size=cp, num_ranks=num_ranks)
    rk = plan.ranks
    assert rk.cp_size == cp == plan.options.cp_size and rk.num_ranks == num_ranks
    C = plan.seq_len
    if cp == 1:
        assert rk.shard_len == C
    else:
        assert rk.shard_len % CP_ALIGN == 0 and C <= rk.padded_len < C + cp * CP_ALIGN
        assert rk.shard_len == cp_shard_len(C, cp)
    # Rows dealt to the data-parallel ranks, each row once.
    held = rk.rank_rows[rk.rank_rows >= 0]
    assert sorted(held.tolist()) == list(range(plan.num_rows))


def test_cp_shard_len_examples():
    assert cp_shard_len(64, 1) == 64
    assert cp_shard_len(64, 2) == 32
    assert cp_shard_len(64, 4) == 16
    assert cp_shard_len(64, 3) == 32  # 22 rounded up to a tile
    assert cp_shard_len(131072, 8) == 16384


@pytest.mark.parametrize("fmt", ["msgpack", "json"])
def test_cp_plan_wire_round_trip(fmt):
    plan = plan_of(mixed_batch(), cp_size=4, num_ranks=2)
    msg = decode_body(encode_body(plan_to_wire(plan, fmt), fmt), fmt)
    assert msg["ranks"]["cp_size"] == 4 and msg["ranks"]["shard_len"] == plan.ranks.shard_len
    back = plan_from_wire(msg)
    assert plan_differences(plan, back) == []
    assert back.options.cp_size == 4 and back.ranks.shard_len == plan.ranks.shard_len
    validate_plan(back)
    msg["ranks"]["shard_len"] += CP_ALIGN
    with pytest.raises(RequestError, match="shard_len") as e:
        plan_from_wire(msg)
    assert e.value.path == "$.ranks.shard_len"


def test_validate_plan_refuses_broken_cp_split():
    plan = plan_of(mixed_batch(), cp_size=2)
    for bad in (dict(shard_len=plan.ranks.shard_len + 1), dict(shard_len=plan.seq_len), dict(cp_size=1)):
        broken = dataclasses.replace(plan, ranks=dataclasses.replace(plan.ranks, **bad))
        with pytest.raises(PlanInvariantError):
            validate_plan(broken)


def test_cli_cp_size(tmp_path):
    f = tmp_path / "b.jsonl"
    f.write_text("\n".join(json.dumps({"tokens": list(range(n)), "prompt_len": 4}) for n in (30, 50, 20)) + "\n")
    out = subprocess.run(
        [sys.executable, "-m", "treepack.service.cli", "plan", str(f), "--seq-len", "64", "--cp-size", "2", "--json"],
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    )
    rep = json.loads(out.stdout)
    assert rep["cp_size"] == 2 and rep["cp_shard_len"] == 32 and rep["cp_attention"] == "auto"


@pytest.mark.parametrize("cp", [2, 3, 4])
def test_allgather_split_balances_attention_work(cp):
    """The all-gather split: every rank holds ``shard_len`` positions of every row (1/cp plus
    alignment padding), and the ranks' attention work (visible keys per query, from the
    tree) differs by at most one tile's, where the token split can be far apart."""
    from treepack.service.planner import plan_batch
    from treepack.service.planner.validate_ranks import naive_attention_work

    from helpers.trees import tree_sequences

    seqs = tree_sequences(7, trees=4, depth=3, max_len=120)
    plan = plan_batch(seqs, seq_len=256, min_shared_len=2, cp_size=cp, cp_attention="allgather")
    validate_plan(plan, seqs)
    rk = plan.ranks
    assert rk.cp_attention == "allgather" and not rk.contiguous
    pos = rk.shard_positions(np.arange(plan.num_rows))
    assert pos.shape == (cp, plan.num_rows, rk.shard_len)
    worse = 0
    for r in range(plan.num_rows):
        held = np.sort(pos[:, r].reshape(-1))
        assert np.array_equal(held, np.arange(rk.padded_len)), "the ranks' positions are not a split of the row"
        assert all(np.all(np.diff(pos[k, r]) > 0) for k in range(cp)), "a shard is not in row order"
        work = naive_attention_work(plan, r)
        load = work[pos[:, r]].sum(-1)
        tile = work[: rk.padded_len].reshape(-1, CP_ALIGN).sum(-1).max()
        assert load.max() - load.min() <= tile
        contiguous = work[: rk.padded_len].reshape(cp, -1).sum(-1)
        worse += int(contiguous.max() - contiguous.min() > load.max() - load.min())
    assert worse >= 1, "no row where the token split is less balanced: the test shows nothing"


def test_contiguous_split_positions():
    plan = plan_of(mixed_batch(), cp_size=4)
    rk = plan.ranks
    assert rk.contiguous and rk.cp_attention == "auto"
    pos = rk.shard_positions(np.array([0, -1]))
    want = np.arange(rk.padded_len).reshape(4, 1, rk.shard_len)
    assert np.array_equal(pos, np.broadcast_to(want, pos.shape))


@pytest.mark.parametrize("fmt", ["msgpack", "json"])
def test_allgather_plan_wire_round_trip(fmt):
    plan = plan_of(mixed_batch(), cp_size=4, num_ranks=2, cp_attention="allgather")
    msg = decode_body(encode_body(plan_to_wire(plan, fmt), fmt), fmt)
    assert msg["ranks"]["cp_attention"] == "allgather"
    back = plan_from_wire(msg)
    assert plan_differences(plan, back) == [] and np.array_equal(back.ranks.cp_tiles, plan.ranks.cp_tiles)
    validate_plan(back)
    msg["ranks"]["cp_tiles"] = None  # the split dropped: the plan now says contiguous
    with pytest.raises(PlanInvariantError, match="cp_tiles shape"):
        validate_plan(plan_from_wire(msg))
