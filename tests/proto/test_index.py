"""The shared index helpers equal their obvious loops."""

from __future__ import annotations

import numpy as np
import pytest

from treepack.proto.index import ancestor_chains, csr_gather, csr_index, forest_depth, segment_rows, segment_tokens
from treepack.service.planner import plan_batch


@pytest.mark.parametrize("seed", range(5))
def test_csr_and_chains_equal_loops(seed):
    rng = np.random.default_rng(seed)
    counts = rng.integers(0, 4, 12)
    ptr = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
    values = rng.integers(0, 100, int(ptr[-1]))
    rows = rng.integers(0, 12, 9)
    want = [i for r in rows for i in range(ptr[r], ptr[r + 1])]
    assert csr_index(ptr, rows).tolist() == want
    assert csr_gather(ptr, values, rows).tolist() == values[want].tolist()
    parent = np.array(
        [-1] + [int(rng.integers(0, v)) if rng.random() < 0.8 else -1 for v in range(1, 20)], dtype=np.int64
    )
    nodes = np.concatenate([rng.integers(0, 20, 10), [-1]]).astype(np.int64)
    cptr, chain = ancestor_chains(parent, forest_depth(parent), nodes)
    for i, v in enumerate(nodes.tolist()):
        walk = []
        while v >= 0:
            walk.insert(0, v)
            v = int(parent[v])
        assert chain[cptr[i] : cptr[i + 1]].tolist() == walk


def test_segment_positions_equal_loops():
    seqs = [np.arange(50) % 7, np.arange(60) % 7, np.arange(30) + 100]
    plan = plan_batch(seqs, seq_len=64, min_shared_len=4)
    seg = plan.segments
    every = np.arange(seg.num_segments)
    local = [int(seg.row_start[g]) + k for g in every for k in range(int(seg.length[g]))]
    assert segment_rows(seg, every).tolist() == local
    flat = [
        int(seg.row[g]) * plan.seq_len + int(seg.row_start[g]) + k for g in every for k in range(int(seg.length[g]))
    ]
    assert segment_tokens(seg, plan.seq_len, every).tolist() == flat
