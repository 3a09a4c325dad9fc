"""PEFT's activated LoRA (aLoRA) on tree rows: each sequence's adapter switches on at its own invocation.

An aLoRA adapter runs only from the start of the *last* occurrence of its invocation tokens
in an input (``alora_invocation_tokens``), onwards. PEFT's ``PeftModelForCausalLM`` finds it
once per input row (``calculate_alora_offsets``) and hands every LoRA layer an offset from
the row's end; on a packed row that is one match for all the sequences the row holds, so
they would be adapted from another sequence's match on (0.09 off each sequence alone in a
tiny Qwen3).

Here the activation is computed per sequence, from the sequence's own tokens, and mapped
into the rows (:func:`activation_mask`): a row position is active when its sequences are at
or after their own match. Sharers of a position must agree (a sequence whose last match lies
after a shared prompt that holds an earlier match disagrees with one whose does not): else
the call is refused before the model runs (:class:`~treepack.trainer.data.payloads.PayloadMismatchError`);
plan with :func:`alora_keys` so the planner never shares such positions. The mask travels as
PEFT's own ``alora_offsets`` argument (a :class:`TreeActivation`), which PEFT passes to every
LoRA layer (gradient checkpointing replays included), and aLoRA's variant applies the adapter
where it is set (:func:`install_tree_alora`; any other ``alora_offsets`` runs PEFT's own code,
so unpacked calls are unchanged, bitwise).

On a context-parallel shard the activation is the whole rows' (``batch.cp_full``), taken at
the row positions the rank's columns hold. Only a ``PeftModelForCausalLM`` computes offsets
for its unpacked calls: for any other wrapper (or the bare model) aLoRA stays off alone and
packed alike, and nothing is passed.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from treepack.proto.errors import RequestError
from treepack.trainer.data.payloads import PayloadMismatchError
from treepack.trainer.hf.wrapped import wrapper_levels

__all__ = [
    "TreeActivation",
    "alora_invocation",
    "alora_inputs",
    "activation_mask",
    "alora_keys",
    "last_match",
    "install_tree_alora",
]

_STOCK = "_treepack_stock_forward"


@dataclass(frozen=True, slots=True)
class TreeActivation:
    """aLoRA's activation on packed rows, passed as PEFT's ``alora_offsets``.

    Attributes:
        mask: [K, L] bool, True where the adapter runs.
    """

    mask: torch.Tensor


def last_match(tokens: np.ndarray, pattern: np.ndarray) -> int:
    """Start of the last occurrence of ``pattern`` in ``tokens``, or -1 (PEFT's rule alone)."""
    n = len(pattern)
    if n == 0 or len(tokens) < n:
        return -1
    hits = np.flatnonzero((np.lib.stride_tricks.sliding_window_view(tokens, n) == pattern).all(axis=1))
    return int(hits[-1]) if hits.size else -1


def alora_keys(sequences: list[Any], invocation_tokens: list[int]) -> list[np.ndarray]:
    """Per-token planner keys (``keys=``) that tell aLoRA's activation apart: 0 before each
    sequence's last invocation match, 1 from it on, so sequences never share a position on
    which their adapter's activation differs.

    Args:
        sequences: the token ids of each sequence.
        invocation_tokens: the adapter's ``alora_invocation_tokens``.

    Returns:
        One uint64 array per sequence, its length.
    """
    pattern = np.asarray(invocation_tokens, dtype=np.int64)
    out = []
    for s in sequences:
        s = np.asarray(s, dtype=np.int64)
        k = np.zeros(len(s), dtype=np.uint64)
        start = last_match(s, pattern)
        if start >= 0:
            k[start:] = 1
        out.append(k)
    return out


def activation_mask(batch: Any, invocation_tokens: list[int]) -> torch.Tensor:
    """[K, L] bool: where aLoRA runs on ``batch``'s rows, each sequence from its own last match on.

    Args:
        batch: the :class:`~treepack.trainer.data.packed_batch.PackedBatch` (whole rows).
        invocation_tokens: the adapter's ``alora_invocation_tokens``.

    Returns:
        [K, L] bool on ``batch``'s device.

    Raises:
        PayloadMismatchError: two sequences share a row position but only one of them is
            activated there.
    """
    K, C = batch.input_ids.shape
    ids = batch.input_ids.reshape(-1).cpu().numpy()
    flat = batch.seq_flat.cpu().numpy()
    ptr = np.asarray(batch.seq_ptr)
    pattern = np.asarray(invocation_tokens, dtype=np.int64)
    cover = np.bincount(flat, minlength=K * C)
    active = np.zeros(K * C, dtype=np.int64)
    starts = []
    for k in range(len(ptr) - 1):
        pos = flat[ptr[k] : ptr[k + 1]]
        starts.append(last_match(ids[pos], pattern))
        if starts[-1] >= 0:
            active[pos[starts[-1] :]] += 1
    split = np.flatnonzero((active > 0) & (active < cover))
    if split.size:
        _refuse_split(batch, flat, ptr, starts, int(split[0]))
    return torch.from_numpy(active > 0).view(K, C).to(batch.input_ids.device)


def _refuse_split(batch: Any, flat: np.ndarray, ptr: np.ndarray, starts: list[int], where: int) -> None:
    """Raise for row position ``where``, on for one sequence sharing it and off for another."""
    on = off = -1
    for k in range(len(ptr) - 1):
        hit = np.flatnonzero(flat[ptr[k] : ptr[k + 1]] == where)
        if hit.size:
            if starts[k] >= 0 and hit[0] >= starts[k]:
                on = k
            else:
                off = k
    a, b = int(batch.local_seqs[on]), int(batch.local_seqs[off])
    raise PayloadMismatchError(
        f"aLoRA activation: sequences {a} and {b} share row position {where}, where the adapter is on for "
        f"sequence {a} (its last invocation match starts earlier) and off for {b}; plan with "
        "keys=treepack.trainer.hf.alora.alora_keys(sequences, invocation_tokens) so the planner never shares "
        "such positions",
        path=f"$.sequences[{b}]",
        sequences=(a, b),
    )


def _causal_lm_peft(model: Any) -> Any | None:
    """The ``PeftModelForCausalLM`` among ``model``'s wrappers (the one that computes aLoRA offsets), or None."""
    if "peft" not in sys.modules:  # no PEFT model exists without PEFT imported
        return None
    from peft import PeftModelForCausalLM

    return next((m for m in wrapper_levels(model) if isinstance(m, PeftModelForCausalLM)), None)


def alora_invocation(model: Any) -> list[int] | None:
    """The invocation tokens of the active aLoRA adapter that ``model`` (as held) activates on its
    unpacked calls (a ``PeftModelForCausalLM``'s), or None."""
    peft_model = _causal_lm_peft(model)
    if peft_model is None:
        return None
    cfg = peft_model.peft_config.get(peft_model.active_adapter)
    tokens = getattr(cfg, "alora_invocation_tokens", None)
    return [int(t) for t in tokens] if tokens else None


def alora_inputs(model: Any, batch: Any) -> dict[str, Any]:
    """The model-call keywords that run aLoRA per sequence on ``batch``'s rows: ``{"alora_offsets":
    TreeActivation}`` when ``model`` (as held) is a ``PeftModelForCausalLM`` whose active adapter is
    an aLoRA, else empty (aLoRA then stays off alone and packed alike).

    Raises:
        PayloadMismatchError: sharers of a row position disagree on the activation (:func:`activation_mask`).
    """
    tokens = alora_invocation(model)
    if tokens is None:
        return {}
    install_tree_alora()
    if batch.cp is None:
        return {"alora_offsets": TreeActivation(activation_mask(batch, tokens))}
    # A CP shard: the whole rows' activation, at the row positions this rank's columns hold
    # (positions past the rows are padding: off).
    whole = activation_mask(batch.cp_full, tokens)  # [K, seq_len]
    K, Ls = batch.input_ids.shape
    pad = whole.new_zeros((K, batch.cp.size * Ls - whole.shape[1]))
    mine = torch.cat([whole, pad], dim=1).gather(1, batch.cp_positions[batch.cp.rank])  # [K, Ls]
    return {"alora_offsets": TreeActivation(mine)}


def _tree_alora_forward(
    module: torch.nn.Module, active_adapter: str, x: torch.Tensor, result: torch.Tensor, **kwargs: Any
) -> torch.Tensor:
    """aLoRA's variant forward: PEFT's own, or with a :class:`TreeActivation` the adapter on its mask."""
    from peft.tuners.lora.variants import ALoraLinearVariant

    act = kwargs.get("alora_offsets")
    if not isinstance(act, TreeActivation):
        return getattr(ALoraLinearVariant, _STOCK)(module, active_adapter, x, result, **kwargs)
    if tuple(act.mask.shape) != tuple(result.shape[:2]):
        raise RequestError(
            f"aLoRA activation of shape {tuple(act.mask.shape)} for a layer input of {tuple(result.shape[:2])}: "
            "the packed rows' activation reaches only layers that run on the rows",
            path="$.alora_offsets",
            rule="shape",
        )
    lora_a, lora_b = module.lora_A[active_adapter], module.lora_B[active_adapter]
    dropout, scaling = module.lora_dropout[active_adapter], module.scaling[active_adapter]
    x = x.to(lora_a.weight.dtype)
    keep = act.mask.reshape(-1)
    res = result.view(-1, result.shape[-1])
    # As PEFT's: the adapter on the selected tokens only, added in place.
    res[keep] += lora_b(lora_a(dropout(x.reshape(-1, x.shape[-1])[keep]))) * scaling
    return result


def install_tree_alora() -> None:
    """Let aLoRA's variant take a :class:`TreeActivation` (idempotent; other offsets run PEFT's code)."""
    from peft.tuners.lora.variants import ALoraLinearVariant

    if _STOCK not in ALoraLinearVariant.__dict__:
        setattr(ALoraLinearVariant, _STOCK, ALoraLinearVariant.__dict__["forward"])
        ALoraLinearVariant.forward = staticmethod(_tree_alora_forward)
