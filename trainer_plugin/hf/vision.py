"""Vision-language models on tree rows: the vision tower once per distinct image.

A VLM's forward embeds the text, runs the vision tower on the images
(``get_image_features``), and scatters the features into the positions of the image
placeholder tokens (``masked_scatter`` into ``inputs_embeds``); the Qwen-VL families also
number the tokens with 3-D multimodal RoPE positions (``get_rope_index``). On packed rows:

- **the tower**: the vision tower of a known VLM class (:data:`VISION_TOWERS`) mixes only
  within one image (its patch convolution and its bidirectional attention run inside one
  image), so :func:`~treepack.trainer.hf.admission.check_model` accepts it instead of
  refusing its convolution and its non-causal attention; an unknown tower is still refused.
  :func:`image_inputs` runs the tower once per distinct image of the batch
  (:class:`~treepack.trainer.data.images.BatchImages`, deduplicated by content), outside
  the packed call, and hands the model the features of every placeholder position of the
  rows, in row order, as precomputed encoder outputs (``mm_encoder_outputs``), so the
  model's own scatter (and Qwen3-VL's deepstack injection) puts them in place. A feature
  used at several positions receives the sum of their gradients, as in the unpacked sum;
- **positions**: for models with ``get_rope_index`` (Qwen2-VL, Qwen2.5-VL, Qwen3-VL, Qwen3.5) each
  sequence's 3-D positions are the model's own ``get_rope_index`` on that sequence alone,
  written to the row positions of its tokens;
- **exact or refused**: a row position that several sequences share must get the same
  feature and the same 3-D position from each of them; when it does not (a plan made
  without :func:`~treepack.trainer.planning.images.image_keys`), the forward is refused
  before the tower runs (:class:`~treepack.trainer.data.payloads.PayloadMismatchError`).

Refused by name (:data:`REFUSED_VLMS`): Gemma 3 (its image tokens attend to each other
bidirectionally, which the causal tree mask does not express). Video inputs are refused
(``materialize(pixel_values_videos=...)``, video keyword arguments to the forward).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from treepack.proto.errors import RequestError
from treepack.trainer.data.packed_batch import PackedBatch
from treepack.trainer.data.payloads import PayloadMismatchError
from treepack.trainer.hf.context import use_packed
from treepack.trainer.planning.images import placeholder_counts

__all__ = [
    "VISION_TOWERS",
    "REFUSED_VLMS",
    "vision_towers",
    "vision_refusals",
    "image_inputs",
    "vision_savings",
    "VisionSavings",
]

# Multimodal base model class -> (its vision tower attribute, tower classes known to mix only
# within one image). The projector (LLaVA's multi_modal_projector, Qwen's merger) is per token.
VISION_TOWERS: dict[str, tuple[str, tuple[str, ...]]] = {
    "Qwen2VLModel": ("visual", ("Qwen2VisionTransformerPretrainedModel",)),
    "Qwen2_5_VLModel": ("visual", ("Qwen2_5_VisionTransformerPretrainedModel",)),
    "Qwen3VLModel": ("visual", ("Qwen3VLVisionModel",)),
    "Qwen3_5Model": ("visual", ("Qwen3_5VisionModel",)),
    "LlavaModel": ("vision_tower", ("CLIPVisionModel",)),
}
REFUSED_VLMS: dict[str, str] = {
    "Gemma3Model": (
        "Gemma 3's image tokens attend to each other bidirectionally (token_type_ids); the tree mask is causal"
    ),
    "Gemma3nModel": "Gemma 3n's image tokens attend to each other bidirectionally; the tree mask is causal",
}
# Keyword arguments that would make the model compute image or video features over the rows.
_ROW_IMAGE_KWARGS = (
    "pixel_values",
    "image_grid_thw",
    "pixel_values_videos",
    "video_grid_thw",
    "mm_token_type_ids",
    "mm_encoder_outputs",
    "image_sizes",
)


def _from_transformers(mod: torch.nn.Module) -> bool:
    return type(mod).__module__.startswith("transformers.")


def _multimodal_base(model: torch.nn.Module) -> tuple[str, torch.nn.Module] | None:
    """(path, module) of the known multimodal base model inside ``model``, or None."""
    for path, mod in model.named_modules():
        if type(mod).__name__ in VISION_TOWERS and _from_transformers(mod):
            return path, mod
    return None


def vision_towers(model: torch.nn.Module) -> dict[str, str]:
    """Paths of the per-image vision towers of ``model`` that run on tree rows, and how.

    A tower counts only inside a known multimodal base (:data:`VISION_TOWERS`), when it is
    one of the tower classes listed for it, from transformers itself.
    """
    out = {}
    for path, mod in model.named_modules():
        spec = VISION_TOWERS.get(type(mod).__name__)
        if spec is None or not _from_transformers(mod):
            continue
        attr, classes = spec
        tower = getattr(mod, attr, None)
        if isinstance(tower, torch.nn.Module) and type(tower).__name__ in classes and _from_transformers(tower):
            out[f"{path}.{attr}" if path else attr] = (
                f"vision_tower:{type(tower).__name__} (per image, once per distinct image)"
            )
    return out


def vision_refusals(model: torch.nn.Module) -> list[tuple[str, str, str]]:
    """(path, class, reason) of every VLM of ``model`` refused by name (:data:`REFUSED_VLMS`)."""
    return [
        (p, type(m).__name__, REFUSED_VLMS[type(m).__name__])
        for p, m in model.named_modules()
        if type(m).__name__ in REFUSED_VLMS
    ]


def _image_token_id(config: Any) -> int:
    v = getattr(config, "image_token_id", None)
    return int(v if v is not None else config.image_token_index)


def _features(base: torch.nn.Module, images: Any) -> tuple[list[torch.Tensor], list[list[torch.Tensor]]]:
    """([U] per distinct image its [n_u, d] features, per image its deepstack [n_u, d] list).

    One ``get_image_features`` call per distinct image, outside any packed context (the
    tower runs exactly as in the unpacked model).
    """
    takes_grid = "image_grid_thw" in inspect.signature(base.get_image_features).parameters
    feats, deep = [], []
    with use_packed(None):
        for pv, grid in zip(images.pixel_values, images.grids):
            kw = {"image_grid_thw": grid} if takes_grid and grid is not None else {}
            out = base.get_image_features(pixel_values=pv, return_dict=True, **kw)
            po = out.pooler_output
            feats.append(po if isinstance(po, torch.Tensor) else torch.cat(list(po)))
            ds = getattr(out, "deepstack_features", None)
            deep.append([torch.cat(list(x)) for x in ds] if ds is not None else [])
    return feats, deep


def _feature_index(batch: PackedBatch, tokens: np.ndarray, image_token: int) -> tuple[np.ndarray, list[int]]:
    """Before the tower runs: per token of the local sequences the global feature row it
    takes (-1: text), and each distinct image's token count.

    A sequence's placeholders split over its images as :func:`~treepack.trainer.planning.images.image_keys`
    splits them (:func:`~treepack.trainer.planning.images.placeholder_counts`).

    Raises:
        RequestError: placeholders that do not split over a sequence's images, or one image
            taking different token counts in two sequences.
    """
    images = batch.images
    sizes: list[int | None] = [None] * images.num_distinct
    per_seq = []
    ptr = batch.seq_ptr
    for k, s in enumerate(batch.local_seqs.tolist()):
        ph = np.flatnonzero(tokens[int(ptr[k]) : int(ptr[k + 1])] == image_token)
        ids = images.seq_images.get(s, ())
        counts = placeholder_counts([(images.pixel_values[u], images.grids[u]) for u in ids], ph.shape[0], s)
        for u, n in zip(ids, counts):
            if sizes[u] not in (None, n):
                raise RequestError(
                    f"sequence {s} gives an image {n} placeholder tokens, another sequence gives it {sizes[u]}",
                    path=f"$.sequences[{s}]",
                    rule="image_placeholders",
                )
            sizes[u] = n
        per_seq.append((int(ptr[k]) + ph, ids))
    final = [n or 0 for n in sizes]
    offset = np.concatenate([[0], np.cumsum(final)]).astype(np.int64)
    out = np.full(tokens.shape[0], -1, dtype=np.int64)
    for pos, ids in per_seq:
        if ids:
            out[pos] = np.concatenate([offset[u] + np.arange(final[u]) for u in ids])
    return out, final


def _rows_of(batch: PackedBatch, cat: np.ndarray, what: str, fill: int) -> np.ndarray:
    """Scatter per-token values ``cat`` ([..., sum len]) of the local sequences to [..., K*L]
    row positions; every sequence must read its own values back (shared tokens agree).

    Raises:
        PayloadMismatchError: two sequences share a row position but differ there.
    """
    flat = batch.seq_flat.cpu().numpy()
    size = batch.num_rows * batch.seq_len
    rows = np.full((*cat.shape[:-1], size), fill, dtype=cat.dtype)
    rows[..., flat] = cat
    bad = np.flatnonzero((rows[..., flat] != cat).reshape(-1, cat.shape[-1]).any(0))
    if bad.shape[0]:
        c = int(bad[0])
        k = int(np.searchsorted(batch.seq_ptr, c, side="right") - 1)
        s = int(batch.local_seqs[k])
        owner = np.full(size, -1, dtype=np.int64)
        owner[flat] = np.repeat(batch.local_seqs, np.diff(batch.seq_ptr))
        o = int(owner[flat[c]])
        raise PayloadMismatchError(
            f"{what}: sequences {s} and {o} share token {c - int(batch.seq_ptr[k])} of sequence {s} (row position "
            f"{int(flat[c])}) but differ there (different images behind identical placeholder tokens); plan with "
            f"treepack.trainer.image_keys so the planner never shares them",
            path=f"$.pixel_values[{s}]",
            sequences=(s, o),
        )
    return rows


def _rope_positions(base: torch.nn.Module, batch: PackedBatch, tokens: np.ndarray, image_token: int) -> torch.Tensor:
    """[3, K, L] each sequence's own 3-D positions (``get_rope_index`` on it alone) in the rows."""
    ptr = batch.seq_ptr
    cat = np.zeros((3, tokens.shape[0]), dtype=np.int64)
    for k, s in enumerate(batch.local_seqs.tolist()):
        a, b = int(ptr[k]), int(ptr[k + 1])
        grid = batch.images.seq_grid(s)
        if grid is None:
            cat[:, a:b] = np.arange(b - a)
            continue
        ids = torch.from_numpy(tokens[a:b])[None]
        pos, _ = base.get_rope_index(ids, mm_token_type_ids=(ids == image_token).int(), image_grid_thw=grid.cpu())
        cat[:, a:b] = pos[:, 0].numpy()
    rows = _rows_of(batch, cat, "multimodal position_ids", 0)
    return torch.from_numpy(rows).to(batch.device).view(3, batch.num_rows, batch.seq_len)


def image_inputs(hf: torch.nn.Module, batch: PackedBatch, kwargs: dict[str, Any]) -> dict[str, Any]:
    """The model inputs that carry ``batch``'s images: ``mm_encoder_outputs`` and, for mRoPE
    models, ``position_ids`` [3, K, L]. Empty for a batch without images.

    Runs the vision tower once per distinct image (:func:`_features`), after checking that
    every shared placeholder position takes the same image's feature.

    Raises:
        RequestError: image or video keyword arguments passed to the forward (they would be
            computed over the rows), images for a model without a known vision tower, or a
            sequence whose placeholders do not match its images.
        PayloadMismatchError: shared placeholder tokens whose images differ.
    """
    given = [k for k in _ROW_IMAGE_KWARGS if kwargs.get(k) is not None]
    if given:
        raise RequestError(
            f"{given[0]} passed to the packed forward: image inputs go to materialize(pixel_values=..., "
            "image_grid_thw=...) "
            "(video inputs are not supported on tree rows)",
            path=f"$.kwargs.{given[0]}",
            rule="unsupported",
        )
    if batch.images is None:
        return {}
    found = _multimodal_base(hf)
    if found is None:
        raise RequestError(
            f"the batch holds images but {type(hf).__name__} has no known vision tower (known: "
            f"{sorted(VISION_TOWERS)})",
            path="$.model",
            rule="unsupported",
        )
    _, base = found
    image_token = _image_token_id(base.config)
    tokens = batch.input_ids.reshape(-1)[batch.seq_flat].cpu().numpy()
    per_token, sizes = _feature_index(batch, tokens, image_token)
    index = _rows_of(batch, per_token, "image features", -1)
    feats, deep = _features(base, batch.images)
    got = [f.shape[0] for f in feats]
    if got != sizes:
        u = next(i for i, (a, b) in enumerate(zip(got, sizes)) if a != b)
        raise RequestError(
            f"the vision tower gives distinct image {u} {got[u]} features, the text holds {sizes[u]} placeholder "
            "tokens for it",
            path="$.pixel_values",
            rule="image_placeholders",
        )
    ph = np.flatnonzero(batch.input_ids.reshape(-1).cpu().numpy() == image_token)
    sel = index[ph]
    if (sel < 0).any():
        raise RequestError(
            f"row position {int(ph[np.argmax(sel < 0)])} holds the image token but no sequence's image (pad_id "
            "equals the image token?)",
            path="$.pad_id",
            rule="image_placeholders",
        )
    sel_t = torch.from_numpy(sel).to(feats[0].device)
    fields: dict[str, Any] = {"pooler_output": (torch.cat(feats)[sel_t],)}
    if deep[0]:
        fields["deepstack_features"] = [(torch.cat([d[j] for d in deep])[sel_t],) for j in range(len(deep[0]))]
    out: dict[str, Any] = {"mm_encoder_outputs": {"image": _output_type(base, fields)}}
    if hasattr(base, "get_rope_index"):
        out["position_ids"] = _rope_positions(base, batch, tokens, image_token)
    return out


def _output_type(base: torch.nn.Module, fields: dict[str, Any]) -> Any:
    from transformers.modeling_outputs import BaseModelOutputWithPooling

    if "deepstack_features" in fields:
        cls = type(base).__module__
        module = __import__(cls, fromlist=["BaseModelOutputWithDeepstackFeatures"])
        return module.BaseModelOutputWithDeepstackFeatures(**fields)
    return BaseModelOutputWithPooling(**fields)


@dataclass(frozen=True, slots=True, kw_only=True)
class VisionSavings:
    """What sharing saved on a batch's images.

    Attributes:
        images: images over the batch's sequences (vision tower calls when each runs alone).
        distinct_images: distinct images (vision tower calls of the packed forward).
        tower_calls_saved: ``images - distinct_images``.
        vision_tokens: image placeholder tokens over the sequences (unpacked).
        vision_tokens_packed: image placeholder positions in the rows.
        vision_tokens_shared: ``vision_tokens - vision_tokens_packed`` (positions the
            decoder computes once for several sequences).
    """

    images: int
    distinct_images: int
    tower_calls_saved: int
    vision_tokens: int
    vision_tokens_packed: int
    vision_tokens_shared: int


def vision_savings(batch: PackedBatch, image_token_id: int) -> VisionSavings:
    """The image side of ``batch``'s saving (tower calls and decoder positions)."""
    tokens = batch.input_ids.reshape(-1)
    unpacked = int((tokens[batch.seq_flat] == image_token_id).sum())
    packed = int((tokens == image_token_id).sum())
    im = batch.images
    n, u = (im.num_occurrences, im.num_distinct) if im is not None else (0, 0)
    return VisionSavings(
        images=n,
        distinct_images=u,
        tower_calls_saved=n - u,
        vision_tokens=unpacked,
        vision_tokens_packed=packed,
        vision_tokens_shared=unpacked - packed,
    )
