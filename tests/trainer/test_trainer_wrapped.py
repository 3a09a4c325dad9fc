"""PEFT/LoRA and accelerate-prepared models: every output mode, config through the wrapper."""

from __future__ import annotations

import pytest
import torch

from treepack.proto.errors import RequestError
from treepack.trainer import materialize, naive_varlen_attention
from treepack.trainer.hf import packed_forward
from treepack.trainer.hf.head import output_head
from treepack.trainer.hf.wrapped import unwrap_model

from helpers.extras import require
from helpers.tolerance import assert_close
from helpers.trainer_cases import mixed_batch, plan_of, reference_logprobs, tiny_model, trainable_flags

peft = require("peft")


@pytest.fixture(scope="module")
def case():
    c = mixed_batch()
    return c, materialize(plan_of(c), c["sequences"])


def _lora(family="qwen3"):
    base = tiny_model(family)
    cfg = peft.LoraConfig(
        r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj", "down_proj"], init_lora_weights=False
    )
    torch.manual_seed(3)
    return peft.get_peft_model(base, cfg)


def _lora_grads(model):
    out = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return out


def _logprobs(model, batch, output):
    out = packed_forward(model, batch, backend="flash", varlen_fn=naive_varlen_attention, output=output)
    if output == "hidden":
        assert out.shape == (batch.num_rows, batch.seq_len, unwrap_model(model).config.hidden_size)
        return batch.target_logprobs_from_hidden(out, output_head(model), chunk_size=11)
    return batch.target_logprobs(out)


@pytest.mark.parametrize("output", ["logits", "hidden"])
def test_lora_every_output_mode_equals_each_sequence_alone(case, output):
    c, batch = case
    model = _lora()
    assert unwrap_model(model) is model.get_base_model()
    flags = trainable_flags(c)
    ref = reference_logprobs(model, c["sequences"], flags)
    sum(torch.nansum(x) for x in ref).backward()
    want = _lora_grads(model)
    assert want and all("lora_" in n for n in want)  # only the adapters train
    lp = _logprobs(model, batch, output)
    lp.sum().backward()
    assert_close("logprobs", ref, batch.unpack_logprobs(lp.detach()), atol=1e-5)
    assert_close("lora grads", want, _lora_grads(model), ratio=1e-4, nonzero_ref=True)
    with torch.no_grad():  # the adapted model still generates unpacked
        model.generate(input_ids=torch.tensor([[4, 5, 6]]), max_new_tokens=3, do_sample=False, pad_token_id=0)


def test_accelerate_prepared_model(case):
    accelerate = require("accelerate")
    _, batch = case
    bare = tiny_model("qwen3")
    want = packed_forward(bare, batch).detach()
    prepared = accelerate.Accelerator(cpu=True).prepare(tiny_model("qwen3"))
    got = packed_forward(prepared, batch)
    assert torch.equal(want, got.detach())
    hidden = packed_forward(prepared, batch, output="hidden")
    assert_close(
        "hidden head",
        batch.target_logprobs(want),
        batch.target_logprobs_from_hidden(hidden, output_head(prepared)),
        atol=1e-6,
    )


def test_compiled_wrapper_unwraps(case):
    model = tiny_model("llama")
    compiled = torch.compile(model, backend="eager")
    assert unwrap_model(compiled) is model
    assert unwrap_model(torch.nn.DataParallel(model)) is model


def _reordered(c, order):
    return dict(c, **{k: [c[k][i] for i in order] for k in ("sequences", "trainable", "groups")})


# Slow (about 40 s on 2 CPU cores): inductor compiles the model's graphs to C++; the crash it
# guards against happened only under inductor, not under the eager or aot_eager backends.
@pytest.mark.slow
def test_inductor_compiled_model_on_flash_runs_tree_after_tree_exact():
    """``torch.compile(model)`` (inductor) with ``backend="flash"``: the varlen path runs eager
    inside the compiled model, so a second tree of the same row shape (data-dependent gather
    sizes) neither recompiles it with symbolic sizes (inductor used to fail there with
    ``Exponent must be non-negative``) nor reuses the first tree's metadata."""
    from treepack.trainer.kernels.varlen import varlen_attention

    model = tiny_model("qwen3")
    compiled = torch.compile(model)  # inductor
    first = mixed_batch()
    second = _reordered(first, [3, 0, 1, 2, 4, 10, 11, 5, 6, 7, 8, 9])
    batches = [materialize(plan_of(c), c["sequences"]) for c in (first, second)]
    assert batches[0].input_ids.shape == batches[1].input_ids.shape  # the same row shape ...
    assert not torch.equal(batches[0].subtree_end, batches[1].subtree_end)  # ... another tree
    for c, batch in zip((first, second, first), batches + batches[:1]):
        with torch.no_grad():
            ref = reference_logprobs(model, c["sequences"], trainable_flags(c))
            lp = batch.target_logprobs(packed_forward(compiled, batch, backend="flash", varlen_fn=varlen_attention))
        assert_close("compiled flash logprobs", ref, batch.unpack_logprobs(lp), atol=1e-5)


def test_not_a_model_refused():
    with pytest.raises(RequestError, match="holds no HF model"):
        unwrap_model(torch.nn.Linear(2, 2))
