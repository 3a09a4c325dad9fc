"""``trl.SFTTrainer`` and ``TreepackSFTTrainer`` side by side on a tiny Qwen2-VL with image samples.

TRL's own vision collator (a Qwen2-VL processor built in code, an ``image`` column,
prompt/completion samples, :func:`helpers.tiny_trl.vl_sft_dataset`): three samples share
one image and one prompt and differ in their completions, three hold the same prompt ids over
two other images, one holds the first image under another text. Same seed, same data, 2
SGD steps: per-step loss and grad_norm within 1e-5 relative, every parameter's gradient at every
step (vision tower included) within 1e-4 relative. The plan shared the common prompt, and
the image tokens exactly once per distinct image (never across different images).
Dropping the packed forward's 3-D positions moves every parameter's gradient by over 100%
of its largest entry (while the loss moves by 2e-6 only: the gradients are the oracle here).
The same samples as conversations (TRL's language-modeling collator: labels on every token,
image placeholders included) are exact too; nothing is shared there (every token is trained).
Negative control: planned without image keys, the identical-id prompts would share their
image tokens; the packed forward refuses that before computing anything.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

from helpers.extras import require

trl = require("trl")
require("PIL")

from transformers import TrainerCallback  # noqa: E402

from treepack.proto.errors import RequestError, TreepackWarning  # noqa: E402
from treepack.service.planner import validate_plan  # noqa: E402
from treepack.trainer.data.payloads import PayloadMismatchError  # noqa: E402
from treepack.trainer.hf import vision_savings  # noqa: E402
from treepack.trainer.trl import PackingConfig, TreepackSFTTrainer  # noqa: E402

from helpers.tiny_trl import run_sft, tiny_vl_processor, vl_sft_dataset  # noqa: E402
from helpers.tolerance import assert_close  # noqa: E402
from helpers.vlm import IMAGE_TOKEN, tiny_vlm  # noqa: E402

TOL = dict(rel=1e-5, abs=1e-7)
GRAD_RTOL = 1e-4
STEPS = 2


class _Grads(TrainerCallback):
    """Every parameter's gradient just before each optimizer step."""

    def __init__(self) -> None:
        self.steps: list[dict[str, torch.Tensor]] = []

    def on_pre_optimizer_step(self, args, state, control, model=None, **kw):
        self.steps.append({n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None})


class _Recording(TreepackSFTTrainer):
    """Keeps each packed batch's plan and image savings."""

    def _packed_fused(self, model, batch):
        validate_plan(batch.plan)
        self.seen = [*getattr(self, "seen", []), (batch.plan, vision_savings(batch, IMAGE_TOKEN))]
        return super()._packed_fused(model, batch)


def _run(cls, tmp_path, name, steps=STEPS, messages=False, **kw):
    grads = _Grads()
    out = run_sft(
        cls,
        workdir=str(tmp_path / name),
        steps=steps,
        model=tiny_vlm("qwen2_vl"),
        train_dataset=vl_sft_dataset(messages=messages),
        processing_class=tiny_vl_processor(),
        callbacks=[grads],
        per_device_train_batch_size=7,
        max_length=None,
        # SGD: step 2's gradients compare models that differ only by step 1's fp32 noise (Adam would amplify it).
        optim="sgd",
        **kw,
    )
    return out | {"grads": grads.steps}


@pytest.mark.parametrize("messages", [False, True], ids=["prompt_completion", "messages"])
def test_vlm_sft_matches_stock(tmp_path, messages):
    stock = _run(trl.SFTTrainer, tmp_path, "stock", messages=messages)
    # The probe (verify) on VLMs is proven by the VLM oracle tests; off here to keep this test short.
    # Every token trained (messages): nothing to share, and treepack says so.
    with pytest.warns(TreepackWarning, match="shares no token") if messages else contextlib.nullcontext():
        packed = _run(
            _Recording, tmp_path, "packed", messages=messages, trainer_kwargs={"packing": PackingConfig(verify=False)}
        )
    assert len(stock["loss"]) == STEPS and len(stock["grads"]) == STEPS
    assert packed["loss"] == pytest.approx(stock["loss"], **TOL)
    assert packed["grad_norm"] == pytest.approx(stock["grad_norm"], **TOL)
    for step, (ref, got) in enumerate(zip(stock["grads"], packed["grads"])):
        assert any(n.startswith("model.visual") for n in ref)  # the vision tower is compared too
        floor = 1e-7 * max(float(g.abs().max()) for g in ref.values())
        assert_close(f"step {step} grad", ref, got, atol=floor, ratio=GRAD_RTOL, nonzero_ref=True)
    seen = packed["trainer"].seen
    assert len(seen) == STEPS
    for plan, vs in seen:
        # The vision tower runs once per distinct image either way.
        assert (vs.images, vs.distinct_images, vs.vision_tokens) == (7, 3, 7 * 16)
        if messages:
            # Every token carries a label (placeholders too): nothing is shared, still exact.
            assert vs.vision_tokens_packed == 7 * 16
            continue
        assert plan.stats.saved_fraction > 0.3, plan.stats  # the shared prompt was held once: not a trivial comparison
        # 7 samples over 3 distinct images of 16 placeholder tokens each: every image's tokens
        # sit in the rows exactly once, so no two different images shared a position.
        assert vs.vision_tokens_packed == 3 * 16


def test_without_image_keys_identical_placeholders_over_different_images_are_refused(tmp_path, monkeypatch):
    import numpy as np

    from treepack.trainer.trl import step as treepack_trl

    # Every placeholder keyed 0: the planner sees token ids only and shares the identical-id prompts.
    monkeypatch.setattr(
        treepack_trl, "image_keys", lambda seqs, **kw: [np.zeros(len(s), dtype=np.uint64) for s in seqs]
    )
    with pytest.raises(PayloadMismatchError, match="different images behind identical placeholder tokens"):
        _run(TreepackSFTTrainer, tmp_path, "unkeyed", steps=1, trainer_kwargs={"packing": PackingConfig(verify=False)})


def test_sft_refuses_other_model_inputs_by_name(tmp_path):
    trainer = _run(
        TreepackSFTTrainer, tmp_path, "one", steps=1, trainer_kwargs={"packing": PackingConfig(verify=False)}
    )["trainer"]
    batch = trainer.data_collator([dict(r) for r in vl_sft_dataset().select(range(2))])
    for name, value in (
        ("image_sizes", torch.tensor([[16, 16], [16, 16]])),
        ("token_type_ids", torch.zeros_like(batch["input_ids"])),
        ("output_router_logits", True),
    ):
        with pytest.raises(RequestError, match=name) as e:
            trainer._sft_forward(trainer.model, fused_lm_head=True, **batch, **{name: value})
        assert e.value.path == f"$.{name}"
    # A model whose processor gives no image_grid_thw (LLaVA-style): refused naming the model.
    text_only = {k: batch[k] for k in ("input_ids", "attention_mask", "labels")}
    with pytest.raises(RequestError, match="LlavaForConditionalGeneration's images come without image_grid_thw") as e:
        trainer._sft_forward(tiny_vlm("llava"), fused_lm_head=True, pixel_values=torch.zeros(2, 3, 8, 8), **text_only)
    assert e.value.path == "$.image_grid_thw"
