"""The oracle on vision-language models: packed rows with images == each sequence alone.

Trees: a group of completions sharing an image prompt, a prompt with two images (one of
them wide, so mRoPE's height and width differ), two groups whose prompts have identical
token ids (the same placeholder run) but different images, and a text-only sequence. The
same image also recurs in a second group, so one tower output feeds several places.
Logprobs within 1e-5, gradients of every parameter (vision tower included) within 1e-4
relative (floored at fp32 rounding of the largest gradient); the vision tower runs once
per distinct image.
"""

from __future__ import annotations

import contextlib
import functools

import numpy as np
import pytest
import torch

from treepack.service.planner import plan_batch, validate_plan
from treepack.trainer import image_keys, materialize, naive_varlen_attention
from treepack.trainer.data.payloads import PayloadMismatchError
from treepack.trainer.hf import packed_forward, vision_savings

from helpers.tolerance import assert_close, assert_not_close
from helpers.vlm import FAMILIES, IMAGE_TOKEN, image, image_run, join_images, reference_forward, text, tiny_vlm

LOGPROB_TOL = 1e-5
GRAD_RTOL = 1e-4
SEQ_LEN = 160


def vlm_case(family: str) -> dict:
    """Sequences, trainable prompt lengths, per-sequence image inputs and loss weights."""
    rng = np.random.default_rng(3)
    A, B, D, E = (image(family, s) for s in (1, 2, 4, 5))
    C = (
        image(family, 3)
        if family == "llava"
        else image(family, 3, size=4)
        | dict(
            pixel_values=torch.randn(32, 24, generator=torch.Generator().manual_seed(3)),
            image_grid_thw=torch.tensor([[1, 4, 8]]),
            n_tokens=8,
        )
    )
    seqs, prompts, imgs = [], [], []

    def group(prompt: list[int], prompt_imgs: list[dict], n: int) -> None:
        for _ in range(n):
            seqs.append(np.array(prompt + text(rng, int(rng.integers(3, 7))), dtype=np.int64))
            prompts.append(len(prompt))
            imgs.append(prompt_imgs)

    group(text(rng, 6) + image_run(family, A["n_tokens"]) + text(rng, 5), [A], 2)
    group(
        text(rng, 3)
        + image_run(family, B["n_tokens"])
        + text(rng, 2)
        + image_run(family, C["n_tokens"])
        + text(rng, 4),
        [B, C],
        2,
    )
    same_ids = text(rng, 5) + image_run(family, D["n_tokens"]) + text(rng, 3)
    group(same_ids, [D], 1)
    group(same_ids, [E], 1)
    group(text(rng, 4) + image_run(family, A["n_tokens"]) + text(rng, 2), [A], 1)  # image A again, another prompt
    group(text(rng, 9), [], 1)
    pv, thw = zip(*(join_images(i) for i in imgs))
    weights = torch.linspace(0.5, 1.5, len(seqs))
    return dict(
        family=family,
        sequences=seqs,
        trainable=prompts,
        pixel_values=list(pv),
        image_grid_thw=list(thw),
        weights=weights,
        distinct=5,
        same_ids=(4, 5),
    )


@functools.cache
def reference_run(family: str) -> tuple[dict, torch.nn.Module, list[torch.Tensor], dict, int]:
    """(case, model, alone logprobs, alone grads, tower calls alone) of ``family``, built once."""
    case, model = vlm_case(family), tiny_vlm(family)
    with count_tower_calls(model) as calls:
        lp, grads = reference(model, case)
    return case, model, lp, grads, len(calls)


@contextlib.contextmanager
def count_tower_calls(model: torch.nn.Module):
    """A list that gets one entry per call of the model's vision tower while the block runs."""
    base = model.model
    tower = base.visual if hasattr(base, "visual") else base.vision_tower
    calls: list[int] = []
    handle = tower.register_forward_pre_hook(lambda *a: calls.append(1))
    try:
        yield calls
    finally:
        handle.remove()


def plan_of(case: dict, keyed: bool = True):
    keys = (
        image_keys(
            case["sequences"],
            pixel_values=case["pixel_values"],
            image_grid_thw=case["image_grid_thw"],
            image_token_id=IMAGE_TOKEN,
        )
        if keyed
        else None
    )
    plan = plan_batch(case["sequences"], seq_len=SEQ_LEN, trainable=case["trainable"], keys=keys, min_shared_len=4)
    validate_plan(plan, case["sequences"], trainable=case["trainable"])
    return plan


def flags(case: dict) -> list[torch.Tensor]:
    out = []
    for s, p in zip(case["sequences"], case["trainable"]):
        f = torch.zeros(len(s), dtype=torch.bool)
        f[p:] = True
        out.append(f)
    return out


def _grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    out = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return out


def _loss(per_seq: list[torch.Tensor], weights: torch.Tensor) -> torch.Tensor:
    return sum(w * torch.nansum(lp) for w, lp in zip(weights, per_seq))


def reference(model: torch.nn.Module, case: dict) -> tuple[list[torch.Tensor], dict]:
    lps = []
    for s, f, pv, thw in zip(case["sequences"], flags(case), case["pixel_values"], case["image_grid_thw"]):
        logits = reference_forward(model, s, pv, thw)
        x = torch.as_tensor(s)
        lp = torch.cat(
            [logits.new_full((1,), float("nan")), torch.log_softmax(logits[:-1], -1).gather(1, x[1:, None]).squeeze(1)]
        )
        keep = f.clone()
        keep[0] = False
        lps.append(torch.where(keep, lp, torch.full_like(lp, float("nan"))))
    _loss(lps, case["weights"]).backward()
    return [x.detach() for x in lps], _grads(model)


def packed(model: torch.nn.Module, case: dict, plan, **kw) -> tuple[list[torch.Tensor], dict, object]:
    batch = materialize(
        plan,
        case["sequences"],
        trainable=case["trainable"],
        pixel_values=kw.pop("pixel_values", case["pixel_values"]),
        image_grid_thw=case["image_grid_thw"],
        advise=False,
    )
    logits = packed_forward(model, batch, **kw)
    lps = batch.unpack_logprobs(batch.target_logprobs(logits))
    _loss(lps, case["weights"]).backward()
    return [x.detach() for x in lps], _grads(model), batch


@pytest.mark.parametrize("family", FAMILIES)
def test_vlm_oracle_logprobs_and_gradients(family):
    case, model, ref_lp, ref_grads, n_ref_calls = reference_run(family)
    # The probe (text only) runs for one family; the others skip it, the oracle here is the proof.
    with count_tower_calls(model) as calls:
        lp, grads, batch = packed(model, case, plan_of(case), verify=family == "qwen2_5_vl")
    assert_close("logprobs", ref_lp, lp, atol=LOGPROB_TOL)
    tower_grads = [
        n for n in ref_grads if n.startswith(("model.visual", "model.vision_tower", "model.multi_modal_projector"))
    ]
    assert tower_grads and set(ref_grads) == set(grads)
    # 1e-4 relative per parameter, with the floor the family sweep uses: fp32 rounding of the
    # largest gradient (GDN's A_log / dt_bias gradients are 1e-5 of the others).
    floor = 1e-7 * max(float(g.abs().max()) for g in ref_grads.values())
    assert_close("grad", ref_grads, grads, atol=floor, ratio=GRAD_RTOL, nonzero_ref=True)
    # One tower call per distinct image; the unpacked runs called it once per sequence with images.
    assert len(calls) == case["distinct"] == batch.images.num_distinct
    assert n_ref_calls == sum(1 for pv in case["pixel_values"] if pv is not None) == 7
    if family == "qwen2_5_vl":  # the varlen path (its CPU reference kernel) too
        lp, grads, _ = packed(
            model, case, plan_of(case), verify=False, backend="flash", varlen_fn=naive_varlen_attention
        )
        assert_close("flash logprobs", ref_lp, lp, atol=LOGPROB_TOL)
        assert_close("flash grad", ref_grads, grads, atol=floor, ratio=GRAD_RTOL, nonzero_ref=True)
    saved = vision_savings(batch, IMAGE_TOKEN)
    assert saved.images == 9 and saved.distinct_images == 5 and saved.tower_calls_saved == 4
    assert (
        saved.vision_tokens_shared > 0
        and saved.vision_tokens == saved.vision_tokens_packed + saved.vision_tokens_shared
    )


@pytest.mark.parametrize("family", ["qwen2_5_vl", "llava"])
def test_identical_placeholders_different_images_never_shared(family):
    case, model = vlm_case(family), tiny_vlm(family)
    keyed, plain = plan_of(case), plan_of(case, keyed=False)
    # Without keys the two groups' identical placeholder runs share (fewer tree tokens) ...
    assert plain.stats.tree_tokens < keyed.stats.tree_tokens
    # ... and the packed forward refuses them before the tower runs.
    with count_tower_calls(model) as calls, pytest.raises(PayloadMismatchError, match="image_keys") as err:
        packed(model, case, plain, verify=False)
    assert set(err.value.sequences) == set(case["same_ids"])
    assert calls == []


def test_wrong_image_fails_the_oracle():
    """Negative control: the images reach the logits, so a batch given another image differs."""
    case, model, ref_lp, _, _ = reference_run("qwen2_5_vl")
    a, b = case["same_ids"]
    swapped = list(case["pixel_values"])
    swapped[b] = swapped[a]  # the second group gets the first one's image (same grid)
    lp, _, _ = packed(model, case, plan_of(case), pixel_values=swapped, verify=False)
    assert_close("untouched sequences", ref_lp[:b], lp[:b], atol=LOGPROB_TOL)
    assert_not_close("swapped image", ref_lp[b], lp[b], atol=1e-3)
