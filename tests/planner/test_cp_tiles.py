"""The all-gather CP split (``balance_tiles``): every rank ``T / P`` tiles of every row, the
ranks' attention work within the heaviest tile's of each other, and few runs of one rank's
consecutive tiles (at most ``2 P - 1`` in a row the zigzag or the window split balances; a
row neither does is repaired by pair swaps, or dealt heaviest first in snake order).

The fast split equals its one-row-at-a-time reference on random and adversarial work
profiles; the bound and the run count hold on Hypothesis profiles and on planned trees
(``validate_plan`` on every plan); the repair and the fallback run on a row found off
balance after the windows, with a guard that it is.
"""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from treepack.proto.options import CP_ALIGN
from treepack.service.planner import plan_batch, validate_plan
from treepack.service.planner.ranks import (
    _snake,
    _window_split,
    _zigzag,
    attention_work,
    balance_tiles,
    naive_balance_tiles,
    naive_tile_work,
    tile_work,
)

from helpers.trees import tree_sequences

# Off balance after the windows (P = 6, two tiles each): three heavy tiles side by side
# among light ones, so windows jump a heavy tile at a time; loads [13, 88, 10, 78, 81, 3],
# 85 apart where the heaviest tile is 82.
OFF_BALANCE = [82, 74, 79, 9, 1, 2, 9, 4, 1, 2, 4, 6]


def _loads(tiles: np.ndarray, tile_work: np.ndarray, P: int) -> np.ndarray:
    return np.stack([np.bincount(t, weights=w, minlength=P) for t, w in zip(tiles, tile_work)])


def _runs(tiles: np.ndarray) -> np.ndarray:
    """[R] maximal runs of one rank's consecutive tiles, per row."""
    return 1 + (np.diff(tiles, axis=1) != 0).sum(1)


def _unrepaired(tw: np.ndarray, P: int) -> tuple[np.ndarray, np.ndarray]:
    """([R, T] the zigzag where it meets the bound, else the window split; [R] bool: within
    the bound)."""
    R, T = tw.shape
    tiles = np.array(np.broadcast_to(_zigzag(T, P), (R, T)))
    off = np.ptp(_loads(tiles, tw, P), axis=1) > tw.max(1)
    tiles[off] = _window_split(tw[off], P)
    return tiles, np.ptp(_loads(tiles, tw, P), axis=1) <= tw.max(1)


def _check_split(tiles: np.ndarray, tile_work: np.ndarray, P: int) -> None:
    R, T = tile_work.shape
    assert tiles.shape == (R, T) and tiles.dtype == np.int32
    for r in range(R):
        assert np.array_equal(np.bincount(tiles[r], minlength=P), np.full(P, T // P)), f"row {r}: uneven tile counts"
    load = _loads(tiles, tile_work, P)
    assert np.all(load.max(1) - load.min(1) <= tile_work.max(1)), "a row's ranks differ by more than its heaviest tile"


def _profiles(rng: np.random.Generator, kind: str, R: int, T: int) -> np.ndarray:
    """[R, T] tile work: the shapes a row takes (ramps, sawtooth trees) and adversarial ones."""
    if kind == "ramp":  # one long sequence: work grows along the row
        return np.cumsum(rng.integers(0, 100, (R, T)), 1) + 1
    if kind == "sawtooth":  # several trees in a row
        return (np.arange(T) % rng.integers(2, 9, (R, 1))) * 100 + rng.integers(1, 50, (R, T))
    if kind == "spiky":  # a few tiles carry almost all the work
        return np.where(rng.random((R, T)) < 0.1, rng.integers(10**5, 10**6, (R, T)), rng.integers(1, 10, (R, T)))
    if kind == "clustered":  # up to 8 heavy tiles side by side (OFF_BALANCE's shape)
        at = (np.arange(T) - rng.integers(0, T, (R, 1))) % T
        return np.where(at < rng.integers(1, 9, (R, 1)), rng.integers(50, 100, (R, T)), rng.integers(1, 10, (R, T)))
    if kind == "heavy_middle":
        return (1000 / (1 + np.abs(np.arange(T) - T / 2)) * rng.random((R, T))).astype(np.int64) + 1
    return rng.integers(1, 1000, (R, T))


@pytest.mark.parametrize("kind", ["uniform", "ramp", "sawtooth", "spiky", "clustered", "heavy_middle"])
def test_balance_tiles_equals_reference(kind):
    rng = np.random.default_rng(7)
    for P in (2, 3, 4, 6, 8):
        for n in (1, 2, 3, 5):
            tw = _profiles(rng, kind, 40, P * n)
            fast = balance_tiles(tw, P)
            assert np.array_equal(fast, naive_balance_tiles(tw, P)), (kind, P, n)
            _check_split(fast, tw, P)


def test_off_balance_row_is_repaired_or_dealt_heaviest_first():
    tw = np.array([OFF_BALANCE])
    P = 6
    windows, fits = _unrepaired(tw, P)
    assert not fits[0], "the example no longer needs a repair: the test shows nothing"
    assert _runs(windows)[0] <= 2 * P - 1
    fallback = balance_tiles(tw, P, max_swaps=0)
    _check_split(fallback, tw, P)
    assert np.array_equal(fallback, _snake(tw, P))
    repaired = balance_tiles(tw, P)
    _check_split(repaired, tw, P)
    assert np.sum(repaired != windows) == 2, "one swap: two tiles change rank"
    assert _runs(repaired)[0] <= 2 * P - 1 + 4
    assert np.array_equal(repaired, naive_balance_tiles(tw, P))


def test_two_ranks_never_need_a_repair():
    """P = 2: the two windows are the share plus and minus at most half the heaviest tile."""
    rng = np.random.default_rng(3)
    for kind in ("uniform", "spiky", "heavy_middle"):
        for n in (1, 2, 7, 64):
            tw = _profiles(rng, kind, 200, 2 * n)
            load = _loads(_window_split(tw, 2), tw, 2)
            assert np.all(load.max(1) - load.min(1) <= tw.max(1) - tw.min(1))


def test_split_bound_and_runs_hold_on_any_profile():
    seen: Counter = Counter()

    @settings(max_examples=300, deadline=None)
    @given(P=st.integers(2, 8), n=st.integers(1, 8), data=st.data())
    def check(P, n, data):
        heavy = data.draw(st.sampled_from([10, 1000, 10**6]))
        tw = np.array([data.draw(st.lists(st.integers(0, heavy), min_size=P * n, max_size=P * n))], dtype=np.int64)
        tiles = balance_tiles(tw, P)
        _check_split(tiles, tw, P)
        # Every window cuts the cycle at its two ends: at most 2 (P - 1) rank changes in a row.
        assert _runs(_window_split(tw, P))[0] <= 2 * P - 1 and _runs(_zigzag(P * n, P)[None])[0] <= 2 * P - 1
        first, fits = _unrepaired(tw, P)
        if fits[0]:
            assert np.array_equal(tiles, first)
            zig = np.array_equal(first[0], _zigzag(P * n, P))
            seen["zigzag" if zig else "windows"] += int(n > 1)
        else:  # repaired (P swaps at most, 4 rank changes each) or dealt heaviest first
            assert _runs(tiles)[0] <= 2 * P - 1 + 4 * P or np.array_equal(tiles, _snake(tw, P))

    check()
    for what in ("zigzag", "windows"):
        assert seen[what] >= 10, f"vacuous: only {seen[what]} profiles of more than one tile a rank split by {what}"


@pytest.mark.parametrize("cp", [2, 3, 4, 8])
def test_planned_trees_split_in_few_runs(cp):
    """Rows of random trees: validate_plan's bound holds, and the rows the zigzag or the
    windows balance (all but rare ones) have at most 2 cp - 1 runs where the snake deal
    scatters them."""
    few = scattered = 0
    for seed in range(4):
        seqs = tree_sequences(seed, trees=3, depth=4, max_len=300)
        plan = plan_batch(seqs, seq_len=512, min_shared_len=2, cp_size=cp, cp_attention="allgather")
        validate_plan(plan, seqs)
        rk = plan.ranks
        tw = tile_work(plan.segments, plan.num_rows, rk.padded_len)
        first, fits = _unrepaired(tw, cp)
        assert np.array_equal(rk.cp_tiles[fits], first[fits])
        assert np.all(_runs(rk.cp_tiles[fits]) <= 2 * cp - 1)
        few += int(fits.sum())
        scattered += int(np.sum(_runs(_snake(tw, cp)) > 2 * cp - 1))
    assert few > 0 and scattered > 0, "no row shows the difference: the test shows nothing"


@pytest.mark.parametrize("cp", [2, 4, 8])
def test_zigzag_kept_where_it_balances(cp):
    """One sequence a row: work grows steadily along it, and each rank holds chunks r and
    2 cp - 1 - r, the usual load-balanced layout (rank 0 the row's two ends)."""
    rng = np.random.default_rng(cp)
    seqs = [rng.integers(0, 97, 1024) for _ in range(3)]
    plan = plan_batch(seqs, seq_len=1024, cp_size=cp, cp_attention="allgather")
    validate_plan(plan, seqs)
    T = plan.ranks.padded_len // CP_ALIGN
    assert np.array_equal(plan.ranks.cp_tiles, np.broadcast_to(_zigzag(T, cp), (plan.num_rows, T)))
    pos = plan.ranks.shard_positions(np.arange(plan.num_rows))
    assert not np.all(np.diff(pos[0], axis=-1) == 1)


@pytest.mark.parametrize("cp", [2, 3, 8])
def test_tile_work_equals_the_per_position_sums(cp):
    """The tile work summed in closed form per segment piece equals the per-position work
    summed over each tile, and the one-position-at-a-time reference, on planned trees
    whose segments start and end inside tiles (and on rows with empty leaf segments)."""
    cut = 0
    for seed in range(4):
        seqs = tree_sequences(seed, trees=3, depth=4, max_len=300)
        plan = plan_batch(seqs, seq_len=500, min_shared_len=2, cp_size=cp, cp_attention="allgather")
        seg, R, n = plan.segments, plan.num_rows, plan.ranks.padded_len
        fast = tile_work(seg, R, n)
        per_position = np.rint(attention_work(seg, R, n).reshape(R, -1, CP_ALIGN).sum(-1)).astype(np.int64)
        assert fast.dtype == np.int64 and np.array_equal(fast, per_position)
        assert np.array_equal(fast, naive_tile_work(seg, R, n))
        cut += int(np.sum((seg.row_start % CP_ALIGN != 0) & (seg.length > 0)))
    assert cut > 10, "no segment starts inside a tile: the closed form's partial pieces are untested"


def test_tile_split_memory_follows_the_tiles_not_the_positions():
    """Two tokens in a 2**24-position row split over 2 ranks: the rank assignment holds a
    few bytes per 16-token tile (about 48 MiB at most here), where a float64 per position
    (the old picture) alone took 128 MiB; and a limit on tiles refuses it before it runs."""
    import tracemalloc

    from treepack.proto.batch import PackInput
    from treepack.proto.errors import PayloadTooLargeError
    from treepack.service.planner.api import plan_request
    from treepack.service.planner.ranks import assign_ranks

    request = PackInput.of([np.array([1, 2], dtype=np.uint32)], seq_len=1 << 24, cp_size=2, cp_attention="allgather")
    plan = plan_request(request).plan
    assert plan.ranks.cp_tiles.shape == (1, 1 << 20)
    tracemalloc.start()
    try:
        rk = assign_ranks(plan.segments, 1, 1, seq_len=1 << 24, cp_size=2, cp_attention="allgather")
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert np.array_equal(rk.cp_tiles, plan.ranks.cp_tiles)
    assert 4 << 20 < peak < 48 << 20, peak / 2**20  # above: the int32 tile table (4 MiB) is traced
    with pytest.raises(PayloadTooLargeError) as e:
        plan_request(request, max_cp_tiles=(1 << 20) - 1)
    assert e.value.rule == "max_cp_tiles" and "1048576 tiles" in e.value.message and "max_cp_tiles" in e.value.message
