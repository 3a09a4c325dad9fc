"""The what-if pool: one-pass grouping by tag equals the per-tag scan, the work estimate
equals its obvious count, scoping by seq_len and tags, and the cost stays linear in tags."""

from __future__ import annotations

import time

import numpy as np
import pytest

from treepack.proto.errors import InputTypeError, RequestError
from treepack.proto.shape import BatchShape
from treepack.proto.whatif import Composition
from treepack.service.planner.whatif import whatif
from treepack.service.planner.whatif_pool import (
    build_pool,
    history_scope,
    naive_build_pool,
    no_batches_error,
    pool_summary,
    whatif_work,
)


def _shape(rng: np.random.Generator, n: int, *, tags: list | None, labels: int, seq_len: int = 256) -> BatchShape:
    """n one-run sequences (lengths 1..40) in groups drawn from ``labels`` labels (some None)."""
    groups = tuple(None if rng.random() < 0.2 else (f"g{x}" if x % 2 else int(x)) for x in rng.integers(0, labels, n))
    return BatchShape(
        seq_len=seq_len,
        min_shared_len=8,
        seq_ptr=np.arange(n + 1, dtype=np.int64),
        run_hash=rng.integers(1, 2**63, n, dtype=np.uint64),
        run_len=rng.integers(1, 41, n).astype(np.int64),
        first_trainable=np.zeros(n, dtype=np.int64),
        groups=groups,
        tags=None if tags is None else tuple(tags[i] for i in rng.integers(0, len(tags), n)),
    )


def _shapes(seed: int, batches: int = 5) -> list[BatchShape]:
    rng = np.random.default_rng(seed)
    names = [None, "", "math", "code", "tool", "run-a"]
    return [
        _shape(rng, int(rng.integers(1, 60)), tags=None if b == 2 else names, labels=int(rng.integers(1, 20)))
        for b in range(batches)
    ]


def _same(a, b) -> None:
    assert a.unit_tag == b.unit_tag and list(a.by_tag) == list(b.by_tag)
    for t in a.by_tag:
        assert a.by_tag[t].dtype == np.int64 and np.array_equal(a.by_tag[t], b.by_tag[t]), t
    for f in ("seq_base", "unit_ptr", "unit_seqs", "lens"):
        assert np.array_equal(getattr(a, f), getattr(b, f)), f


@pytest.mark.parametrize("seed", range(12))
def test_one_pass_pool_equals_the_per_tag_scan(seed):
    shapes = _shapes(seed)
    _same(build_pool(shapes), naive_build_pool(shapes))
    for keep in (["math"], ["", "code"], ["absent"], []):
        fast, slow = build_pool(shapes, tags=keep), naive_build_pool(shapes, tags=keep)
        _same(fast, slow)
        assert set(fast.unit_tag) <= set(keep)
    full = build_pool(shapes)
    assert full.num_sequences == sum(s.num_sequences for s in shapes)
    assert len(full.by_tag) >= 3, "too few tags: the grouping is barely exercised"


def _naive_work(pool, comps, trials, cp_row):
    sizes = [
        int(pool.lens[pool.unit_seqs[pool.unit_ptr[u] : pool.unit_ptr[u + 1]]].sum()) for u in range(pool.num_groups)
    ]
    total = 0
    for c in comps:
        if c.groups is not None:
            top = sum(sorted(sizes, reverse=True)[: c.groups])
        else:
            top = 0
            for tag, k in c.by_tag.items():
                mine = [sizes[u] for u in range(pool.num_groups) if pool.unit_tag[u] == tag]
                top += sum(sorted(mine, reverse=True)[:k])
        total += trials * (top + cp_row)
    return total


def test_work_estimate_equals_its_obvious_count():
    pool = build_pool(_shapes(3, batches=8))
    comps = [
        Composition(groups=1),
        Composition(groups=pool.num_groups),
        Composition(groups=pool.num_groups + 5),
        Composition(by_tag={"math": 2, "code": 100, "absent": 3, "": 1}),
    ]
    assert whatif_work(pool, comps, 7) == _naive_work(pool, comps, 7, 0) > 0
    # Under an all-gather CP split a trial also pays for one padded row (seq_len 1000 over 3 ranks: 3 x 336).
    cp = whatif_work(pool, comps, 7, seq_len=1000, cp_size=3, cp_attention="allgather")
    assert cp == _naive_work(pool, comps, 7, 3 * 336)
    assert whatif_work(pool, comps, 7, seq_len=1000, cp_size=3, cp_attention="ulysses") == _naive_work(
        pool, comps, 7, 0
    )


def _distinct_tags(n: int) -> BatchShape:
    """n ungrouped one-run sequences, each with its own tag."""
    rng = np.random.default_rng(0)
    return BatchShape(
        seq_len=256,
        min_shared_len=8,
        seq_ptr=np.arange(n + 1, dtype=np.int64),
        run_hash=rng.integers(1, 2**63, n, dtype=np.uint64),
        run_len=np.full(n, 4, dtype=np.int64),
        first_trainable=np.zeros(n, dtype=np.int64),
        groups=(None,) * n,
        tags=tuple(f"t{i}" for i in range(n)),
    )


def test_many_distinct_tags_cost_what_one_tag_does():
    """30,000 groups each of its own tag: the pool, the work estimate over 1,000 by_tag keys
    and a what-if take well under a second (the per-tag scan took 30,000 x 30,000
    comparisons, twice per what-if); the reference, quadratic, takes longer on a fifth."""
    many = _distinct_tags(30_000)
    t0 = time.perf_counter()
    pool = build_pool([many])
    work = whatif_work(pool, [Composition(by_tag={f"t{i}": 1 for i in range(1000)})], 4)
    res = whatif(pool, [Composition(groups=8)], seq_len=256, trials=2, min_shared_len=8)
    fast = time.perf_counter() - t0
    assert len(pool.by_tag) == 30_000 and work == 4 * 1000 * 4 and res[0].trials == 2
    t0 = time.perf_counter()
    naive_build_pool([_distinct_tags(6_000)])
    slow = time.perf_counter() - t0
    assert fast < 2.5 and slow > fast, (fast, slow)


def test_pool_summary_lists_the_largest_tags_and_counts_the_rest():
    pool = build_pool(_shapes(5, batches=6))
    full = pool_summary(pool)
    assert full["tags_omitted"] == 0 and sum(full["tags"].values()) == pool.num_groups
    two = pool_summary(pool, max_tags=2)
    biggest = sorted(full["tags"].items(), key=lambda x: (-x[1], x[0]))[:2]
    assert two["tags"] == dict(sorted(biggest)) and two["tags_omitted"] == len(full["tags"]) - 2


def test_history_scope_defaults_to_the_what_if_seq_len():
    assert history_scope(4096) == (4096, None)
    assert history_scope(4096, "any", ["a", ""]) == (None, ("a", ""))
    assert history_scope(4096, 16) == (16, None)
    for bad in (0, 2**31, "all", 1.5, True):
        with pytest.raises(InputTypeError) as e:
            history_scope(4096, bad)
        assert e.value.path == "$.history_seq_len"
    with pytest.raises(InputTypeError):
        history_scope(4096, None, "math")
    err = no_batches_error(4096, [16, 512], None)
    assert err.rule == "no_history" and "seq_len 16, 512" in err.message and err.path == "$.history_seq_len"
    assert no_batches_error(4096, [], None).path == "$.shapes"


def test_a_what_if_of_an_empty_tag_scope_is_refused():
    pool = build_pool(_shapes(1), tags=["absent"])
    with pytest.raises(RequestError) as e:
        whatif(pool, [Composition(groups=1)], seq_len=256, trials=1)
    assert e.value.rule == "no_history"
