"""Rotary embedding at the plan's per-token positions, with the HF model's own frequencies.

Megatron's ``GPTModel`` builds its rotary embedding for ``rope`` from ``range(seq_len)``
(``RotaryEmbedding.forward(max_seq_len)``): it never reads ``position_ids``, so on tree rows,
where a branch's tokens continue their ancestor's positions, stock RoPE rotates them by
their row index instead (off by ~1e-3 on a tiny model, and growing with the row). The
:class:`TreeRotaryEmbedding` swapped in by :func:`~treepack.trainer.megatron.from_hf`
returns, inside :func:`~treepack.trainer.megatron.packed_forward`, the angles of every row's
``position_ids`` as ``[L, K, 1, D]`` (Megatron's attention broadcasts them over heads), and
``0..s-1`` outside it.

Its inverse frequencies are the HF model's (``rotary_emb.inv_freq``), not the ones Megatron
derives from the converted config: Megatron's Llama-3 scaling (``RotaryEmbedding._apply_scaling``)
hard-codes ``low_freq_factor=1``, ``high_freq_factor=4`` and
``original_max_position_embeddings=8192`` whatever the checkpoint says, so a converted model
with other values is off by ~4e-3 even unpacked. Rope types whose angles are not a fixed
``position * inv_freq`` with unit scale are refused by name (:data:`ROPE_TYPES`).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from treepack.proto.errors import UnsupportedModelError
from treepack.trainer.megatron.context import current_rows

__all__ = ["TreeRotaryEmbedding", "hf_inv_freq", "ROPE_TYPES"]

# HF rope types whose angle is position * inv_freq (frequencies fixed at load) with cos/sin
# unscaled: exact from the plan's positions. "dynamic" rescales with the sequence length,
# "yarn" / "longrope" scale cos and sin (and longrope switches frequencies by length).
ROPE_TYPES = ("default", "linear", "llama3")


def hf_inv_freq(hf_model: Any) -> torch.Tensor:
    """[D/2] float32 inverse frequencies of an HF causal LM's rotary embedding.

    Raises:
        UnsupportedModelError: no single rotary embedding, a rope type outside
            :data:`ROPE_TYPES`, or a cos/sin scale other than 1.
    """
    found = [(n, m) for n, m in hf_model.named_modules() if n.split(".")[-1] == "rotary_emb"]
    if len(found) != 1 or not isinstance(getattr(found[0][1], "inv_freq", None), torch.Tensor):
        names = [n for n, _ in found]
        raise UnsupportedModelError(
            f"{type(hf_model).__name__}: expected one rotary embedding with inv_freq, found {names or 'none'}",
            rule="rope",
            refusals=((names[0] if names else "", type(hf_model).__name__, "rotary embedding not found"),),
        )
    name, rot = found[0]
    rope_type = getattr(rot, "rope_type", "default")
    scale = float(getattr(rot, "attention_scaling", 1.0))
    if rope_type not in ROPE_TYPES or scale != 1.0:
        why = (
            f"rope_type {rope_type!r} (attention scaling {scale}) is not a fixed position * inv_freq rotation; "
            f"the Megatron backend runs {ROPE_TYPES}"
        )
        raise UnsupportedModelError(
            f"{name} ({type(rot).__name__}): {why}", rule="rope", refusals=((name, type(rot).__name__, why),)
        )
    return rot.inv_freq.detach().to("cpu", torch.float32).clone()


class TreeRotaryEmbedding(nn.Module):
    """Drop-in for Megatron's ``RotaryEmbedding`` (non-interleaved ``rope``) at per-token positions.

    Args:
        inv_freq: [D/2] inverse frequencies (:func:`hf_inv_freq`); D is the rotated width
            (``kv_channels * rotary_percent``).
    """

    def __init__(self, inv_freq: torch.Tensor) -> None:
        super().__init__()
        # Not persistent: Megatron's own RotaryEmbedding keeps nothing in the state dict either.
        self.register_buffer("inv_freq", inv_freq.to(torch.float32), persistent=False)

    def get_rotary_seq_len(
        self,
        inference_context: Any,
        transformer: Any,
        transformer_input: torch.Tensor,
        transformer_config: Any,
        packed_seq_params: Any = None,
        **kwargs: Any,
    ) -> int:
        """The row length ``s`` of the decoder input ``[s, b, h]`` (training only: no inference
        context, no ``thd`` packing)."""
        if inference_context is not None or packed_seq_params is not None:
            why = "the tree rotary embedding runs training forwards (no inference context, no thd packing)"
            raise UnsupportedModelError(why, rule="rope", refusals=(("rotary_pos_emb", type(self).__name__, why),))
        return int(transformer_input.size(0))

    def forward(
        self, max_seq_len: int, offset: int = 0, packed_seq: bool = False, cp_group: Any = None
    ) -> torch.Tensor:
        """[s, K, 1, D] angles of each row's ``position_ids`` in a packed forward, else [s, 1, 1, D] of ``0..s-1``.

        Args:
            max_seq_len: the row length s.
            offset: must be 0 (an inference offset).
            packed_seq: must be False (Megatron's ``thd`` packing expresses no tree).
            cp_group: unused: context parallelism is refused by the admission.
        """
        if offset or packed_seq:
            why = f"offset {offset} / thd packing {packed_seq}: tree rows carry their own positions"
            raise UnsupportedModelError(why, rule="rope", refusals=(("rotary_pos_emb", type(self).__name__, why),))
        rows = current_rows()
        dev = self.inv_freq.device
        if rows is None:
            pos = torch.arange(max_seq_len, device=dev)[None]
        else:
            pos = rows.position_ids.to(dev)
            if pos.shape[1] != max_seq_len:
                raise UnsupportedModelError(
                    f"rows of {pos.shape[1]} positions, decoder input of {max_seq_len}",
                    rule="rope",
                    refusals=(("rotary_pos_emb", type(self).__name__, "row length mismatch"),),
                )
        # HF's order of operations: float32 positions times float32 frequencies.
        freqs = pos.to(torch.float32)[..., None] * self.inv_freq  # [K, s, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.transpose(0, 1)[:, :, None, :]
