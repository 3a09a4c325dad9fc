"""``trl.GRPOTrainer`` and ``TreepackGRPOTrainer`` side by side on a tiny Qwen2-VL with image prompts.

TRL's own multimodal path: a Qwen2-VL processor built in code (:func:`helpers.tiny_trl.tiny_vl_processor`),
a dataset with an ``image`` column whose prompts include three with identical text over three
different images (identical token ids, different images) and one image under two texts; the
tiny model generates the completions. Same seed, same data: per-step loss and grad_norm
agree within 1e-5 relative, completions and rewards are identical. Negative control: planned
without image keys, the identical-id prompts would share their image tokens; the packed
forward refuses that before computing anything. :func:`sequence_images` is checked against
the processor called on each prompt alone.
"""

from __future__ import annotations

import pytest
import torch

from helpers.extras import require

trl = require("trl")
require("PIL")

from treepack.proto.errors import RequestError  # noqa: E402
from treepack.trainer.data.payloads import PayloadMismatchError  # noqa: E402
from treepack.trainer.planning.padded_images import sequence_images  # noqa: E402
from treepack.trainer.trl import PackingConfig, TreepackGRPOTrainer  # noqa: E402

from helpers.tiny_trl import run_grpo, tiny_vl_processor, vl_dataset  # noqa: E402
from helpers.vlm import IMAGE_TOKEN, VIDEO_TOKEN, VISION_END, VISION_START, tiny_vlm  # noqa: E402

TOL = dict(rel=1e-5, abs=1e-7)
# Completions must not hold vision tokens: a generated placeholder has no image behind it.
NO_VISION = {"suppress_tokens": [IMAGE_TOKEN, VISION_START, VISION_END, VIDEO_TOKEN]}


def _run(cls, tmp_path, name, steps=3, **kw):
    model = tmp_path / "init"
    if not model.exists():
        tiny_vlm("qwen2_vl").save_pretrained(model)
    return run_grpo(
        cls,
        workdir=str(tmp_path / name),
        steps=steps,
        model_path=str(model),
        train_dataset=vl_dataset(),
        processing_class=tiny_vl_processor(),
        generation_kwargs=NO_VISION,
        beta=0.05,
        **kw,
    )


def test_vlm_grpo_matches_stock_per_step(tmp_path):
    stock = _run(trl.GRPOTrainer, tmp_path, "stock")
    # The probe (verify) on VLMs is proven by the VLM oracle tests; off here to keep this test short.
    packed = _run(TreepackGRPOTrainer, tmp_path, "packed", trainer_kwargs={"packing": PackingConfig(verify=False)})
    assert len(stock["loss"]) == 3
    assert packed["completions"] == stock["completions"]
    assert packed["rewards"] == stock["rewards"]
    assert packed["loss"] == pytest.approx(stock["loss"], **TOL)
    assert packed["grad_norm"] == pytest.approx(stock["grad_norm"], **TOL)
    kl = [[h["kl"] for h in r["logs"] if "kl" in h] for r in (stock, packed)]
    assert kl[1] == pytest.approx(kl[0], **TOL) and max(kl[0]) > 0  # reference logprobs through the tree too
    saved = [h["treepack/saved_fraction"] for h in packed["logs"] if "treepack/saved_fraction" in h]
    assert len(saved) == 3 and min(saved) > 0.2, saved  # the image prompts were shared: not a trivial comparison


def test_without_image_keys_identical_placeholders_over_different_images_are_refused(tmp_path, monkeypatch):
    import numpy as np

    from treepack.trainer.trl import step as treepack_trl

    # Every placeholder keyed 0: the planner sees token ids only and shares the identical-id prompts.
    monkeypatch.setattr(
        treepack_trl, "image_keys", lambda seqs, **kw: [np.zeros(len(s), dtype=np.uint64) for s in seqs]
    )
    with pytest.raises(PayloadMismatchError, match="different images behind identical placeholder tokens"):
        _run(TreepackGRPOTrainer, tmp_path, "unkeyed", steps=1, trainer_kwargs={"packing": PackingConfig(verify=False)})


def _processed(prompts_and_images):
    from trl.data_utils import prepare_multimodal_messages

    proc = tiny_vl_processor()
    texts = [
        proc.apply_chat_template(prepare_multimodal_messages(p, images=[i]), add_generation_prompt=True, tokenize=False)
        for p, i in prompts_and_images
    ]
    images = [i for _, i in prompts_and_images]
    return proc, texts, images


def test_sequence_images_give_each_sequence_what_its_processor_gives_it_alone():
    ds = vl_dataset()
    proc, texts, images = _processed([(r["prompt"], r["image"]) for r in ds])
    # A text-only prompt in the batch: TRL's image list holds [] for it.
    texts.insert(1, "w5 w6 w7 w0")
    per_seq = [[images[0]], [], *[[i] for i in images[1:]]]
    batch = proc(images=per_seq, text=texts, padding=True, return_tensors="pt")
    ids, mask = batch["input_ids"], batch["attention_mask"]
    pv, thw = sequence_images(
        ids,
        mask,
        image_token_id=IMAGE_TOKEN,
        pixel_values=batch["pixel_values"],
        image_grid_thw=batch["image_grid_thw"],
        num_images=[len(i) for i in per_seq],
        mm_token_type_ids=batch["mm_token_type_ids"],
    )
    assert pv[1] is None and thw[1] is None
    # SFT's collator gives no num_images: read from the placeholders, the same cut.
    pv2, thw2 = sequence_images(
        ids,
        mask,
        image_token_id=IMAGE_TOKEN,
        pixel_values=batch["pixel_values"],
        image_grid_thw=batch["image_grid_thw"],
    )
    assert [None if x is None else x.tolist() for x in thw2] == [None if x is None else x.tolist() for x in thw]
    assert all((a is None and b is None) or torch.equal(a, b) for a, b in zip(pv, pv2))
    for s, (text, imgs) in enumerate(zip(texts, per_seq)):
        if not imgs:
            continue
        alone = proc(images=imgs, text=[text], return_tensors="pt")
        assert torch.equal(pv[s], alone["pixel_values"]) and torch.equal(thw[s], alone["image_grid_thw"]), s
    assert not torch.equal(pv[0], pv[2])  # distinct images: the comparison can tell them apart


def test_sequence_images_refuse_what_tree_rows_do_not_take():
    ids = torch.tensor([[5, IMAGE_TOKEN, 6]])
    mask = torch.ones_like(ids)
    pv, grid = torch.zeros(4, 24), torch.tensor([[1, 2, 2]])
    with pytest.raises(RequestError, match="image_sizes") as e:
        sequence_images(
            ids, mask, image_token_id=IMAGE_TOKEN, pixel_values=pv, image_sizes=torch.tensor([[8, 8]]), num_images=[1]
        )
    assert e.value.path == "$.image_sizes"
    with pytest.raises(RequestError, match="without image_grid_thw"):
        sequence_images(ids, mask, image_token_id=IMAGE_TOKEN, pixel_values=pv, num_images=[1])
    with pytest.raises(RequestError, match="video"):
        sequence_images(
            ids,
            mask,
            image_token_id=IMAGE_TOKEN,
            pixel_values=pv,
            image_grid_thw=grid,
            num_images=[1],
            mm_token_type_ids=torch.tensor([[0, 2, 0]]),
        )
    with pytest.raises(RequestError, match="other positions"):
        sequence_images(
            ids,
            mask,
            image_token_id=IMAGE_TOKEN,
            pixel_values=pv,
            image_grid_thw=grid,
            num_images=[1],
            mm_token_type_ids=torch.tensor([[1, 1, 0]]),
        )
    with pytest.raises(RequestError, match="num_images"):
        sequence_images(ids, mask, image_token_id=IMAGE_TOKEN, pixel_values=pv, image_grid_thw=grid, num_images=[2])
    assert sequence_images(ids, mask, image_token_id=IMAGE_TOKEN, pixel_values=pv, image_grid_thw=grid, num_images=[1])[
        1
    ][0].tolist() == [[1, 2, 2]]
    # Without num_images: rows whose placeholders do not cover whole images (a cut image) are refused.
    two = torch.tensor([[5, IMAGE_TOKEN, IMAGE_TOKEN, 6], [5, IMAGE_TOKEN, 6, 7]])
    pv2, grids = torch.zeros(12, 24), torch.tensor([[1, 2, 2], [1, 2, 2], [1, 2, 2]])
    assert [
        len(g)
        for g in sequence_images(
            two, torch.ones_like(two), image_token_id=IMAGE_TOKEN, pixel_values=pv2, image_grid_thw=grids
        )[1]
    ] == [2, 1]
    with pytest.raises(RequestError, match=r"row 0's image placeholder tokens do not cover whole images"):
        sequence_images(
            two,
            torch.ones_like(two),
            image_token_id=IMAGE_TOKEN,
            pixel_values=pv2,
            image_grid_thw=torch.tensor([[1, 2, 2], [1, 2, 4]]),
        )
    with pytest.raises(RequestError, match="do not split over 3 images"):
        sequence_images(
            two[:1], torch.ones_like(two[:1]), image_token_id=IMAGE_TOKEN, pixel_values=pv2, image_grid_thw=grids
        )
