"""A packed batch's image inputs: each sequence's images, deduplicated by content.

:func:`batch_images` takes the per-sequence processor outputs that
:func:`~treepack.trainer.data.materialize.materialize` receives (``pixel_values`` and
``image_grid_thw`` as the HF processor gives them for each sequence alone), cuts them into
images (:func:`~treepack.trainer.planning.images.split_images`) for the sequences of the
materialized rows, and keeps each distinct image (by content hash) once. The packed forward
(:func:`treepack.trainer.hf.vision.image_inputs`) runs the vision tower once per distinct
image and places the features where the rows hold that image's placeholder tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from treepack.proto.errors import RequestError
from treepack.trainer.planning.images import image_digest, split_images

__all__ = ["BatchImages", "batch_images"]


@dataclass(frozen=True, slots=True, kw_only=True)
class BatchImages:
    """The distinct images of a batch and which sequence holds which.

    Attributes:
        pixel_values: [U] each distinct image's ``pixel_values`` (on the batch's device).
        grids: [U] each distinct image's ``[1, 3]`` grid, or None (no grid: LLaVA-style).
        seq_images: sequence index -> the distinct image ids it holds, in order (local
            sequences only; a sequence without images maps to ``()``).
        digests: [U] the content hash of each distinct image.
    """

    pixel_values: list[torch.Tensor]
    grids: list[torch.Tensor | None]
    seq_images: dict[int, tuple[int, ...]]
    digests: list[bytes]

    @property
    def num_distinct(self) -> int:
        """U, the distinct images (= vision tower calls of a packed forward)."""
        return len(self.pixel_values)

    @property
    def num_occurrences(self) -> int:
        """Images over the local sequences, each counted per sequence (= tower calls unpacked)."""
        return sum(len(v) for v in self.seq_images.values())

    def seq_grid(self, s: int) -> torch.Tensor | None:
        """Sequence s's ``[m, 3]`` grids in order (its processor's ``image_grid_thw``), or None."""
        ids = self.seq_images.get(s, ())
        if not ids or self.grids[ids[0]] is None:
            return None
        grids = [g for u in ids if (g := self.grids[u]) is not None]
        # The grid is part of an image's digest, and a sequence's images all have one or none.
        assert len(grids) == len(ids), f"sequence {s} mixes images with and without a grid"
        return torch.cat(grids)


def batch_images(
    pixel_values: Sequence[Any] | None,
    image_grid_thw: Sequence[Any] | None,
    local_seqs: np.ndarray,
    num_sequences: int,
    device: torch.device,
) -> BatchImages | None:
    """The local sequences' images, deduplicated (None when no sequence has one).

    Args:
        pixel_values: per sequence (all S) its ``pixel_values`` or None.
        image_grid_thw: per sequence its ``[m, 3]`` grids or None; None for a model without grids.
        local_seqs: [S_local] the sequences of the materialized rows.
        num_sequences: S.
        device: where the image tensors go.

    Raises:
        RequestError: wrong lengths or shapes, naming the sequence.
    """
    if pixel_values is None:
        if image_grid_thw is not None:
            raise RequestError("image_grid_thw given without pixel_values", path="$.image_grid_thw", rule="missing")
        return None
    for name, v in (("pixel_values", pixel_values), ("image_grid_thw", image_grid_thw)):
        if v is not None and len(v) != num_sequences:
            raise RequestError(
                f"{name} has {len(v)} entries for {num_sequences} sequences", path=f"$.{name}", rule="length"
            )
    index: dict[bytes, int] = {}
    pvs: list[torch.Tensor] = []
    grids: list[torch.Tensor | None] = []
    seq_images: dict[int, tuple[int, ...]] = {}
    for s in local_seqs.tolist():
        ids = []
        for pv, grid in split_images(pixel_values[s], None if image_grid_thw is None else image_grid_thw[s], s):
            d = image_digest(pv, grid)
            if d not in index:
                index[d] = len(pvs)
                pvs.append(pv.to(device))
                grids.append(None if grid is None else grid.to(device))
            ids.append(index[d])
        seq_images[s] = tuple(ids)
    if not pvs:
        return None
    return BatchImages(pixel_values=pvs, grids=grids, seq_images=seq_images, digests=list(index))
