"""Keys the ``flash`` path gathers under the all-gather split, on an agent rollout row.

``cp_varlen_meta`` turns each run of a rank's queries in a segment into a varlen sequence
that reads the segment's keys up to the run's end, so its keys grow with the runs. Each
change of rank inside a segment adds at most that segment's keys, and the plan's split has
at most ``2 (cp - 1)`` changes in a row it balances by windows: over the CP group, at most
the whole row's keys plus ``2 (cp - 1)`` times the longest segment's. The control: the same
row dealt tile by tile, heaviest first, is far over that bound.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from treepack.service.planner import plan_batch, validate_plan
from treepack.service.planner.ranks import _snake, tile_work
from treepack.trainer.kernels.cp_attention import cp_varlen_meta
from treepack.trainer.kernels.masks import varlen_meta

TOKENS = 4096


def _agent_row(tokens: int) -> list[np.ndarray]:
    """A system prompt of tokens/8, four task prompts of tokens/16 under it, three
    completions under each task, filling one row."""
    rng = np.random.default_rng(0)
    system = rng.integers(0, 512, tokens // 8)
    tasks = [rng.integers(0, 512, tokens // 16) for _ in range(4)]
    per = (tokens - system.shape[0] - sum(t.shape[0] for t in tasks)) // 12
    return [np.concatenate([system, t, rng.integers(0, 512, per)]) for t in tasks for _ in range(3)]


def _rank_keys(plan) -> list[int]:
    meta = varlen_meta(plan, np.array([0]))
    pos = plan.ranks.shard_positions(np.array([0]))
    kpos = pos.transpose(1, 0, 2).reshape(1, -1)
    return [int(cp_varlen_meta(meta, plan.seq_len, pos[k], kpos).cu_seqlens_k[-1]) for k in range(plan.ranks.cp_size)]


@pytest.mark.parametrize("cp", [2, 4])
def test_allgather_split_gathers_few_keys(cp):
    seqs = _agent_row(TOKENS)
    trainable = [len(s) - 64 for s in seqs]
    plan = plan_batch(
        seqs, seq_len=TOKENS, min_shared_len=16, trainable=trainable, cp_size=cp, cp_attention="allgather"
    )
    validate_plan(plan, seqs, trainable=trainable)
    assert plan.num_rows == 1 and not plan.ranks.contiguous
    whole = varlen_meta(plan, np.array([0]))
    row_keys = int(whole.cu_seqlens_k[-1])
    bound = row_keys + 2 * (cp - 1) * int(whole.max_seqlen_k)
    keys = _rank_keys(plan)
    assert sum(keys) <= bound, (keys, row_keys)

    snake = _snake(tile_work(plan.segments, 1, plan.ranks.padded_len), cp)
    dealt = dataclasses.replace(plan, ranks=dataclasses.replace(plan.ranks, cp_tiles=snake))
    validate_plan(dealt, seqs, trainable=trainable)
    assert min(_rank_keys(dealt)) > bound, "the tile-by-tile deal fits the bound too: the test shows nothing"
