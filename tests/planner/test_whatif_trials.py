"""What a what-if tells an autotuner per trial: the typed strategy (tree at a
``min_shared_len``, or plain) and the predicted step ms of every trial, ``p_step_over``,
the spread of the estimate and a suggested trial count; compositions named by what they ask."""

from __future__ import annotations

import math

import numpy as np
import pytest

from treepack.proto.cost import CostModel, cost_terms
from treepack.proto.errors import RequestError
from treepack.proto.plan_wire import plan_from_wire, plan_to_wire
from treepack.proto.strategy import Strategy
from treepack.proto.whatif import (
    MIN_SUGGESTED_TRIALS,
    Composition,
    Distribution,
    WhatIfQuery,
    as_composition,
    suggest_trials,
)
from treepack.service.planner import plan_batch
from treepack.service.planner.fingerprint import shape_of
from treepack.service.planner.whatif import build_pool, sample_groups, synthesize, whatif

from helpers.trees import plan_result

SEQ_LEN = 4096
# Tokens cost, and so does every segment: a group sharing a long prompt pays for its tree,
# sequences sharing nothing are packed plainly (the tie goes to the simpler plan).
COST = CostModel(
    backend="flash",
    coefficients={t: 0.0 for t in cost_terms("flash")} | {"step": 1.0, "attention_pairs": 1e-5, "segments": 0.5},
)


def _mixed_pool():
    """Two recorded batches: 4 GRPO groups of 6 completions of a 600-token prompt, and 24
    unrelated sequences (each its own group)."""
    rng = np.random.default_rng(0)
    seqs, prompt, groups = [], [], []
    for g in range(4):
        head = rng.integers(0, 30000, 600)
        for _ in range(6):
            seqs.append(np.concatenate([head, rng.integers(0, 30000, int(rng.integers(20, 80)))]))
            prompt.append(600)
            groups.append(g)
    lone = [rng.integers(0, 30000, int(rng.integers(200, 400))) for _ in range(24)]
    shapes = []
    for kw in (
        dict(sequences=seqs, trainable=prompt, groups=groups),
        dict(sequences=lone, trainable=[50] * 24, groups=None),
    ):
        res = plan_result(**kw, seq_len=SEQ_LEN)
        shapes.append(shape_of(res.batch, res.tree, seq_len=SEQ_LEN))
    return shapes


def test_each_trial_carries_its_strategy_and_predicted_ms_as_planning_it_alone_would():
    shapes = _mixed_pool()
    comp = Composition(groups=1)
    # The reference: draw the groups as the what-if does and plan each trial's batch with plan_batch.
    pool, rng = build_pool(shapes), np.random.default_rng(5)
    want_kind, want_ms = [], []
    for _ in range(24):
        plan = plan_batch(**synthesize(pool, sample_groups(pool, comp, rng)), seq_len=SEQ_LEN, cost_model=COST)
        want_kind.append(plan.packing)
        want_ms.append(plan.stats.predicted_ms)
    limit = float(np.median(want_ms))
    (r,) = whatif(shapes, [comp], seq_len=SEQ_LEN, trials=24, seed=5, cost_model=COST, max_step_ms=limit)
    assert len(r.strategies) == 24 and r.trial_step_ms is not None and r.trial_step_ms.shape == (24,)
    assert list(r.strategies) == want_kind
    assert np.allclose(r.trial_step_ms, want_ms, rtol=1e-12)
    # Both kinds occur (a GRPO group is a tree, a lone sequence plain): the test is not vacuous.
    assert {s.kind for s in r.strategies} == {"tree", "plain"}
    assert {s.min_shared_len for s in r.strategies if s.kind == "tree"} == {64}
    assert r.step_ms is not None and r.step_ms.mean == pytest.approx(float(np.mean(want_ms)))
    assert r.p_step_over == pytest.approx(float(np.mean(np.asarray(want_ms) > limit)))
    assert 0.0 < r.p_step_over < 1.0 and r.max_step_ms == limit


def test_without_a_cost_model_trials_are_typed_but_untimed():
    grpo, lone = _mixed_pool()
    (r,) = whatif([grpo], [3], seq_len=SEQ_LEN, trials=6, seed=1)  # GRPO groups only: every trial a tree
    assert len(r.strategies) == 6 and all(s == Strategy(kind="tree", min_shared_len=64) for s in r.strategies)
    (r,) = whatif([lone], [3], seq_len=SEQ_LEN, trials=2, seed=1)  # nothing to share: plain
    assert r.strategies == (Strategy(kind="plain"),) * 2
    assert r.step_ms is None and r.trial_step_ms is None and r.p_step_over is None
    with pytest.raises(RequestError, match="need a cost model") as e:  # negative control: no time to ask about
        whatif([grpo], [3], seq_len=SEQ_LEN, trials=2, max_step_ms=10.0)
    assert (e.value.path, e.value.rule) == ("$.max_step_ms", "needs_cost_model")


def test_distribution_spread_by_hand():
    d = Distribution.of(np.array([1.0, 2.0, 3.0, 4.0]))
    # sample variance: ((1.5^2 + 0.5^2) * 2) / 3 = 5/3
    assert d.std == pytest.approx(math.sqrt(5 / 3)) and d.stderr == pytest.approx(math.sqrt(5 / 3) / 2)
    one = Distribution.of(np.array([7.0]))
    assert one.std == 0.0 and one.stderr == 0.0 and one.mean == 7.0


def test_suggested_trials_by_hand():
    def dist(mean: float, std: float) -> Distribution:
        return Distribution(mean=mean, p50=mean, p90=mean, min=mean, max=mean, std=std, stderr=0.0)

    assert suggest_trials(dist(100.0, 5.0)) == 25  # (5 / (0.01 * 100))^2
    assert suggest_trials(dist(100.0, 5.01)) == 26
    assert suggest_trials(dist(100.0, 1.0)) == MIN_SUGGESTED_TRIALS  # 1 trial would do: never fewer than 8
    assert suggest_trials(dist(100.0, 0.0)) == MIN_SUGGESTED_TRIALS


def test_results_report_the_spread_and_how_many_trials_it_takes():
    shapes = _mixed_pool()
    few, many = (
        whatif(shapes, [Composition(groups=2)], seq_len=SEQ_LEN, trials=n, seed=3, cost_model=COST)[0] for n in (4, 64)
    )
    for r in (few, many):
        assert r.step_ms is not None
        assert r.step_ms.stderr == pytest.approx(r.step_ms.std / math.sqrt(r.trials))
        assert r.suggested_trials == suggest_trials(r.step_ms)
    # The spread of one trial does not shrink with more trials; the mean's error does.
    assert many.step_ms.stderr < few.step_ms.stderr
    assert many.suggested_trials > many.trials  # the mixed pool is noisy: 64 trials are not 1%


def test_compositions_from_ints_and_dicts_are_named_by_what_they_ask():
    assert as_composition(12).name == "12 groups" and as_composition(1).name == "1 group"
    assert as_composition({"by_tag": {"math": 20, "code": 12}}).name == "math 20 + code 12"
    assert as_composition({"groups": 3}).name == "3 groups"
    assert Composition(by_tag={"": 2}).name == "(untagged) 2"
    assert as_composition({"name": "mine", "groups": 3}).name == "mine"  # a given name is kept
    names = [c.name for c in WhatIfQuery.of([4, {"by_tag": {"a": 1}}], seq_len=64).compositions]
    assert names == ["4 groups", "a 1"]


def test_plan_packing_round_trips_and_a_version_1_plan_gets_one_derived():
    rng = np.random.default_rng(2)
    head = rng.integers(0, 999, 100)
    seqs = [np.concatenate([head, rng.integers(0, 999, 20)]) for _ in range(4)]
    for placement, want in (
        ("auto", Strategy(kind="tree", min_shared_len=16)),
        ("bfd", Strategy(kind="tree", min_shared_len=16)),
        ("no_share", Strategy(kind="plain")),
    ):
        plan = plan_batch(seqs, trainable=[100] * 4, seq_len=512, min_shared_len=16, placement=placement)
        assert plan.packing == want
        msg = plan_to_wire(plan, "json")
        assert msg["packing"] == {"kind": want.kind, "min_shared_len": want.min_shared_len}
        assert plan_from_wire(msg).packing == want
        old = plan_to_wire(plan, "json", version=1)
        assert "packing" not in old and old["version"] == 1
        assert plan_from_wire(old).packing == want


def test_validate_plan_holds_the_typed_strategy_to_the_segments():
    import dataclasses

    from treepack.service.planner import validate_plan
    from treepack.service.planner.invariant import PlanInvariantError

    rng = np.random.default_rng(4)
    head = rng.integers(0, 999, 100)
    seqs = [np.concatenate([head, rng.integers(0, 999, 20)]) for _ in range(4)]
    plan = plan_batch(seqs, trainable=[100] * 4, seq_len=512, min_shared_len=16)
    validate_plan(plan)
    for forged in (Strategy(kind="plain"), Strategy(kind="tree", min_shared_len=64)):
        with pytest.raises(PlanInvariantError, match="packing"):
            validate_plan(dataclasses.replace(plan, packing=forged))
