"""image_keys: placeholder tokens keyed by their image's content, text tokens 0; the keys are
the planner's per-token keys (embedded and sidecar plans alike)."""

from __future__ import annotations

import httpx
import numpy as np
import pytest
import torch

from treepack.client import AsyncPacker, Packer
from treepack.proto.errors import RequestError
from treepack.service import Settings, create_app
from treepack.service.planner import plan_batch, validate_plan
from treepack.trainer import image_keys

from helpers.service import assert_same_plan
from helpers.vlm import IMAGE_TOKEN, image, image_run, join_images, text


def _seq(rng, family, imgs, pre=4, mid=2, post=3):
    out = text(rng, pre)
    for i in imgs:
        out += image_run(family, i["n_tokens"]) + text(rng, mid)
    return np.array(out + text(rng, post), dtype=np.int64)


def test_keys_follow_image_content_not_token_ids():
    rng = np.random.default_rng(0)
    A, A2, B = image("qwen2_5_vl", 1), image("qwen2_5_vl", 1), image("qwen2_5_vl", 2)
    s = _seq(rng, "qwen2_5_vl", [A])
    seqs = [s, s.copy(), s.copy()]
    pv, thw = zip(*(join_images([i]) for i in (A, A2, B)))
    k = image_keys(seqs, pixel_values=list(pv), image_grid_thw=list(thw), image_token_id=IMAGE_TOKEN)
    ph = seqs[0] == IMAGE_TOKEN
    assert ph.sum() == A["n_tokens"]
    assert (k[0][~ph] == 0).all() and (k[0][ph] != 0).all()
    assert np.array_equal(k[0], k[1])  # the same pixels (another tensor) -> the same keys
    assert (k[0][ph] != k[2][ph]).all() and np.array_equal(k[0][~ph], k[2][~ph])
    assert len(set(k[0][ph].tolist())) == ph.sum()  # each token of an image its own key


def test_two_images_split_by_their_patch_counts():
    """A prompt with a 4x4 and a 4x8 image: 4 and 8 placeholder tokens; the second image's keys
    do not depend on the first."""
    rng = np.random.default_rng(1)
    A = image("qwen2_5_vl", 1)
    W = dict(pixel_values=torch.randn(32, 24), image_grid_thw=torch.tensor([[1, 4, 8]]), n_tokens=8)
    B = image("qwen2_5_vl", 2)
    s1, s2 = _seq(rng, "qwen2_5_vl", [A, W]), _seq(rng, "qwen2_5_vl", [B, W])
    pv, thw = zip(join_images([A, W]), join_images([B, W]))
    k1, k2 = image_keys([s1, s2], pixel_values=list(pv), image_grid_thw=list(thw), image_token_id=IMAGE_TOKEN)
    p1, p2 = np.flatnonzero(s1 == IMAGE_TOKEN), np.flatnonzero(s2 == IMAGE_TOKEN)
    assert np.array_equal(k1[p1[4:]], k2[p2[4:]]) and not np.array_equal(k1[p1[:4]], k2[p2[:4]])


def test_llava_images_take_equal_shares():
    rng = np.random.default_rng(2)
    A, B = image("llava", 1), image("llava", 2)
    s = _seq(rng, "llava", [A, B])
    pv, _ = join_images([A, B])
    pv_swapped, _ = join_images([B, A])
    k, ks = image_keys([s, s], pixel_values=[pv, pv_swapped], image_token_id=IMAGE_TOKEN)
    ph = np.flatnonzero(s == IMAGE_TOKEN)
    assert np.array_equal(k[ph[:16]], ks[ph[16:]]) and np.array_equal(k[ph[16:]], ks[ph[:16]])


@pytest.mark.parametrize(
    "change,match",
    [
        ("drop_pixels", "placeholder tokens but no pixel_values"),
        ("extra_token", "9 image placeholder tokens do not split over its 2 image"),
        ("bad_grid", "covers 32 patch rows, pixel_values has 16"),
        ("short_list", "pixel_values has 1 entries for 2 sequences"),
    ],
)
def test_mismatched_inputs_are_named(change, match):
    rng = np.random.default_rng(3)
    A = image("qwen2_5_vl", 1)
    s = _seq(rng, "qwen2_5_vl", [A])
    seqs, pv, thw = [s, s.copy()], [A["pixel_values"], A["pixel_values"]], [A["image_grid_thw"], A["image_grid_thw"]]
    if change == "drop_pixels":
        pv[1], thw[1] = None, None
    elif change == "extra_token":  # two 4-token images, 9 placeholders
        seqs[1] = np.concatenate([_seq(rng, "qwen2_5_vl", [A, A]), [IMAGE_TOKEN]])
        pv[1], thw[1] = join_images([A, A])
    elif change == "bad_grid":
        thw[1] = torch.tensor([[1, 4, 8]])
    else:
        pv = pv[:1]
    with pytest.raises(RequestError, match=match) as e:
        image_keys(seqs, pixel_values=pv, image_grid_thw=thw, image_token_id=IMAGE_TOKEN)
    assert "[1]" in e.value.path or change == "short_list"


async def test_the_sidecar_takes_image_keys_unchanged():
    rng = np.random.default_rng(4)
    A, B = image("qwen2_5_vl", 1), image("qwen2_5_vl", 2)
    prompt = _seq(rng, "qwen2_5_vl", [A], pre=8)
    seqs = [np.concatenate([prompt, text(rng, 5)]).astype(np.int64) for _ in range(4)]
    pv, thw = zip(*(join_images([i]) for i in (A, A, B, B)))
    keys = image_keys(seqs, pixel_values=list(pv), image_grid_thw=list(thw), image_token_id=IMAGE_TOKEN)
    kw = dict(seq_len=128, trainable=[len(prompt)] * 4, min_shared_len=4, keys=keys)
    embedded = Packer().pack(seqs, **kw)
    app = create_app(Settings())
    try:
        async with AsyncPacker("http://asgi", transport=httpx.ASGITransport(app)) as asgi:
            remote = await asgi.pack(seqs, **kw)
    finally:
        app.state.service.close()
    assert_same_plan(embedded, remote)
    validate_plan(remote, seqs, trainable=kw["trainable"], keys=keys)
    # The image splits the tree: {0, 1} and {2, 3} share their whole prompts, the four only its text before the image.
    plain = plan_batch(seqs, **{**kw, "keys": None})
    validate_plan(plain, seqs, trainable=kw["trainable"])
    assert embedded.stats.tree_tokens - plain.stats.tree_tokens == len(prompt) - 1 - 9
