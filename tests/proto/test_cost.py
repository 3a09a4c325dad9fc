"""The cost model: counts on hand-computed plans, the fast counts against loop references,
the fit, and the file (round trip, every bad file named)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from treepack.proto.cost import (
    COST_FORMAT,
    CostModel,
    CostModelError,
    CostWarning,
    cost_terms,
    load_cost_model,
    naive_attention_pairs,
    plan_features,
)
from treepack.proto.cost_fit import fit_cost_model, held_out_errors
from treepack.proto.errors import TreepackWarning
from treepack.service.planner import plan_batch

from helpers.trees import tree_sequences

# Two sequences share [1, 2, 3]; token 4 opens both leaves (the join token, duplicated).
HAND = dict(sequences=[[1, 2, 3, 4, 5, 6], [1, 2, 3, 4, 7, 8]], trainable=[4, 4], seq_len=16, min_shared_len=1)


def hand_plan(**kw):
    return plan_batch(HAND["sequences"], trainable=HAND["trainable"], seq_len=HAND["seq_len"], min_shared_len=1, **kw)


def test_hand_plan_counts():
    plan = hand_plan()
    assert plan.num_rows == 1 and plan.segments.num_segments == 3
    terms = cost_terms("flash", ["gdn", "sparse"])
    got = dict(zip(terms, plan_features(plan, terms, backend="flash", chunk_size=2)))
    # root: 3 queries over 3 keys = 6 pairs; each leaf: 3 queries over 6 keys = 3*3 + 6 = 15.
    want = {
        "step": 1,
        "rows": 1,
        "positions": 16,
        "loss_tokens": 4,
        "segments": 3,
        "attention_pairs": 36,
        "gathered_keys": 3 + 6 + 6,
        "gdn.levels": 2,
        "gdn.chunks": 2 + 2 + 2,
        "gdn.contexts": 2,
        "sparse.pairs": 36,
    }
    assert got == want
    dense = plan_features(plan, ("attention_pairs",), backend="sdpa")
    assert dense.tolist() == [16 * 16]


def test_hand_plan_prediction():
    plan = hand_plan()
    coef = {
        "step": 1.0,
        "rows": 2.0,
        "positions": 0.5,
        "loss_tokens": 3.0,
        "segments": 0.25,
        "attention_pairs": 0.01,
        "gathered_keys": 0.1,
    }
    cost = CostModel(backend="flash", coefficients=coef)
    # 1 + 2 + 8 + 12 + 0.75 + 0.36 + 1.5
    assert cost.predict_ms(plan) == pytest.approx(25.61)
    assert sum(cost.breakdown_ms(plan).values()) == pytest.approx(25.61)
    no_share = hand_plan(placement="no_share")
    # 12 tokens in 2 segments of 6: 2 * 21 pairs, 12 gathered keys.
    assert cost.predict_ms(no_share) == pytest.approx(1 + 2 + 8 + 12 + 0.5 + 0.42 + 1.2)


@pytest.mark.parametrize("seed", range(4))
def test_visible_pairs_and_loss_tokens_match_loops(seed):
    seqs = tree_sequences(seed, trees=2, depth=3, max_len=60)
    rng = np.random.default_rng(seed)
    flags = [rng.random(len(s)) < 0.4 for s in seqs]
    for share in (False, True):
        plan = plan_batch(seqs, trainable=flags, seq_len=128, min_shared_len=2, share_trainable=share)
        (pairs, loss) = plan_features(plan, ("attention_pairs", "loss_tokens"), backend="flash")
        assert pairs == naive_attention_pairs(plan)
        # Loop reference: every real row position whose next token of the source sequence is trainable.
        src, pos = plan.token_source()
        want = sum(
            1
            for s, p in zip(src.ravel(), pos.ravel())
            if s >= 0 and p + 1 < plan.seq_lens[s] and plan.trainable_of(int(s))[p + 1]
        )
        assert loss == want and want > 0


def test_fit_recovers_coefficients():
    terms = cost_terms("sdpa", ["mamba2"])
    rng = np.random.default_rng(0)
    true = rng.uniform(0, 2, len(terms)) * (rng.random(len(terms)) < 0.7)
    X = rng.uniform(1, 100, (40, len(terms)))
    X[:, 0] = 1.0
    t = X @ true
    cost = fit_cost_model(X, t, backend="sdpa", mixers=["mamba2"])
    got = np.array([cost.coefficients[k] for k in terms])
    assert np.allclose(got, true, rtol=1e-6, atol=1e-8)
    assert cost.fit["max_rel_err"] < 1e-8
    # Non-negative even where plain least squares would go negative.
    noisy = fit_cost_model(X, t * rng.uniform(0.8, 1.2, 40), backend="sdpa", mixers=["mamba2"])
    assert min(noisy.coefficients.values()) >= 0


def test_fit_refuses_fewer_batches_than_terms():
    terms = cost_terms("flash")  # 7
    rng = np.random.default_rng(1)
    X = rng.uniform(1, 100, (6, len(terms)))
    t = X @ rng.uniform(0.1, 1, len(terms))
    with pytest.raises(CostModelError, match="6 timed batches cannot determine 7 coefficients") as e:
        fit_cost_model(X, t, backend="flash")
    assert (e.value.path, e.value.rule) == ("$.features", "underdetermined")
    X7 = rng.uniform(1, 100, (7, len(terms)))  # negative control: as many batches as terms is a fit
    assert fit_cost_model(X7, X7 @ np.ones(len(terms)), backend="flash").fit["batches"] == 7


def test_fit_reports_held_out_error_that_in_sample_error_hides():
    terms = cost_terms("sdpa")  # 6
    rng = np.random.default_rng(2)
    true = rng.uniform(0.5, 2, len(terms))
    X = rng.uniform(1, 100, (8, len(terms)))
    t = X @ true * rng.uniform(0.7, 1.3, 8)  # 30% noise on barely more batches than terms
    noisy = fit_cost_model(X, t, backend="sdpa")
    f = noisy.fit
    assert (f["batches"], f["terms"], f["rank"]) == (8, 6, 6)
    # Few spare equations soak up the noise: the batches it saw look better than the ones it did not.
    assert f["cv_median_rel_err"] > f["median_rel_err"] and f["cv_max_rel_err"] > f["max_rel_err"]
    # Leave-one-out by hand: batch i predicted by the fit to the seven others.
    want = [
        abs(float(X[i] @ _coef(fit_cost_model(np.delete(X, i, 0), np.delete(t, i), backend="sdpa"))) - t[i]) / t[i]
        for i in range(8)
    ]
    assert np.allclose(held_out_errors(X, t), want, rtol=1e-9)
    assert f["cv_median_rel_err"] == pytest.approx(float(np.median(want)))
    # Negative control: exact times on many batches are predicted exactly held out too.
    Xm = rng.uniform(1, 100, (30, len(terms)))
    exact = fit_cost_model(Xm, Xm @ true, backend="sdpa").fit
    assert exact["cv_max_rel_err"] < 1e-8


def test_fit_reports_features_that_do_not_tell_terms_apart():
    terms = cost_terms("sdpa")
    rng = np.random.default_rng(3)
    X = rng.uniform(1, 100, (12, len(terms)))
    X[:, 3] = 2 * X[:, 2]  # loss tokens always twice the positions: only their mix is measured
    assert fit_cost_model(X, X @ np.ones(len(terms)), backend="sdpa").fit["rank"] == len(terms) - 1


def _coef(cost: CostModel) -> np.ndarray:
    return np.array([cost.coefficients[k] for k in cost_terms(cost.backend, cost.mixers)])


def test_save_load_round_trip(tmp_path):
    cost = CostModel(
        backend="flash",
        mixers=("gdn",),
        coefficients={t: 0.5 for t in cost_terms("flash", ["gdn"])},
        chunk_size=32,
        device="cpu",
        description="tiny",
        fit={"batches": 3.0},
    )
    path = tmp_path / "cost.json"
    cost.save(path)
    again = load_cost_model(path)
    assert again == cost
    assert again.predict_ms(hand_plan()) == cost.predict_ms(hand_plan())


def _write(tmp_path, obj) -> str:
    p = tmp_path / "c.json"
    p.write_text(obj if isinstance(obj, str) else json.dumps(obj))
    return str(p)


def _good() -> dict:
    return CostModel(backend="sdpa", coefficients={t: 1.0 for t in cost_terms("sdpa")}).to_dict()


BAD = [
    ("not json", "{oops", "$", "json"),
    ("a list", [], "$", "type"),
    ("format", {**_good(), "format": "other"}, "$.format", "format"),
    ("version", {**_good(), "version": 99}, "$.version", "version"),
    ("backend", {**_good(), "backend": "cuda"}, "$.backend", "enum"),
    ("mixer", {**_good(), "mixers": ["lstm"]}, "$.mixers[0]", "enum"),
    ("missing term", {**_good(), "coefficients": {"step": 1.0}}, "$.coefficients", "terms"),
    (
        "negative",
        {**_good(), "coefficients": {**_good()["coefficients"], "rows": -1.0}},
        "$.coefficients.rows",
        "range",
    ),
    (
        "nan",
        {**_good(), "coefficients": {**_good()["coefficients"], "rows": float("nan")}},
        "$.coefficients.rows",
        "range",
    ),
    ("chunk", {**_good(), "chunk_size": 0}, "$.chunk_size", "range"),
    ("unknown field", {**_good(), "extra": 1}, "$.extra", "unknown"),
]


@pytest.mark.parametrize("name,content,path,rule", BAD, ids=[b[0] for b in BAD])
def test_bad_cost_files(tmp_path, name, content, path, rule):
    f = _write(tmp_path, content)
    with pytest.raises(CostModelError) as e:
        load_cost_model(f)
    assert e.value.path == path and e.value.rule == rule
    assert f in e.value.message


def test_good_file_loads_and_missing_file(tmp_path):
    assert load_cost_model(_write(tmp_path, _good())).backend == "sdpa"
    with pytest.raises(CostModelError, match="does not exist"):
        load_cost_model(tmp_path / "nope.json")
    assert _good()["format"] == COST_FORMAT


def test_cost_warning_is_a_treepack_warning():
    from treepack.trainer import TreepackWarning as TrainerWarning

    assert issubclass(CostWarning, TreepackWarning) and TrainerWarning is TreepackWarning
