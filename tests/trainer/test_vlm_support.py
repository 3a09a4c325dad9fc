"""What check_model and the packed forward accept and refuse for VLMs, and mRoPE positions."""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch

from treepack.proto.errors import RequestError, UnsupportedModelError
from treepack.service.planner import plan_batch, validate_plan
from treepack.trainer import check_model, image_keys, materialize
from treepack.trainer.hf import packed_forward
from treepack.trainer.hf.vision import image_inputs

from helpers.vlm import IMAGE_TOKEN, image, image_run, join_images, text, tiny_vlm


@functools.cache
def model(family: str) -> torch.nn.Module:
    return tiny_vlm(family)


def _batch(family: str, seqs, imgs, trainable, **kw):
    pv, thw = zip(*(join_images(i) for i in imgs))
    keys = image_keys(seqs, pixel_values=list(pv), image_grid_thw=list(thw), image_token_id=IMAGE_TOKEN)
    plan = plan_batch(seqs, seq_len=128, trainable=trainable, keys=keys, min_shared_len=4)
    validate_plan(plan, seqs, trainable=trainable, keys=keys)
    return materialize(
        plan, seqs, trainable=trainable, pixel_values=list(pv), image_grid_thw=list(thw), advise=False, **kw
    )


@pytest.mark.parametrize("family", ["qwen2_5_vl", "llava"])
def test_known_towers_are_per_image(family):
    m = model(family)
    report = check_model(m)
    path = "model.visual" if family == "qwen2_5_vl" else "model.vision_tower"
    assert report.handled[path].startswith("vision_tower:")
    assert not any(p.startswith(path + ".") for p in report.handled)


def test_unknown_towers_and_gemma3_are_refused():
    import transformers as tf

    text_cfg = tf.LlamaConfig(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4
    )
    dino = tf.Dinov2Config(
        hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4, image_size=8, patch_size=2
    )
    llava_dino = tf.LlavaForConditionalGeneration(
        tf.LlavaConfig(vision_config=dino, text_config=text_cfg, image_token_id=IMAGE_TOKEN)
    )
    with pytest.raises(UnsupportedModelError) as e:
        check_model(llava_dino)
    reasons = {(p, c): r for p, c, r in e.value.refusals}
    assert any(p.startswith("model.vision_tower.") and "Conv2d" in r for (p, _), r in reasons.items())
    assert any("bidirectional attention" in r for r in reasons.values())

    siglip = tf.SiglipVisionConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4, image_size=8, patch_size=2
    )
    gemma = tf.Gemma3TextConfig(
        vocab_size=128,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
    )
    g3 = tf.Gemma3ForConditionalGeneration(
        tf.Gemma3Config(
            text_config=gemma,
            vision_config=siglip,
            mm_tokens_per_image=4,
            image_token_index=IMAGE_TOKEN,
            boi_token_index=101,
            eoi_token_index=102,
        )
    )
    with pytest.raises(UnsupportedModelError) as e:
        check_model(g3)
    assert ("model", "Gemma3Model") in {(p, c) for p, c, _ in e.value.refusals}
    assert "Gemma 3's image tokens attend to each other bidirectionally" in str(e.value)


def _two_groups(family: str):
    rng = np.random.default_rng(0)
    A, W = (
        image(family, 1),
        dict(pixel_values=torch.randn(32, 24), image_grid_thw=torch.tensor([[1, 4, 8]]), n_tokens=8),
    )
    p1 = (
        text(rng, 5) + image_run(family, A["n_tokens"]) + text(rng, 3) + image_run(family, W["n_tokens"]) + text(rng, 4)
    )
    p2 = text(rng, 6) + image_run(family, W["n_tokens"]) + text(rng, 2)
    seqs = [np.array(p + text(rng, 4)) for p in (p1, p1, p2)] + [np.array(text(rng, 7))]
    return seqs, [[A, W], [A, W], [W], []], [len(p1), len(p1), len(p2), 3]


def test_mrope_positions_are_each_sequences_own():
    m = model("qwen2_5_vl")
    seqs, imgs, trainable = _two_groups("qwen2_5_vl")
    batch = _batch("qwen2_5_vl", seqs, imgs, trainable)
    pos = image_inputs(m, batch, {})["position_ids"]
    assert pos.shape == (3, batch.num_rows, batch.seq_len)
    for s, (seq, im) in enumerate(zip(seqs, imgs)):
        row, idx = batch.locate(s)
        ids = torch.as_tensor(seq)[None]
        _, thw = join_images(im)
        want = (
            m.model.get_rope_index(ids, mm_token_type_ids=(ids == IMAGE_TOKEN).int(), image_grid_thw=thw)[0][:, 0]
            if im
            else torch.arange(len(seq)).expand(3, -1)
        )
        assert torch.equal(pos[:, row, idx], want), s
    # The wide image gives height and width positions that differ from the text positions.
    row, idx = batch.locate(2)
    assert not torch.equal(pos[1, row, idx], pos[2, row, idx]) and not torch.equal(
        pos[0, row, idx], batch.position_ids[row, idx]
    )


def test_video_and_row_level_image_arguments_are_refused():
    m = model("qwen2_5_vl")
    seqs, imgs, trainable = _two_groups("qwen2_5_vl")
    with pytest.raises(RequestError, match="video inputs are not supported"):
        _batch("qwen2_5_vl", seqs, imgs, trainable, pixel_values_videos=[None] * 4)
    batch = _batch("qwen2_5_vl", seqs, imgs, trainable)
    for kw in ("pixel_values_videos", "pixel_values", "mm_token_type_ids"):
        with pytest.raises(RequestError, match=f"{kw} passed to the packed forward"):
            packed_forward(m, batch, verify=False, **{kw: torch.zeros(1)})


def test_placeholders_that_do_not_match_the_tower_are_refused():
    """One image: image_keys cannot tell its token count; the forward checks it against the tower."""
    m = model("qwen2_5_vl")
    rng = np.random.default_rng(5)
    A = image("qwen2_5_vl", 1)
    seqs = [np.array(text(rng, 3) + image_run("qwen2_5_vl", 5) + text(rng, 4))]
    batch = _batch("qwen2_5_vl", seqs, [[A]], [10])
    with pytest.raises(RequestError, match="gives distinct image 0 4 features, the text holds 5 placeholder tokens"):
        packed_forward(m, batch, verify=False)
