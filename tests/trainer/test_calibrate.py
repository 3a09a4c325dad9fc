"""``calibrate``: a cost model measured on this device for the model's own mixers (no timing
asserts: only that every step ran, every term was fitted and the file round-trips)."""

from __future__ import annotations

import math

from treepack.proto.cost import cost_terms, load_cost_model
from treepack.service.planner import plan_batch
from treepack.trainer import calibrate, time_step
from treepack.trainer.cost import calibration_batches, model_conv_width, model_mixers


def tiny_qwen3():
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen3Config(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=8,
    )
    return Qwen3ForCausalLM(cfg).float()


def test_calibration_batches_vary_in_shape():
    batches = calibration_batches(256, vocab=50, seed=0)
    assert all(max(len(s) for s in b["sequences"]) <= 256 for b in batches)
    shared = [
        plan_batch(b["sequences"], trainable=b["trainable"], seq_len=256, min_shared_len=4).stats.saved_fraction
        for b in batches
    ]
    assert min(shared) == 0.0 and max(shared) > 0.5
    assert len({len(b["sequences"]) for b in batches}) > 5


def test_calibrate_attention_model(tmp_path):
    model = tiny_qwen3()
    seen = []
    batches = calibration_batches(128, vocab=64)[::3]
    cost = calibrate(
        model,
        backend="flash",
        seq_len=128,
        batches=batches,
        repeats=1,
        warmup=0,
        report=lambda name, plan, ms: seen.append((name, ms)),
    )
    assert cost.mixers == () and set(cost.coefficients) == set(cost_terms("flash"))
    assert [n for n, _ in seen] == [f"{b['name']} / {p}" for b in batches for p in ("auto", "no_share")] and all(
        ms > 0 for _, ms in seen
    )
    assert cost.fit["batches"] == len(seen) and math.isfinite(cost.fit["max_rel_err"])
    assert cost.fit["terms"] == 7 and math.isfinite(cost.fit["cv_median_rel_err"])
    cost.save(tmp_path / "c.json")
    again = load_cost_model(tmp_path / "c.json")
    b = calibration_batches(128, vocab=64, seed=1)[0]
    plan = plan_batch(b["sequences"], trainable=b["trainable"], seq_len=128, min_shared_len=2)
    assert again.predict_ms(plan) == cost.predict_ms(plan) > 0
    assert time_step(model, plan, b["sequences"], repeats=1, warmup=0) > 0


def tiny_lfm2():
    import torch
    from transformers import Lfm2Config, Lfm2ForCausalLM

    torch.manual_seed(0)
    cfg = Lfm2Config(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        layer_types=["conv", "full_attention"],
        conv_L_cache=3,
    )
    return Lfm2ForCausalLM(cfg).float()


def test_calibrate_hybrid_measures_its_mixer_terms():
    model = tiny_lfm2()
    assert model_mixers(model) == ("short_conv",) and model_conv_width(model) == 3
    assert model_mixers(tiny_qwen3()) == ()
    batches = calibration_batches(128, vocab=64)[::2]  # 6 batches, 12 plans for 9 terms
    cost = calibrate(model, backend="sdpa", seq_len=128, batches=batches, repeats=1, warmup=0)
    assert cost.mixers == ("short_conv",) and {"short_conv.levels", "short_conv.chunks", "short_conv.contexts"} <= set(
        cost.coefficients
    )
    assert cost.fit["batches"] == 2 * len(batches)


def test_calibrate_refuses_too_few_batches_before_timing_anything():
    import pytest

    from treepack.proto.errors import CostModelError

    model = tiny_qwen3()
    timed = []
    with pytest.raises(CostModelError, match="3 batches .timed as 6 plans. cannot determine the 7 cost terms") as e:
        calibrate(
            model,
            backend="flash",
            seq_len=128,
            batches=calibration_batches(128, vocab=64)[::4],
            repeats=1,
            warmup=0,
            report=lambda *a: timed.append(a),
        )
    assert (e.value.path, e.value.rule) == ("$.batches", "underdetermined") and timed == []
