"""The model's admission (:mod:`treepack.trainer.hf.admission`): one setup object, one verdict.

- :class:`PackedSetup`: equal options give equal keys (the walk cache's); a changed option
  the walk reads gives a new walk, one the probe reads a new probe, and one neither reads
  (the kernel override) neither (the negative control); bad options are refused as before;
- :func:`admit`: an admitted model's verdict lists what is handled (patched or dispatched)
  and what proved it; a refused model's verdict lists every reason, the same ones the raised
  error carries.
"""

from __future__ import annotations

import pytest
import torch

from treepack.proto.errors import RequestError, UnsupportedModelError
from treepack.trainer import materialize, naive_varlen_attention
from treepack.trainer.hf import packed_forward
from treepack.trainer.hf.admission import PackedSetup, ProbeReport, admit
from treepack.trainer.hf.admission import probe as probe_mod
from treepack.trainer.hf.admission import walk as walk_mod

from helpers.families import mixing_hook, model_support, window_case
from helpers.trainer_cases import plan_of

ms = model_support()


@pytest.fixture(scope="module")
def batch():
    c = window_case(ms.VOCAB)
    return materialize(plan_of(c), c["sequences"], trainable=c["trainable"], groups=c["groups"])


@pytest.fixture
def counts(monkeypatch):
    """Counts full walks (``check_static``) and probe runs (``run_probe``) of the admission."""
    seen = {"walk": 0, "probe": 0}
    real_check, real_probe = walk_mod.check_static, probe_mod.run_probe

    def check(*a, **kw):
        seen["walk"] += 1
        return real_check(*a, **kw)

    def probe(*a, **kw):
        seen["probe"] += 1
        return real_probe(*a, **kw)

    monkeypatch.setattr(walk_mod, "check_static", check)
    monkeypatch.setattr(probe_mod, "run_probe", probe)
    return seen


def _model():
    model = ms.build_causal_lm("qwen3")
    model.eval()
    return model


def test_equal_options_are_one_key_and_a_changed_option_another(batch):
    a = PackedSetup.of_call(batch, {"output_router_logits": False}, backend="flash", varlen_fn=naive_varlen_attention)
    b = PackedSetup.of_call(batch, {"output_router_logits": False}, backend="flash", varlen_fn=naive_varlen_attention)
    assert a == b and hash(a) == hash(b) and a.walk_key() == b.walk_key()
    assert a.row_len == batch.plan.seq_len and a.conv_width == batch.plan.gdn.conv_width and a.cp_size == 0
    model = _model()
    assert a.probe_key(model) == b.probe_key(model)
    changed = PackedSetup.of_call(batch, {"output_router_logits": False}, backend="sdpa")
    assert changed.walk_key() != a.walk_key() and changed.probe_key(model) != a.probe_key(model)
    hidden = PackedSetup.of_call(batch, {}, backend="flash", output="hidden")
    assert hidden.walk_key() != a.walk_key()
    # What neither key reads: the kernel override, compilation, whether the probe runs.
    other = PackedSetup.of_call(batch, {"output_router_logits": False}, backend="flash", compile=True, verify=False)
    assert other != a and other.walk_key() == a.walk_key() and other.probe_key(model) == a.probe_key(model)
    # The probe does not key on the caller's output or call keywords, but on the dtype.
    assert hidden.probe_key(model) == a.probe_key(model)
    assert a.probe_key(model.to(torch.float64)) != a.probe_key(_model())


def test_bad_options_are_refused_as_before():
    with pytest.raises(RequestError, match=r"backend must be one of .*got 'nope'") as e:
        PackedSetup(backend="nope")
    assert e.value.path == "$.backend"
    with pytest.raises(RequestError, match=r"output must be one of \('logits', 'hidden'\), got 'probs'") as e:
        PackedSetup(output="probs")
    assert e.value.path == "$.output"


def test_a_changed_option_walks_or_probes_again_and_an_unread_one_does_not(batch, counts):
    model = _model()
    with torch.no_grad():
        packed_forward(model, batch)
        first = dict(counts)
        assert first["walk"] >= 1 and first["probe"] == 1
        packed_forward(model, batch)
        assert counts == first, "equal options: neither walked nor probed again"
        packed_forward(model, batch, compile=False)
        assert counts == first, "an option neither key reads changes nothing (negative control)"
        packed_forward(model, batch, output="hidden")
        assert counts["walk"] > first["walk"] and counts["probe"] == first["probe"], "output: a new walk only"
        n = dict(counts)
        packed_forward(model, batch, patch_layers=False)
        assert counts["walk"] > n["walk"] and counts["probe"] == n["probe"] + 1, "patch_layers: walked and probed"


def test_an_admitted_verdict_lists_what_is_handled_and_proven(batch):
    model = _model()
    setup = PackedSetup.of_call(batch, {})
    with torch.no_grad():
        verdict = admit(model, setup)
        assert verdict.admitted and verdict.setup is setup and verdict.refusals == ()
        attention = [p for p, how in verdict.handled.items() if how == "tree_attention"]
        assert len(attention) == model.config.num_hidden_layers
        assert isinstance(verdict.probe, ProbeReport) and verdict.proven.startswith("probe")
        assert verdict.probe.logprob_err <= verdict.probe.logprob_tol
        again = admit(model, setup)  # cached: the same proof
        assert again.probe is verdict.probe and again.handled == verdict.handled
        unproven = admit(model, PackedSetup.of_call(batch, {}, verify=False))
    assert unproven.admitted and unproven.probe is None and unproven.proven == "not verified"


def test_a_refused_verdict_lists_every_reason(batch):
    model = _model()
    model.train()  # dropout in training mode: refused
    model.model.layers[0].mlp.dropout_rate = 0.1
    calls: list = []
    handle = model.model.layers[1].mlp.register_forward_hook(mixing_hook(calls))
    try:
        setup = PackedSetup.of_call(batch, {})
        verdict = admit(model, setup, raise_error=False)
        assert not verdict.admitted and verdict.probe is None
        reasons = [str(r) for r in verdict.refusals]
        assert any("model.layers.0.mlp" in r and "dropout_rate=0.1" in r for r in reasons), reasons
        assert any("model.layers.1.mlp" in r and "mixing_hook" in r for r in reasons), reasons
        with pytest.raises(UnsupportedModelError) as e:
            admit(model, setup)
        assert e.value.refusals == tuple((r.path, r.cls, r.reason) for r in verdict.refusals)
    finally:
        handle.remove()
    assert calls == [], "a refused model ran"
