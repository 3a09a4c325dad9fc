"""The attention mask ``packed_forward`` hands an HF model: one per layer type where the model takes that.

HF models with several layer types (sliding/global attention, linear-attention hybrids
such as Qwen3-Next) build one mask per type with their own builders
(``create_causal_mask``, ``create_recurrent_attention_mask`` ...) from the mask they are
given, unless they are given the mapping itself. The recurrent builders expect a 2-D
padding mask and break on a tree mask (a FlexAttention ``BlockMask`` in particular). So
where the base model's ``forward`` accepts a ``{layer_type: mask}`` mapping,
:func:`attention_mask_for` passes one: the tree mask for attention layer types (the
registered tree attention takes its mask from the packed batch in any case) and None for
the others, whose patched layers follow the tree from the packed batch and use no mask.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any

__all__ = ["attention_mask_for", "takes_mask_mapping", "ATTENTION_LAYER_TYPES"]

# The config.layer_types entries that are attention (the tree mask is theirs; the static
# check, treepack.trainer.hf.admission.structure, holds every other type to a handled mixer).
ATTENTION_LAYER_TYPES = frozenset(
    {"full_attention", "sliding_attention", "attention", "global_attention", "local_attention", "chunked_attention"}
)


@functools.cache
def takes_mask_mapping(cls: type) -> bool:
    """True when ``cls.forward`` uses an ``attention_mask`` that is a ``{layer_type: mask}`` dict as it is."""
    try:
        src = inspect.getsource(cls.forward)
    except (OSError, TypeError):
        return False
    return "causal_mask_mapping := attention_mask, dict" in src


def attention_mask_for(model: Any, mask: Any) -> Any:
    """The ``attention_mask`` argument for ``model`` on packed rows.

    Args:
        model: the HF model (``*ForCausalLM`` or its base model).
        mask: the tree mask: [K, 1, L, L] bool (``sdpa``), a ``BlockMask`` (``flex``) or None.

    Returns:
        ``mask`` itself, or ``{layer_type: mask or None}`` when the base model takes a mapping
        and its config lists ``layer_types``.
    """
    base = getattr(model, "base_model", model)
    types = getattr(getattr(base, "config", None), "layer_types", None)
    if mask is None or not isinstance(types, (list, tuple)) or not takes_mask_mapping(type(base)):
        return mask
    # Some forwards index keys their config does not list (Falcon-H1 reads "full_attention" and
    # "linear_attention" whatever its layer_types say): the mapping always holds those too.
    keys = dict.fromkeys([*types, "full_attention", "sliding_attention", "chunked_attention", "linear_attention"])
    return {t: (mask if t in ATTENTION_LAYER_TYPES else None) for t in keys}
