"""Planner keys for image placeholder tokens (SPEC 1 ``key``, SPEC 8 images).

A vision-language prompt holds each image as a run of identical placeholder tokens (Qwen's
``<|image_pad|>``, LLaVA's ``<image>``), later replaced by the vision tower's features of
that image. Two prompts with the same placeholder run but different images have **identical
token ids**: planned on ids alone, the tree would share those tokens and the second
sequence would see the first one's image. :func:`image_keys` gives every placeholder token
a key from its image's content (a hash of the pixel values, their dtype and shape, and the
image's grid) and its index within the image; text tokens get key 0. Plan with these keys
and an image's tokens are shared only between sequences that hold the same image at the
same place.

A hash can collide (about ``2**-64`` per pair of images): the packed forward still checks
that every sharer of a placeholder position reads the same image feature, and refuses
otherwise (:func:`treepack.trainer.hf.vision.image_inputs`).

How a sequence's ``pixel_values`` split into images (:func:`split_images`): with
``image_grid_thw`` (Qwen-VL families) image j holds ``prod(grid[j])`` rows of patches; without
(LLaVA-style) image j is ``pixel_values[j]``. Image j's placeholder tokens are the next
``n_j`` of the sequence's placeholders, where the counts are proportional to the patch counts
(all images of a sequence share the spatial merge), so no model config is needed here.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from treepack.proto.errors import RequestError
from treepack.trainer.planning.routing import _splitmix

__all__ = ["image_keys", "split_images", "image_digest", "placeholder_counts"]

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


def _as_tensor(x: Any, path: str) -> torch.Tensor:
    if isinstance(x, torch.Tensor):
        return x
    try:
        return torch.as_tensor(np.asarray(x))
    except Exception as e:  # noqa: BLE001 - named in the error below
        raise RequestError(
            f"expected a tensor or array, got {type(x).__name__} ({e})", path=path, rule="type"
        ) from None


def split_images(pixel_values: Any, image_grid_thw: Any, s: int) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
    """Sequence s's processor outputs cut into its images, in order.

    Args:
        pixel_values: the sequence's ``pixel_values`` (None: no image).
        image_grid_thw: its ``[m, 3]`` grids (Qwen-VL), or None (one image per leading row).
        s: the sequence's index (for errors).

    Returns:
        Per image ``(pixel_values, grid [1, 3] or None)``.
    """
    if pixel_values is None:
        if image_grid_thw is not None:
            raise RequestError(
                f"sequence {s} has image_grid_thw but no pixel_values", path=f"$.pixel_values[{s}]", rule="missing"
            )
        return []
    pv = _as_tensor(pixel_values, f"$.pixel_values[{s}]")
    if image_grid_thw is None:
        if pv.ndim < 2:
            raise RequestError(
                f"sequence {s}: pixel_values without image_grid_thw must be [images, ...], got shape {tuple(pv.shape)}",
                path=f"$.pixel_values[{s}]",
                rule="shape",
            )
        return [(pv[j : j + 1], None) for j in range(pv.shape[0])]
    grid = _as_tensor(image_grid_thw, f"$.image_grid_thw[{s}]").to(torch.int64).reshape(-1, 3)
    rows = grid.prod(-1).tolist()
    if sum(rows) != pv.shape[0]:
        raise RequestError(
            f"sequence {s}: image_grid_thw {grid.tolist()} covers {sum(rows)} patch rows, "
            f"pixel_values has {pv.shape[0]}",
            path=f"$.image_grid_thw[{s}]",
            rule="shape",
        )
    out: list[tuple[torch.Tensor, torch.Tensor | None]] = []
    a = 0
    for j, n in enumerate(rows):
        out.append((pv[a : a + n], grid[j : j + 1]))
        a += n
    return out


def image_digest(pixel_values: torch.Tensor, grid: torch.Tensor | None) -> bytes:
    """16-byte content hash of one image: pixel bytes, dtype, shape and grid."""
    h = hashlib.blake2b(digest_size=16)
    pv = pixel_values.detach().cpu().contiguous()
    h.update(f"{pv.dtype}|{tuple(pv.shape)}|{None if grid is None else grid.tolist()}|".encode())
    h.update(pv.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.digest()


def placeholder_counts(
    images: list[tuple[torch.Tensor, torch.Tensor | None]], n_placeholders: int, s: int
) -> list[int]:
    """Placeholder tokens of each image of sequence s, from the sequence's placeholder total.

    Images without a grid take equal shares; with grids, shares proportional to their
    patch counts. A total that does not divide so is an error naming the sequence.
    """
    weights = [1 if g is None else int(g.prod()) for _, g in images]
    total = sum(weights)
    if not images:
        if n_placeholders:
            raise RequestError(
                f"sequence {s} holds {n_placeholders} image placeholder tokens but no pixel_values",
                path=f"$.pixel_values[{s}]",
                rule="missing",
            )
        return []
    counts = [n_placeholders * w // total for w in weights]
    if any(n_placeholders * w % total for w in weights) or sum(counts) != n_placeholders or min(counts) < 1:
        raise RequestError(
            f"sequence {s}: {n_placeholders} image placeholder tokens do not split over its {len(images)} image(s) "
            f"(patch counts {weights}); the text and the pixel_values disagree",
            path=f"$.sequences[{s}]",
            rule="image_placeholders",
        )
    return counts


def image_keys(
    sequences: Sequence[Any],
    *,
    pixel_values: Sequence[Any],
    image_grid_thw: Sequence[Any] | None = None,
    image_token_id: int,
) -> list[np.ndarray]:
    """Per-token planner keys that tell images apart.

    Args:
        sequences: S sequences of token ids.
        pixel_values: per sequence its processor ``pixel_values`` (None: no image).
        image_grid_thw: per sequence its ``[m, 3]`` grids (Qwen-VL), or None.
        image_token_id: the placeholder token id (``model.config.image_token_id``).

    Returns:
        Per sequence a [len] uint64 array: 0 on text tokens, on the t-th placeholder token
        of an image a hash of the image's content and t. Pass it as the planner's ``keys``.

    Raises:
        RequestError: lengths that do not match, or placeholders that do not split over
            the sequence's images, naming the sequence.
    """
    S = len(sequences)
    for name, v in (("pixel_values", pixel_values), ("image_grid_thw", image_grid_thw)):
        if v is not None and len(v) != S:
            raise RequestError(f"{name} has {len(v)} entries for {S} sequences", path=f"$.{name}", rule="length")
    out = []
    with np.errstate(over="ignore"):
        for s in range(S):
            ids = np.asarray(sequences[s])
            imgs = split_images(pixel_values[s], None if image_grid_thw is None else image_grid_thw[s], s)
            ph = np.flatnonzero(ids == image_token_id)
            counts = placeholder_counts(imgs, ph.shape[0], s)
            key = np.zeros(ids.shape[0], dtype=np.uint64)
            a = 0
            for (pv, grid), n in zip(imgs, counts):
                d = np.uint64(int.from_bytes(image_digest(pv, grid)[:8], "little"))
                key[ph[a : a + n]] = _splitmix(d + np.arange(1, n + 1, dtype=np.uint64) * _GOLDEN)
                a += n
            out.append(key)
    return out
