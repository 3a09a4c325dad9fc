"""``PackingConfig(cost_model=...)``: the TRL trainers plan with the cost model (embedded)."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("trl")

from treepack.proto.cost import CostModel, cost_terms  # noqa: E402
from treepack.proto.errors import RequestError  # noqa: E402
from treepack.trainer.planning import plan_microbatches  # noqa: E402
from treepack.trainer.trl import PackingConfig  # noqa: E402

COST = CostModel(
    backend="sdpa",
    coefficients={t: 0.0 for t in cost_terms("sdpa")} | {"positions": 0.01, "attention_pairs": 1e-5, "step": 1.0},
)


def test_packing_config_plans_with_the_cost_model():
    rng = np.random.default_rng(0)
    prompt = rng.integers(0, 50, 40).tolist()
    seqs = [prompt + rng.integers(0, 50, 10).tolist() for _ in range(8)]
    planner = PackingConfig(cost_model=COST).make_planner()
    mb = plan_microbatches(
        seqs, num_microbatches=1, planner=planner, seq_len=256, trainable=[40] * 8, min_shared_len=16
    )
    plan = mb.plan
    assert plan.stats.predicted_ms == pytest.approx(COST.predict_ms(plan)) and "by time" in plan.strategy
    # Without one the planner is as given and nothing is predicted.
    assert PackingConfig().make_planner() is None


def test_cost_model_and_planner_are_exclusive():
    with pytest.raises(RequestError, match="not both"):
        PackingConfig(cost_model=COST, planner="http://127.0.0.1:1")
