"""A cost model's range: the term bounds hold on real plans, and a model that can overflow
anywhere in a service's range is refused naming its coefficient (the rest never)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from treepack.proto.cost import MIXER_KINDS, CostModel, CostModelError, cost_terms
from treepack.proto.cost_range import check_cost_range, load_checked_cost_model, max_counts
from treepack.service.planner import plan_batch

from helpers.trees import tree_sequences


@pytest.mark.parametrize("backend", ["sdpa", "flex", "flash"])
def test_every_term_of_a_real_plan_is_within_its_bound(backend):
    """Plans of random trees (long shared prefixes, many rows, empty-ish leaves): each count
    stays under the bound for their sequence count and seq_len, and the tightest bound is
    reached within a factor (the bounds are not vacuous either)."""
    model = CostModel(
        backend=backend, mixers=MIXER_KINDS, coefficients={t: 1.0 for t in cost_terms(backend, MIXER_KINDS)}
    )
    closest = {}
    for seed in range(6):
        seqs = tree_sequences(seed, trees=4, depth=5, max_len=200)
        for seq_len in (200, 256, 1000):
            plan = plan_batch(seqs, seq_len=seq_len, min_shared_len=2)
            got = dict(zip(model.terms, model.features(plan)))
            bound = max_counts(model, max_sequences=len(seqs), max_seq_len=seq_len)
            for t in model.terms:
                assert got[t] <= bound[t], (t, got[t], bound[t])
                closest[t] = max(closest.get(t, 0.0), got[t] / bound[t])
    assert closest["step"] == 1.0 and closest["attention_pairs"] > (0.01 if backend == "sdpa" else 0.001), closest


def test_a_model_that_overflows_is_refused_by_its_coefficient():
    coef = {t: 0.0 for t in cost_terms("sdpa")}
    for term, value in (("attention_pairs", 1e300), ("positions", 1e300), ("step", 1.7e308)):
        model = CostModel(backend="sdpa", coefficients=coef | {"step": 1.0, term: value})
        with pytest.raises(CostModelError) as e:
            check_cost_range(model, max_sequences=262_144, trials=2000)
        assert e.value.path == f"$.coefficients.{term}" and e.value.rule == "range", e.value
        usable = float(e.value.message.split("at most ")[1].split()[0])
        edge = CostModel(backend="sdpa", coefficients=coef | {"step": 1.0, term: usable * 0.999})
        check_cost_range(edge, max_sequences=262_144, trials=2000)  # the value it names is usable
    realistic = CostModel(
        backend="sdpa", coefficients=coef | {"step": 30.0, "rows": 2.0, "positions": 2e-3, "attention_pairs": 1e-9}
    )
    check_cost_range(realistic, max_sequences=262_144, trials=100_000)


def test_the_service_load_names_the_file_and_a_plan_never_predicts_infinity(tmp_path):
    coef = {t: 0.0 for t in cost_terms("sdpa")}
    path = tmp_path / "c.json"
    CostModel(backend="sdpa", coefficients=coef | {"attention_pairs": 1e300}).save(path)
    with pytest.raises(CostModelError) as e:
        load_checked_cost_model(path, max_sequences=1000)
    assert str(path) in str(e.value) and "\n" not in str(e.value)
    # A model used outside any checked range refuses the plan it cannot predict, by name.
    model = CostModel(backend="sdpa", coefficients=coef | {"attention_pairs": 1e300})
    plan = plan_batch([np.arange(10, dtype=np.uint32)], seq_len=1 << 20)
    with pytest.raises(CostModelError) as e:
        model.predict_ms(plan)
    assert e.value.path == "$.coefficients.attention_pairs"
    assert math.isfinite(model.predict_ms(plan_batch([np.arange(10, dtype=np.uint32)], seq_len=16)))
