"""TRL's batched image inputs cut into each row's own, as its processor gives them for that row alone.

TRL concatenates the images of a padded batch: ``pixel_values`` holds every image's patch
rows in sequence order, ``image_grid_thw`` one ``[t, h, w]`` per image, and GRPO gives
``num_images`` (each row's image count). :func:`sequence_images` cuts them per row (reading
the counts from each row's placeholder tokens where ``num_images`` is missing, as with
SFT's collator) and refuses the image keywords tree rows do not take, by name. The rows'
sequences come from :mod:`~treepack.trainer.planning.bridge`; the planner keys that tell
their images apart from :func:`~treepack.trainer.planning.images.image_keys`.
"""

from __future__ import annotations

from typing import Any

import torch

from treepack.proto.errors import RequestError

__all__ = ["sequence_images"]


# TRL's per-token log-probability keywords for image inputs that tree rows do not take.
_REFUSED_IMAGE_KWARGS = (
    "pixel_attention_mask",
    "spatial_shapes",
    "num_tiles",
    "image_sizes",
    "token_type_ids",
    "image_position_ids",
)


def sequence_images(
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    *,
    image_token_id: int | None,
    pixel_values: torch.Tensor | None = None,
    image_grid_thw: torch.Tensor | None = None,
    num_images: list[int] | None = None,
    mm_token_type_ids: torch.Tensor | None = None,
    **other: Any,
) -> tuple[list[torch.Tensor | None] | None, list[torch.Tensor | None] | None]:
    """TRL's batched image inputs cut into each sequence's own (what its processor gives it alone).

    TRL concatenates the batch's images: ``pixel_values`` holds every image's patch rows in
    sequence order, ``image_grid_thw`` one ``[t, h, w]`` per image, ``num_images`` (GRPO)
    each sequence's image count. Without ``num_images`` (SFT's collator gives none) each
    row takes the next images whose placeholder tokens its own placeholders cover
    (:func:`_image_counts`).

    Args:
        input_ids: [B, P + C] TRL's ids (left-padded prompts, right-padded completions).
        attention_mask: [B, P + C] 0/1.
        image_token_id: the model's image placeholder id (checked against ``mm_token_type_ids``).
        pixel_values: [sum patches, D] or None (a text-only batch).
        image_grid_thw: [sum images, 3]; required with ``pixel_values``.
        num_images: [B] images per sequence, or None: read from the placeholders.
        mm_token_type_ids: [B, P + C] or None: 1 on image placeholders, 0 elsewhere (2,
            video, is refused); must mark exactly the ``image_token_id`` positions.
        **other: TRL's other image keywords (``image_sizes``, ``pixel_attention_mask``, ...):
            refused when given.

    Returns:
        (per sequence its ``pixel_values`` or None, per sequence its ``[m, 3]`` grids or None),
        or (None, None) without images.

    Raises:
        RequestError: an unsupported image keyword, image inputs without grids or counts, or
            counts that do not cover the inputs, naming what.
    """
    _refuse_other_inputs(input_ids, attention_mask, image_token_id, mm_token_type_ids, other)
    if pixel_values is None:
        if image_grid_thw is not None:
            raise RequestError("image_grid_thw given without pixel_values", path="$.image_grid_thw", rule="missing")
        return None, None
    if image_grid_thw is None:
        raise RequestError(
            "pixel_values without image_grid_thw: supported image inputs are pixel_values with image_grid_thw "
            "(Qwen-VL families)",
            path="$.image_grid_thw",
            rule="missing",
        )
    B = input_ids.shape[0]
    rows = image_grid_thw.prod(-1).tolist()
    if sum(rows) != pixel_values.shape[0]:
        raise RequestError(
            f"image_grid_thw covers {sum(rows)} patch rows, pixel_values has {pixel_values.shape[0]}",
            path="$.image_grid_thw",
            rule="shape",
        )
    counts = (
        _image_counts(input_ids, attention_mask, image_token_id, rows)
        if num_images is None
        else [int(n) for n in num_images]
    )
    if len(counts) != B or sum(counts) != image_grid_thw.shape[0]:
        raise RequestError(
            f"num_images {counts} does not cover {B} sequences and {image_grid_thw.shape[0]} image grids",
            path="$.num_images",
            rule="length",
        )
    return _cut(pixel_values, image_grid_thw, rows, counts)


def _cut(
    pixel_values: torch.Tensor, image_grid_thw: torch.Tensor, rows: list[int], counts: list[int]
) -> tuple[list[torch.Tensor | None], list[torch.Tensor | None]]:
    """Per sequence its ``pixel_values`` and grids (None without images), ``counts[b]`` images each.

    Args:
        pixel_values: [sum rows, D] every image's patch rows, in sequence order.
        image_grid_thw: [len(rows), 3] each image's grid.
        rows: [images] patch rows of each image.
        counts: [B] images of each sequence (summing to ``len(rows)``).

    Returns:
        (B ``pixel_values`` slices or None, B ``[m, 3]`` grids or None).
    """
    pv: list[torch.Tensor | None] = []
    thw: list[torch.Tensor | None] = []
    img = row = 0
    for n in counts:
        r = sum(rows[img : img + n])
        pv.append(pixel_values[row : row + r] if n else None)
        thw.append(image_grid_thw[img : img + n] if n else None)
        img, row = img + n, row + r
    return pv, thw


def _refuse_other_inputs(
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    image_token_id: int | None,
    mm_token_type_ids: torch.Tensor | None,
    other: dict[str, Any],
) -> None:
    """Refuse image keywords tree rows do not take, and ``mm_token_type_ids`` that mark video
    or other positions than the placeholders (arguments as :func:`sequence_images`).

    Raises:
        RequestError: naming the keyword (rule ``unsupported``) or the mismatch.
    """
    given = [k for k, v in other.items() if v is not None]
    if given:
        what = given[0]
        why = (
            "not a model input tree rows take"
            if what not in _REFUSED_IMAGE_KWARGS
            else "supported image inputs are pixel_values with image_grid_thw (Qwen-VL families)"
        )
        raise RequestError(f"the packed forward got {what}: {why}", path=f"$.{what}", rule="unsupported")
    if mm_token_type_ids is not None:
        mm = mm_token_type_ids.to(attention_mask.device)
        if bool((mm > 1).any()):
            raise RequestError(
                "mm_token_type_ids marks video tokens: video inputs are not supported on tree rows",
                path="$.mm_token_type_ids",
                rule="unsupported",
            )
        placeholders = (
            (input_ids == image_token_id) & attention_mask.bool()
            if image_token_id is not None
            else torch.zeros_like(attention_mask, dtype=torch.bool)
        )
        if not torch.equal(mm.bool() & attention_mask.bool(), placeholders):
            raise RequestError(
                f"mm_token_type_ids marks other positions than the image token {image_token_id}",
                path="$.mm_token_type_ids",
                rule="image_placeholders",
            )


def _image_counts(
    input_ids: torch.Tensor, attention_mask: torch.Tensor, image_token_id: int | None, patches: list[int]
) -> list[int]:
    """[B] images of each row, read from its placeholder tokens (images in row order).

    Every image takes ``patches / m`` placeholders, ``m`` the batch's patches per
    placeholder (one spatial merge for all images, as :func:`~treepack.trainer.planning.images.placeholder_counts`
    assumes); row b takes the next images until their placeholders make its own count.

    Raises:
        RequestError: placeholders that do not cover the images image by image (e.g. cut by
            truncation), naming the row.
    """
    per_row = (
        ((input_ids == image_token_id) & attention_mask.bool()).sum(1).tolist()
        if image_token_id is not None
        else [0] * input_ids.shape[0]
    )
    total = sum(per_row)
    m = sum(patches) // total if total else 0
    if not m or m * total != sum(patches) or any(p % m for p in patches):
        raise RequestError(
            f"the rows hold {total} image placeholder tokens, which do not split over {len(patches)} images "
            f"of {patches} patches (truncated by max_length?)",
            path="$.input_ids",
            rule="image_placeholders",
        )
    counts, img = [], 0
    for b, n in enumerate(per_row):
        start = img
        while n > 0 and img < len(patches):
            n -= patches[img] // m
            img += 1
        if n != 0:
            raise RequestError(
                f"row {b}'s image placeholder tokens do not cover whole images (truncated by max_length?)",
                path=f"$.input_ids[{b}]",
                rule="image_placeholders",
            )
        counts.append(img - start)
    return counts
