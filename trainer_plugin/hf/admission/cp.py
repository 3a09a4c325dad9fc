"""Context parallelism's admission: every layer kind of the registry has a CP path over these ranks.

Attention runs Ulysses (:mod:`treepack.trainer.hf.attention`); a kind of the layer registry
runs under CP only when its ``shard`` slot says how, and only when that slot does not refuse
the module over the CP size (e.g. heads that do not divide the ranks).
"""

from __future__ import annotations

import torch

from treepack.proto.errors import UnsupportedModelError
from treepack.trainer.hf.layers import handled_layer
from treepack.trainer.hf.layers.spec import NOT_SHARDED

__all__ = ["check_cp_layers"]


def check_cp_layers(model: torch.nn.Module, cp_size: int, contiguous: bool = True) -> None:
    """Refuse, before compute, every layer of ``model`` that has no context-parallel path.

    The mixers' layout puts the ranks' shards end to end as whole rows, so with a split
    that is not contiguous (``contiguous=False``: the all-gather plan's tiles) every kind of
    the registry is refused.

    Args:
        model: the unwrapped HF model.
        cp_size: the context-parallel ranks.
        contiguous: the plan's split gives each rank contiguous shards.

    Raises:
        UnsupportedModelError: naming each refused module's path, class and why.
    """
    refusals = []
    for name, mod in model.named_modules():
        layer = handled_layer(mod)
        if layer is None:
            continue
        if not contiguous:
            why = (
                f"layer kind {layer.kind!r} runs under CP on contiguous shards only; this plan's split is balanced "
                "for all-gather (plan with cp_attention 'auto' or 'ulysses')"
            )
        elif layer.shard is NOT_SHARDED:
            why = (
                f"layer kind {layer.kind!r} has no context-parallel path (its tree scan runs on whole rows of one rank)"
            )
        else:
            why = layer.shard.refuse(mod, cp_size)
        if why is not None:
            refusals.append((name, type(mod).__name__, why))
    if refusals:
        lines = "; ".join(f"{n} ({c}): {w}" for n, c, w in refusals)
        raise UnsupportedModelError(
            f"context parallelism over {cp_size} ranks refused: {lines}",
            rule="cp_unsupported_layer",
            refusals=tuple(refusals),
        )
