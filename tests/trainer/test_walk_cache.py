"""The model walk of ``packed_forward`` runs once per model state (:mod:`treepack.trainer.hf.admission.walk_cache`).

A second call on an unchanged model skips ``check_model``, the hook installation and the
probe lookup; every change the run-time guards judge, made after the first call, is
still refused before the model runs (a hook, an instance or class forward patch, a
swapped module, dropout switched on while training), and a mode change walks again.
"""

from __future__ import annotations

import pytest
import torch

from treepack.proto.errors import UnsupportedModelError
from treepack.service.planner import validate_plan
from treepack.trainer import materialize
from treepack.trainer.hf import packed_forward
from treepack.trainer.hf.admission import walk as walk_mod
from treepack.trainer.hf.admission.probe import forget_probes
from treepack.trainer.hf.admission.walk_cache import forget_walks, model_state

from helpers.families import mixing_hook, model_support, window_case
from helpers.trainer_cases import plan_of

ms = model_support()


@pytest.fixture(scope="module")
def batch():
    c = window_case(ms.VOCAB)
    plan = plan_of(c)
    validate_plan(plan, c["sequences"], trainable=c["trainable"])
    return materialize(plan, c["sequences"], trainable=c["trainable"], groups=c["groups"])


@pytest.fixture
def walks(monkeypatch):
    """Counts full walks (``check_static`` calls made by ``packed_forward``'s admission)."""
    seen = []
    real = walk_mod.check_static

    def counting(*a, **kw):
        seen.append(1)
        return real(*a, **kw)

    monkeypatch.setattr(walk_mod, "check_static", counting)
    return seen


def _model():
    model = ms.build_causal_lm("qwen3")
    model.eval()
    return model


def test_an_unchanged_model_is_walked_once(batch, walks):
    model = _model()
    with torch.no_grad():
        first = packed_forward(model, batch)
        n = len(walks)  # the first call, and the probe's own packed calls
        again = packed_forward(model, batch)
        packed_forward(model, batch)
    assert n >= 1 and len(walks) == n, "an unchanged model was walked again"
    assert torch.equal(first, again)


def test_the_heads_own_hooks_do_not_walk_again(batch, walks):
    """``output="hidden"`` and a reward model's scores read the model through a hook of their own for
    one call; it leaves torch's hook counter as found, so the next call is not taken for a changed
    model (every ``output="hidden"`` call walked the model again before), while a caller's hook is."""
    from helpers.heads import head_model

    for model, kw in ((_model(), {"output": "hidden"}), (head_model("qwen3", "sequence"), {})):
        with torch.no_grad():
            packed_forward(model, batch, **kw)
            n = len(walks)
            packed_forward(model, batch, **kw)
            packed_forward(model, batch, **kw)
            assert len(walks) == n, "the model was walked again after its own hook"
            model.get_submodule("model.norm").register_forward_hook(lambda m, a, o: None)
            with pytest.raises(UnsupportedModelError, match=r"model\.norm \(Qwen3RMSNorm\): forward hook"):
                packed_forward(model, batch, **kw)  # walked again, and judged
        assert len(walks) == n + 1


def test_forgetting_walks_walks_again(batch, walks):
    model = _model()
    with torch.no_grad():
        packed_forward(model, batch)
        n = len(walks)
        forget_walks(model)
        packed_forward(model, batch)
        assert len(walks) == n + 1
        forget_probes(model)
        packed_forward(model, batch)
    assert len(walks) > n + 1


def test_a_mode_or_setup_change_walks_again(batch, walks):
    model = _model()
    with torch.no_grad():
        packed_forward(model, batch)
        n = len(walks)
        packed_forward(model, batch, output="hidden")
        assert len(walks) > n, "another output is another setup"
        n = len(walks)
    model.train()
    packed_forward(model, batch)
    assert len(walks) > n, "training mode is another model state"


def _refused(model, batch, match, calls):
    with pytest.raises(UnsupportedModelError, match=match):
        with torch.no_grad():
            packed_forward(model, batch)
    assert calls == [], "the changed code ran: not refused before compute"


@pytest.mark.parametrize(
    "kind",
    ["forward hook", "pre-hook", "global hook", "instance forward", "class forward", "swapped module", "dropout"],
)
def test_a_change_after_the_first_call_is_refused(batch, kind, monkeypatch):
    model = _model()
    with torch.no_grad():
        packed_forward(model, batch)  # walked, probed and remembered
        packed_forward(model, batch)
    calls: list = []
    mlp = model.model.layers[0].mlp
    handle = None
    if kind == "forward hook":
        handle = mlp.register_forward_hook(mixing_hook(calls))
        match = r"model\.layers\.0\.mlp \(Qwen3MLP\): forward hook .*mixing_hook"
    elif kind == "pre-hook":

        def shifting_pre_hook(module, args):
            calls.append(module)
            return (args[0].roll(1, dims=1),)

        handle = mlp.register_forward_pre_hook(shifting_pre_hook)
        match = r"forward pre-hook .*shifting_pre_hook"
    elif kind == "global hook":
        handle = torch.nn.modules.module.register_module_forward_hook(lambda m, a, out: calls.append(m))
        match = r"<global>.*global forward hook"
    elif kind == "instance forward":
        stock = mlp.forward

        def cumsum_forward(x):
            calls.append(1)
            return stock(x).cumsum(1)

        mlp.forward = cumsum_forward
        match = r"forward replaced on the instance by .*cumsum_forward"
    elif kind == "class forward":
        cls = type(mlp)
        stock_fn = cls.forward

        def rolled_forward(self, x):
            calls.append(1)
            return stock_fn(self, x).roll(1, dims=1)

        monkeypatch.setattr(cls, "forward", rolled_forward)
        match = r"Qwen3MLP\.forward replaced by .*rolled_forward"
    elif kind == "swapped module":

        class Rolling(torch.nn.Module):  # code outside torch / transformers: cannot be read
            def forward(self, x):
                calls.append(1)
                return x.roll(1, dims=1)

        model.model.layers[0].mlp = Rolling()
        match = r"model\.layers\.0\.mlp \(Rolling\): forward defined outside torch"
    else:
        model.train()
        packed_forward(model, batch)  # training without dropout runs
        model.model.layers[1].mlp.act_fn = torch.nn.Sequential(model.model.layers[1].mlp.act_fn, torch.nn.Dropout(0.0))
        packed_forward(model, batch)
        model.model.layers[1].mlp.act_fn[1].p = 0.1  # switched on after the model was walked
        match = r"act_fn\.1 \(Dropout\): dropout p=0\.1"
        with pytest.raises(UnsupportedModelError, match=match):
            packed_forward(model, batch)
        return
    try:
        _refused(model, batch, match, calls)
    finally:
        if handle is not None:
            handle.remove()


def test_the_fingerprint_sees_what_the_guards_read():
    model = _model()
    before = model_state(model)
    assert model_state(model) == before
    model.model.layers[0].mlp.register_forward_hook(lambda m, a, o: None)
    hooked = model_state(model)
    assert hooked != before
    model.config.attention_dropout = 0.1
    assert model_state(model) != hooked
