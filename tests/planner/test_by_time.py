"""``placement="auto"`` with a cost model: tree or plain packing by predicted time (fixed
coefficients, no timing)."""

from __future__ import annotations

import warnings

import numpy as np
import pytest

from treepack.proto.cost import CostModel, CostWarning, cost_terms
from treepack.proto.plan_wire import plan_differences, plan_from_wire, plan_to_wire
from treepack.proto.strategy import Strategy
from treepack.service.planner import plan_batch, validate_plan
from treepack.service.planner.by_time import time_candidates


def cost(backend: str = "flash", **coef: float) -> CostModel:
    return CostModel(backend=backend, coefficients={t: coef.get(t, 0.0) for t in cost_terms(backend)})


# Per position and per visible pair: what a GPU step mostly pays.
COMPUTE = cost(positions=0.01, attention_pairs=1e-6, segments=0.05, step=5.0)


def no_sharing_batch(seed: int = 0):
    rng = np.random.default_rng(seed)
    seqs = [np.concatenate([[1000 + i], rng.integers(0, 999, size=int(rng.integers(50, 400)))]) for i in range(40)]
    return seqs, [10] * len(seqs)


def test_golden_picks_the_tree(golden):
    kw = golden.plan_kwargs()
    plan = plan_batch(cost_model=COMPUTE, **kw)
    validate_plan(plan, golden.sequences, trainable=kw["trainable"])
    plain = plan_batch(**{**kw, "placement": "no_share"})
    assert plan.num_rows == 2 and plan.placement == "auto"
    assert plan.strategy.split(" by time")[0] not in ("no_share",) and "vs no_share" in plan.strategy
    assert plan.stats.predicted_ms == pytest.approx(COMPUTE.predict_ms(plan))
    assert plan.stats.predicted_ms < COMPUTE.predict_ms(plain)
    assert "by_time" in plan.stats.timings_ms


def test_no_sharing_packs_plainly_and_not_slower():
    seqs, prompt = no_sharing_batch()
    with warnings.catch_warnings():
        # Nothing to share: the tree plan is plain packing already, nothing to warn about.
        warnings.simplefilter("error", CostWarning)
        plan = plan_batch(seqs, trainable=prompt, seq_len=2048, cost_model=COMPUTE)
    validate_plan(plan, seqs, trainable=prompt)
    plain = plan_batch(seqs, trainable=prompt, seq_len=2048, placement="no_share")
    assert not (plan.segments.sharers >= 2).any() and plan.placement == "auto"
    assert plan.num_rows <= plain.num_rows and plan.stats.predicted_ms <= COMPUTE.predict_ms(plain)
    assert plan.stats.predicted_ms == pytest.approx(COMPUTE.predict_ms(plan))


def test_short_sharing_that_does_not_pay_warns():
    # Pairs share 40 tokens, then each has 300 of its own: with a heavy per-segment term the
    # shared segments cost more than the tokens they save.
    rng = np.random.default_rng(2)
    seqs = []
    for _i in range(10):
        head = rng.integers(0, 999, 40).tolist()
        seqs += [head + rng.integers(0, 999, 300).tolist() for _ in range(2)]
    prompt = [41] * len(seqs)
    heavy = cost(segments=50.0, positions=0.001)
    with pytest.warns(CostWarning, match="does not pay"):
        plan = plan_batch(seqs, trainable=prompt, seq_len=4096, min_shared_len=8, cost_model=heavy)
    validate_plan(plan, seqs, trainable=prompt)
    assert not (plan.segments.sharers >= 2).any()
    tree = plan_batch(seqs, trainable=prompt, seq_len=4096, min_shared_len=8)
    assert (tree.segments.sharers >= 2).any() and plan.stats.predicted_ms < heavy.predict_ms(tree)
    # Negative control: without a cost model auto keeps its tree and says nothing.
    with warnings.catch_warnings():
        warnings.simplefilter("error", CostWarning)
        assert plan_batch(seqs, trainable=prompt, seq_len=4096, min_shared_len=8).stats.saved_fraction > 0


def test_segment_heavy_cost_prefers_plain_packing_of_a_sharing_batch(golden):
    # A device where every segment costs a lot and tokens are free: the tree's extra
    # segments do not pay, although it saves 66% of the tokens.
    kw = golden.plan_kwargs()
    heavy = cost(segments=100.0, rows=1.0)
    with pytest.warns(CostWarning):
        plan = plan_batch(cost_model=heavy, **kw)
    assert plan.strategy.startswith("no_share")
    assert plan.packing == Strategy(kind="plain") and str(plan.packing) == "plain"
    # Negative control: the tree plan of the same batch is typed as a tree at the asked threshold.
    assert plan_batch(**kw).packing == Strategy(kind="tree", min_shared_len=64)
    validate_plan(plan, golden.sequences, trainable=kw["trainable"])


def test_larger_min_shared_len_wins_where_short_shared_segments_cost():
    # Many sequences share a 200-token prefix, then pairs of them a short 8-token run.
    rng = np.random.default_rng(1)
    head = rng.integers(0, 999, 200).tolist()
    seqs = []
    for _i in range(6):
        mid = rng.integers(0, 999, 8).tolist()
        for _j in range(2):
            seqs.append(head + mid + rng.integers(0, 999, 30).tolist())
    prompt = [len(head) + 8 + 1] * len(seqs)
    first = plan_batch(seqs, trainable=prompt, seq_len=1024, min_shared_len=4)
    labels = [label for label, _ in time_candidates(first)]
    assert labels == ["no_share", "min_shared_len=16", "min_shared_len=64"]
    seg_cost = cost(segments=10.0, positions=0.001, attention_pairs=1e-3)
    plan = plan_batch(seqs, trainable=prompt, seq_len=1024, min_shared_len=4, cost_model=seg_cost)
    validate_plan(plan, seqs, trainable=prompt)
    assert plan.strategy.startswith("min_shared_len=")
    assert plan.min_shared_len in (16, 64) and plan.segments.num_segments < first.segments.num_segments
    assert plan.packing == Strategy(kind="tree", min_shared_len=plan.min_shared_len)
    assert first.packing == Strategy(kind="tree", min_shared_len=4)
    assert plan.stats.predicted_ms < seg_cost.predict_ms(first)


def test_no_candidates_beyond_plain_without_short_shared_segments():
    seqs, prompt = no_sharing_batch()
    first = plan_batch(seqs, trainable=prompt, seq_len=2048)
    assert [label for label, _ in time_candidates(first)] == ["no_share"]


@pytest.mark.parametrize("placement", ["bfd", "no_share", "in_order"])
def test_named_placements_get_a_prediction_only(golden, placement):
    kw = {**golden.plan_kwargs(), "placement": placement}
    plan = plan_batch(cost_model=COMPUTE, **kw)
    assert plan.strategy == placement and plan.stats.predicted_ms == pytest.approx(COMPUTE.predict_ms(plan))
    assert plan_batch(**kw).stats.predicted_ms is None


@pytest.mark.parametrize("fmt", ["json", "msgpack"])
def test_prediction_travels(fmt, golden):
    plan = plan_batch(cost_model=COMPUTE, **golden.plan_kwargs())
    again = plan_from_wire(plan_to_wire(plan, fmt))
    assert again.stats.predicted_ms == plan.stats.predicted_ms and plan_differences(plan, again) == []


def test_a_row_is_worth_its_rows_and_positions_terms(golden):
    kw = golden.plan_kwargs()
    for backend, dense in (("flash", False), ("sdpa", True)):
        model = cost(backend, rows=0.3, positions=0.002, attention_pairs=1e-7, segments=0.05, step=5.0)
        plan = plan_batch(**kw)
        part = model.breakdown_ms(plan)
        per_rows = part["rows"] + part["positions"] + (part["attention_pairs"] if dense else 0.0)
        assert model.row_ms(plan.seq_len) * plan.num_rows == pytest.approx(per_rows)


def test_repair_budget_is_sized_by_what_a_row_is_worth(golden):
    from treepack.proto.options import PlanOptions
    from treepack.service.planner.by_time import REPAIR_MS_CAP, REPAIR_ROW_SHARE, repair_budget_ms

    opts = PlanOptions(seq_len=4096, repair_ms=10.0)
    assert repair_budget_ms(cost(positions=1e-6), opts) == 10.0  # a cheap row: the asked budget
    assert repair_budget_ms(cost(positions=0.1), opts) == pytest.approx(REPAIR_ROW_SHARE * 0.1 * 4096)
    assert repair_budget_ms(cost(positions=10.0), opts) == REPAIR_MS_CAP
    assert repair_budget_ms(cost(positions=10.0), PlanOptions(seq_len=4096, repair_ms=0.0)) == 0.0
    assert repair_budget_ms(cost(positions=10.0), PlanOptions(seq_len=4096, repair_ms=5000.0)) == 5000.0
    kw = golden.plan_kwargs()
    heavy = cost(positions=0.05, rows=1.0)
    plan = plan_batch(cost_model=heavy, **kw)
    validate_plan(plan, golden.sequences, trainable=kw["trainable"])
    budget = repair_budget_ms(heavy, plan.options)
    assert plan.stats.timings_ms["repair_budget"] == pytest.approx(budget) and budget > plan.options.repair_ms
    assert "repair_budget" not in plan_batch(**kw).stats.timings_ms
