"""The probe at the precision the step computes in (:mod:`treepack.trainer.hf.admission.tolerance`).

bf16 autocast (sdpa, the flash path through the CPU varlen reference; eval, train and
gradient checkpointing), fp16 autocast, bf16 parameters, float64 and accelerate's bf16 are
accepted within the stated multiple of the model's own noise floor, and each has its
negative control: a broken mask (the rows run as plain causal packing) is still refused,
its drift far above the multiple times the noise floor. The noise model's figures are
checked by hand; the second batch shape is measured only when the first is not enough.
"""

from __future__ import annotations

import importlib
import re
from contextlib import nullcontext

import pytest
import torch

from treepack.proto.errors import UnsupportedModelError
from treepack.trainer import materialize, naive_varlen_attention, packed_forward
from treepack.trainer.hf.admission import forget_probes
from treepack.trainer.hf.admission.probe_inputs import probe_sequences
from treepack.trainer.hf.admission.prove import verify_model
from treepack.trainer.hf.admission.tolerance import MULTIPLE, grad_floor, logprob_floor, shape_noise_limit

from helpers.families import model_support, oracle, window_case
from helpers.precision import broken_mask
from helpers.tolerance import assert_close
from helpers.trainer_cases import plan_of

ms = model_support()
BF16, FP16 = torch.bfloat16, torch.float16
FLASH = {"backend": "flash", "varlen_fn": naive_varlen_attention}
probe_mod = importlib.import_module("treepack.trainer.hf.admission.probe")


def _model(mode: str = "eval", dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    model = ms.build_causal_lm("qwen3").to(dtype)
    model.train(mode != "eval")
    if mode == "train+ckpt":
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model


def _probe(model, autocast=None, **kw):
    with torch.autocast("cpu", dtype=autocast) if autocast is not None else nullcontext():
        return verify_model(model, **kw)


def _broken_ratio(model, autocast=None, **kw) -> float:
    """The broken mask's logprob drift over the noise floor, from the probe's refusal."""
    forget_probes(model)
    with broken_mask(), pytest.raises(UnsupportedModelError, match="noise floor") as e:
        _probe(model, autocast, **kw)
    msg = str(e.value)
    assert e.value.rule == "probe_mismatch" and "first diverging forward output: model.layers.0.self_attn" in msg, msg
    drift, floor = re.search(r"logprobs by (\S+) \(noise floor (\S+),", msg).groups()
    return float(drift) / float(floor)


@pytest.mark.parametrize(
    "backend,mode", [("sdpa", "eval"), ("sdpa", "train"), ("sdpa", "train+ckpt"), ("flash", "eval"), ("flash", "train")]
)
def test_bf16_autocast_is_accepted_within_its_noise_and_a_broken_mask_is_not(backend, mode):
    model = _model(mode)
    kw = FLASH if backend == "flash" else {}
    r = _probe(model, BF16, **kw)
    assert r.noise.compute_dtype == "bfloat16" and r.noise.shapes == ("right-padded",)
    assert r.logprob_tol == pytest.approx(MULTIPLE * r.noise.logprob)
    assert r.logprob_err <= r.logprob_tol and r.grad_err <= 1.0
    assert r.logprob_err > 1e-5, "bf16 rounds: the comparison is not vacuous"
    assert _broken_ratio(model, BF16, **kw) > 10 * MULTIPLE


def test_fp16_autocast_and_bf16_parameters_are_accepted_and_a_broken_mask_is_not():
    model = _model("train")
    r = _probe(model, FP16)
    assert r.noise.compute_dtype == "float16" and r.logprob_err <= r.logprob_tol and r.grad_err <= 1.0
    assert _broken_ratio(model, FP16) > 10 * MULTIPLE
    bf = _model("train", torch.bfloat16)
    r = _probe(bf)
    assert r.noise.compute_dtype == "bfloat16" and r.logprob_err <= r.logprob_tol and r.grad_err <= 1.0
    assert _broken_ratio(bf) > 10 * MULTIPLE


def test_float64_is_accepted_at_the_precision_it_computes_in():
    model = _model("train", torch.float64)
    r = _probe(model)
    # Qwen3's RMSNorm computes in float32: the floor is float32's, the logprobs float64's own.
    assert r.noise.compute_dtype == "float32" and r.logprob_tol < 1e-4
    assert r.logprob_err < 1e-12 and r.grad_err <= 1.0
    assert _broken_ratio(model) > 1000 * MULTIPLE


def test_accelerate_bf16_runs_through_its_wrapper_and_is_refused_with_a_broken_mask():
    accelerate = pytest.importorskip("accelerate")
    from accelerate.state import AcceleratorState

    c = window_case(ms.VOCAB)
    batch = materialize(plan_of(c), c["sequences"], trainable=c["trainable"], groups=c["groups"])
    AcceleratorState._reset_state(True)
    try:
        model = accelerate.Accelerator(cpu=True, mixed_precision="bf16").prepare(_model("train"))
        alone, packed, g_alone, g_packed = oracle(model, batch, c)  # no autocast here: the wrapper's own
        probe = probe_mod._VERIFIED[model]
        report = next(iter(probe.values()))
        assert report.noise.compute_dtype == "bfloat16"
        assert_close("logprobs", alone, packed, atol=report.logprob_tol)
        worst = max(float((g_packed[k] - g).norm() / g.norm()) for k, g in g_alone.items())
        assert 0 < worst <= MULTIPLE * report.noise.grad_rel, (worst, report.noise)
        forget_probes(model)
        with broken_mask(), pytest.raises(UnsupportedModelError, match="beyond 4x the bfloat16 noise floor"):
            packed_forward(model, batch)
    finally:
        AcceleratorState._reset_state(True)


def test_the_probe_runs_through_the_callers_wrapper():
    model = _model("train")
    compiled = torch.compile(model, backend="eager")
    calls = []
    compiled.register_forward_pre_hook(lambda m, a: calls.append(1))
    r = verify_model(compiled)
    assert len(calls) >= 7 + 2 and "OptimizedModule" in r.signature  # every alone run, a shape, the packed run
    assert verify_model(model).signature != r.signature  # the bare model is another setup


def test_llama4_defaults_run_on_short_rows():
    from transformers import Llama4ForCausalLM, Llama4TextConfig

    cfg = Llama4TextConfig(
        vocab_size=ms.VOCAB,
        hidden_size=32,
        intermediate_size=32,
        intermediate_size_mlp=48,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        num_local_experts=2,
        num_experts_per_tok=1,
        interleave_moe_layer_step=2,
    )
    assert cfg.attention_chunk_size == 8192 and cfg.floor_scale == 8192  # the real defaults
    torch.manual_seed(0)
    model = Llama4ForCausalLM(cfg).float().eval()
    seqs, span = probe_sequences(model, row_len=64)
    assert span < max(len(s) for s in seqs) <= 64  # the 8192 chunk never binds in rows of 64
    seqs, span = probe_sequences(model, row_len=24)
    assert span < max(len(s) for s in seqs) == 24  # cut to the rows, still crossing its span
    c = window_case(ms.VOCAB)
    batch = materialize(plan_of(c), c["sequences"], trainable=c["trainable"], groups=c["groups"])
    alone, packed, _, _ = oracle(model, batch, c, grads=False)
    assert_close("logprobs", alone, packed, atol=1e-5)


def test_the_second_shape_is_measured_only_when_the_first_is_not_enough(monkeypatch):
    model = _model("eval")
    assert _probe(model).noise.shapes == ("right-padded",)
    forget_probes(model)
    monkeypatch.setattr(probe_mod, "MULTIPLE", 1e-6)  # nothing passes: both shapes measured, then refused
    with pytest.raises(UnsupportedModelError, match=r"noise measured against right-padded / reordered, 2 batches"):
        _probe(model)


def test_the_noise_model_by_hand():
    eps32 = torch.finfo(torch.float32).eps
    eps16 = torch.finfo(torch.bfloat16).eps
    assert logprob_floor(0.0, 5.0, eps32) == pytest.approx(16 * eps32 * 5.0)  # 16 units of rounding
    assert logprob_floor(0.0, 5.0, eps16) == pytest.approx(2.5e-4 * 5.0)  # capped: bf16 relies on its noise
    assert logprob_floor(3e-3, 5.0, eps16) == 3e-3  # measured noise above the floor is the floor
    floors, rel, noise = grad_floor(torch.tensor([1e-3, 1e-6]), torch.tensor([1.0, 1e-3]), eps16)
    assert noise == pytest.approx(1e-3) and rel == pytest.approx(0.5 * eps16)  # half a bf16 unit
    assert torch.allclose(floors, torch.tensor([rel, rel * 1e-3]))  # relative to each parameter's norm
    _, rel32, _ = grad_floor(torch.tensor([2e-6]), torch.tensor([1.0]), eps32)
    assert rel32 == pytest.approx(256 * eps32)
    assert shape_noise_limit(eps32) == pytest.approx(1024 * eps32) and shape_noise_limit(eps16) == 0.05
