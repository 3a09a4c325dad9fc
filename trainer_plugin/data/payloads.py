"""A packed batch's payloads: the trainer's per-token arrays beside the token ids.

Two alignments:

- ``payloads`` (target-aligned, the loss side: old/ref logprobs, advantages, weights): a
  per-token array ``x[s][p]`` describes token p *as a prediction target*, like the output
  of :meth:`~treepack.trainer.data.packed_batch.PackedBatch.unpack_logprobs`. It is kept
  **per scored entry** (per (position, sharer): ``entry_payloads``, what the losses read,
  so each sharer of a shared trainable position keeps its own old logprobs, advantages and
  weights), and lands on the row position that predicts token p (``idx(s, p-1)``) for
  every trainable p >= 1 (``payloads``); a position whose sharers' values differ holds the
  fill value there, never one sharer's value picked at random.
- ``input_payloads`` (token-aligned: MoE routing replay ``[tokens, layers, top_k]``,
  extra embeddings): ``x[s][p]`` lands on ``idx(s, p)``, read from each segment's
  source sequence. A shared token enters the forward once, so every sharer must hold the
  same value there: :func:`pack_payloads` checks it (each sequence reads its own values
  back, one gather) and raises :class:`PayloadMismatchError` naming the sequences
  otherwise. Plan with ``keys`` from :func:`~treepack.trainer.planning.routing.routing_keys`
  so that the planner never shares tokens whose routing differs.

Each payload is concatenated once over the sequences the batch needs and read with one
gather; unwritten slots are filled with NaN (floating), -1 (integer) or False (bool).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from treepack.proto.errors import RequestError
from treepack.proto.plan import Plan
from treepack.trainer.data.rows import RowIndex
from treepack.trainer.data.sequences import concat_arrays
from treepack.trainer.kernels.index import scatter_filled

__all__ = ["PayloadMismatchError", "pack_payloads"]


class PayloadMismatchError(RequestError):
    """Sequences that share a row position carry different token-aligned payload values.

    A token-aligned payload (MoE routing replay, extra embeddings) enters the forward at
    the shared position once, so packing it is exact only when every sharer holds the
    same value there; otherwise materialization refuses, naming the payload, both
    sequences and the position. Plan with keys from
    :func:`~treepack.trainer.planning.routing.routing_keys` so the planner never shares such
    tokens.

    Attributes:
        sequences: (the sequence that differs, the segment's source sequence).
    """

    kind = "payload_mismatch"

    def __init__(
        self, message: str, *, path: str, rule: str = "sharers_disagree", sequences: tuple[int, ...] = ()
    ) -> None:
        super().__init__(message, path=path, rule=rule)
        self.sequences = tuple(sequences)


def _differs(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """[N] bool: rows of ``a`` and ``b`` ([N, ...]) that differ anywhere (NaN equals NaN)."""
    ne = a != b
    if a.dtype.is_floating_point or a.dtype.is_complex:
        ne &= ~(torch.isnan(a) & torch.isnan(b))
    return ne.reshape(ne.shape[0], -1).any(-1) if ne.ndim > 1 else ne


def _check_token_payload(
    name: str, cat: torch.Tensor, packed_flat: torch.Tensor, ix: RowIndex, seq_flat: torch.Tensor, size: int
) -> None:
    """Every local sequence must read its own values back from the packed payload (one gather)."""
    bad = torch.nonzero(_differs(packed_flat[seq_flat], cat)).flatten()
    if not bad.numel():
        return
    c = int(bad[0])
    slot = int(np.searchsorted(ix.ptr, c, side="right") - 1)
    s, p = int(ix.local_seqs[slot]), c - int(ix.ptr[slot])
    src = np.full(size, -1, dtype=np.int64)
    src[ix.tok_flat] = ix.tok_src
    o = int(src[int(seq_flat[c])])
    raise PayloadMismatchError(
        f"input_payloads.{name}: sequences {s} and {o} share token {p} (row position {int(seq_flat[c])}) but their "
        f"values differ; a token-aligned payload enters the shared position once. Plan with keys that separate "
        f"them (treepack.trainer.planning.routing.routing_keys for MoE routing replay)",
        path=f"$.input_payloads.{name}[{s}]",
        sequences=(s, o),
    )


def _unshared_view(entries: torch.Tensor, score_flat: torch.Tensor, size: int, shape: tuple[int, ...]) -> torch.Tensor:
    """[K, C, ...] one value per scored position; where sharers' entries differ, the fill value.

    Which sharer a scatter with repeated indices keeps is unspecified, so a position whose
    sharers disagree gets NaN / -1 / False instead of an arbitrary one of them: the
    per-sharer values live in ``entry_payloads`` (what the losses read).
    """
    packed = scatter_filled(entries, score_flat, size)
    disagree = _differs(packed[score_flat], entries)
    if bool(disagree.any()):
        fill = float("nan") if entries.dtype.is_floating_point else (False if entries.dtype == torch.bool else -1)
        packed[score_flat[disagree]] = torch.as_tensor(fill, dtype=entries.dtype, device=entries.device)
    return packed.view(*shape)


def pack_payloads(
    plan: Plan,
    ix: RowIndex,
    payloads: Mapping[str, Any] | None,
    input_payloads: Mapping[str, Any] | None,
    index: Mapping[str, torch.Tensor],
    shape: tuple[int, int],
    dev: torch.device,
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(packed [K, C, ...] by name, per scored entry [T, ...] by name), one gather each.

    Args:
        index: the flat index tensors ``entry_src``, ``score_flat``, ``tok_flat``,
            ``gather_src``, ``seq_flat`` (see :func:`~treepack.trainer.data.materialize.materialize`).

    Raises:
        PayloadMismatchError: a token-aligned payload whose sharers disagree.
    """
    size = shape[0] * shape[1]
    packed: dict[str, torch.Tensor] = {}
    entries: dict[str, torch.Tensor] = {}
    for name, value in (payloads or {}).items():
        cat = concat_arrays(value, ix.local_seqs, plan, dev, what=f"payloads.{name}")
        entries[name] = cat[index["entry_src"]]
        packed[name] = _unshared_view(entries[name], index["score_flat"], size, (*shape, *cat.shape[1:]))
    for name, value in (input_payloads or {}).items():
        if name in packed:
            raise RequestError(
                f"payload name {name!r} is both target- and token-aligned",
                path=f"$.input_payloads.{name}",
                rule="unique",
            )
        cat = concat_arrays(value, ix.local_seqs, plan, dev, what=f"input_payloads.{name}")
        flat = scatter_filled(cat[index["gather_src"]], index["tok_flat"], size)
        _check_token_payload(name, cat, flat, ix, index["seq_flat"], size)
        packed[name] = flat.view(*shape, *cat.shape[1:])
    return packed, entries
