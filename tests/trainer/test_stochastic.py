"""Random draws other than dropout are refused by name in train mode and exact in eval.

Router jitter (Mixtral's and MiniMax-M2's ``router_jitter_noise``) and layerdrop (OPT) are
refused by their config field before any compute; PhiMoE's router samples its experts while training whatever its
fields say, and a noise-injecting hook is no field at all: the probe finds both by what they
do (random operators recorded by module) and names them. A draw that cannot change a value
(DBRX's ``uniform_(1, 1)``) is not a draw; randomness torch does not see (numpy) is caught
because the same sequence alone, run twice, differs. ``allow_stochastic`` is the escape.
"""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch

from treepack.proto.errors import UnsupportedModelError
from treepack.trainer import materialize, packed_forward
from treepack.trainer.hf.admission import trust_hook
from treepack.trainer.hf.admission.guards import stochastic_refusals

from helpers.families import model_support, oracle, window_case
from helpers.tolerance import assert_close
from helpers.trainer_cases import plan_of

ms = model_support()


@pytest.fixture(scope="module")
def case():
    c = window_case(ms.VOCAB)
    return c, materialize(plan_of(c), c["sequences"], trainable=c["trainable"], groups=c["groups"])


def _exact_in_eval(model, case, zero_in_exact_arithmetic: str = r"$^"):
    c, batch = case
    model.eval()
    alone, packed, g_alone, g_packed = oracle(model, batch, c)
    assert_close("logprobs", alone, packed, atol=1e-5)
    # PhiMoE's eval-mode router gets no gradient (its top-k weights come from a hard selection);
    # a key bias gets only rounding (the softmax does not change when every score shifts alike).
    zero = {k for k, g in g_alone.items() if not bool(g.any()) or re.search(zero_in_exact_arithmetic, k)}
    assert len(zero) < len(g_alone) and all(not bool(g_packed[k].any()) for k in zero if not bool(g_alone[k].any()))
    keep = lambda g: {k: v for k, v in g.items() if k not in zero}  # noqa: E731
    assert_close("grads", keep(g_alone), keep(g_packed), ratio=1e-4, nonzero_ref=True)


@pytest.mark.parametrize(
    "model_type,module,cls",
    [("mixtral", "model.layers.0.mlp", "MixtralSparseMoeBlock"), ("minimax_m2", "model.layers.0.mlp", "MiniMaxM2")],
)
def test_router_jitter_is_refused_by_name_in_train_mode_and_exact_in_eval(case, model_type, module, cls):
    model = ms.build_causal_lm(model_type, router_jitter_noise=0.1)
    model.train()
    with pytest.raises(UnsupportedModelError) as e:
        packed_forward(model, case[1])
    msg = str(e.value)
    assert f"{module} ({cls}" in msg and "jitter_noise=0.1 draws random numbers while training" in msg
    assert "config.router_jitter_noise=0.1" in msg and "allow_stochastic=True" in msg
    paths = {r[0] for r in e.value.refusals}
    assert {module, "config.router_jitter_noise"} <= paths
    _exact_in_eval(model, case)


def test_layerdrop_is_refused_by_name_in_train_mode_and_exact_in_eval(case):
    model = ms.build_causal_lm("opt", layerdrop=0.1)  # OPT skips whole layers at random while training
    model.train()
    with pytest.raises(UnsupportedModelError) as e:
        packed_forward(model, case[1])
    msg = str(e.value)
    assert "model.decoder (OPTDecoder): layerdrop=0.1 draws random numbers while training" in msg
    assert "config.layerdrop (OPTConfig)" in msg and "allow_stochastic=True" in msg
    _exact_in_eval(model, case, zero_in_exact_arithmetic=r"k_proj\.bias$")


def test_allow_stochastic_accepts_router_jitter_and_proves_the_rest(case):
    model = ms.build_causal_lm("mixtral", router_jitter_noise=0.1)
    model.train()
    c, batch = case
    state = torch.get_rng_state()
    logits = packed_forward(model, batch, allow_stochastic=True)
    assert torch.isfinite(logits).all() and not torch.equal(torch.get_rng_state(), state)  # the step itself draws
    assert stochastic_refusals(model, allow_stochastic=True) == []


def test_gumbel_routing_is_refused_by_behaviour_in_train_mode_and_exact_in_eval(case):
    model = ms.build_causal_lm("phimoe", router_jitter_noise=0.0)  # no field gives it away
    model.train()
    assert stochastic_refusals(model) == []
    with pytest.raises(UnsupportedModelError) as e:
        packed_forward(model, case[1])
    msg = str(e.value)
    assert e.value.rule == "stochastic"
    assert "model.layers.0.mlp.router (PhimoeTopKRouter): draws random numbers while training (exponential_" in msg
    _exact_in_eval(model, case)


def test_a_noise_injecting_layer_is_refused_in_train_mode_and_exact_in_eval(case):
    model = ms.build_causal_lm("qwen3")
    model.train()

    @trust_hook
    def noisy(m, args, out):  # Gaussian noise injection while training: no dropout anywhere
        return out + 0.01 * torch.randn_like(out) if m.training else out

    model.model.layers[1].mlp.register_forward_hook(noisy)
    with pytest.raises(UnsupportedModelError, match=r"model\.layers\.1\.mlp \(Qwen3MLP\): draws random numbers "):
        packed_forward(model, case[1])
    _exact_in_eval(model, case)


def test_a_draw_that_cannot_change_a_value_is_not_refused(case):
    model = ms.build_causal_lm("qwen3")
    model.train()

    @trust_hook
    def unit_jitter(m, args, out):  # DBRX with moe_jitter_eps=0: uniform_(1, 1)
        return out * torch.empty_like(out).uniform_(1.0, 1.0)

    model.model.layers[0].mlp.register_forward_hook(unit_jitter)
    c, batch = case
    alone, packed, _, _ = oracle(model, batch, c, grads=False)
    assert_close("logprobs", alone, packed, atol=1e-5)


def test_randomness_torch_does_not_see_is_caught_by_running_twice(case):
    model = ms.build_causal_lm("qwen3")
    model.train()
    rng = np.random.default_rng(0)

    @trust_hook
    def numpy_noise(m, args, out):
        return out + torch.from_numpy(rng.normal(0, 0.01, out.shape).astype(np.float32))

    model.model.layers[0].mlp.register_forward_hook(numpy_noise)
    with pytest.raises(UnsupportedModelError, match=r"not a function of its inputs.*model\.layers\.0\.mlp") as e:
        packed_forward(model, case[1])
    assert e.value.rule == "stochastic"
