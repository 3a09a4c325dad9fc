"""The integer side of materialization: a plan's segment table -> token maps and row tensors.

Index arithmetic runs in numpy over the plan's segment table (integers only, no token
touched): :func:`row_index` says where every token of the materialized rows comes from and
where each local sequence lies, :func:`scored_entries` which positions are scored. The
token ids of the local sequences are then concatenated once (:func:`token_ids`) and read
into the rows with one vectorized gather (:func:`row_tensors`); :func:`check_row_tokens`
and :func:`check_shared_targets` check the sequences and the trainable flags against the
plan. Used by :func:`~treepack.trainer.data.materialize.materialize`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from treepack.proto.errors import InputTypeError, RequestError
from treepack.proto.index import csr_gather, local_row_index, localize_flat, ragged_arange, row_segments, segment_tokens
from treepack.proto.plan import Plan
from treepack.trainer.data.sequences import concat_arrays
from treepack.trainer.kernels.index import index_tensor

__all__ = [
    "RowIndex",
    "row_index",
    "scored_entries",
    "token_ids",
    "row_tensors",
    "check_row_tokens",
    "check_shared_targets",
]


@dataclass(frozen=True, slots=True, kw_only=True)
class RowIndex:
    """Where every token of the local rows comes from, and where each local sequence lies.

    Attributes:
        tok_flat: [N_tok] flat row position (``local_row * C + index``) of each row token.
        tok_src: [N_tok] the segment's source sequence. tok_pos: [N_tok] position in it.
        tok_se: [N_tok] subtree_end of the token's segment.
        local_seqs: [S_local] sequences held by these rows, ascending.
        ptr: [S_local + 1] CSR of their tokens in the concatenated gather source.
        slot: [S] index of each sequence in ``local_seqs``, -1 if not local.
        seq_flat: [ptr[-1]] flat row position of every local sequence's tokens, in order.
    """

    tok_flat: np.ndarray
    tok_src: np.ndarray
    tok_pos: np.ndarray
    tok_se: np.ndarray
    local_seqs: np.ndarray
    ptr: np.ndarray
    slot: np.ndarray
    seq_flat: np.ndarray

    @property
    def gather_src(self) -> np.ndarray:
        """[N_tok] index of each row token in the concatenated local sequences."""
        return self.ptr[self.slot[self.tok_src]] + self.tok_pos


def row_index(plan: Plan, rows: np.ndarray) -> RowIndex:
    """The integer side of materialization: segment table -> token maps (numpy, no token read)."""
    seg, C, S = plan.segments, plan.seq_len, plan.num_sequences
    local_of_row = local_row_index(rows, plan.num_rows)
    sel, _ = row_segments(seg.row_ptr, rows)
    tok_n = seg.length[sel]
    tok_flat = localize_flat(segment_tokens(seg, C, sel), local_of_row, C)
    held = rows[rows >= 0]
    local_seqs = np.flatnonzero((plan.row_of >= 0) & np.isin(plan.row_of, held))
    ptr = np.zeros(local_seqs.shape[0] + 1, dtype=np.int64)
    np.cumsum(plan.seq_lens[local_seqs], out=ptr[1:])
    slot = np.full(S, -1, dtype=np.int64)
    slot[local_seqs] = np.arange(local_seqs.shape[0])
    # Row positions of every local sequence's tokens (the vectorized locate).
    ss = csr_gather(seg.seq_ptr, seg.seq_segs, local_seqs)
    seq_flat = localize_flat(segment_tokens(seg, C, ss), local_of_row, C)
    return RowIndex(
        tok_flat=tok_flat,
        tok_src=np.repeat(seg.seq[sel], tok_n),
        tok_pos=np.repeat(seg.seq_start[sel], tok_n) + ragged_arange(tok_n),
        tok_se=np.repeat(seg.subtree_end[sel], tok_n),
        local_seqs=local_seqs,
        ptr=ptr,
        slot=slot,
        seq_flat=seq_flat,
    )


def scored_entries(flags: Any, ix: RowIndex) -> tuple[np.ndarray, np.ndarray]:
    """(c_sel, seq_of_c): scored entries as indices into the concatenated local sequences
    (position p of sequence s whose next token p+1 is trainable), and each token's slot."""
    lens = np.diff(ix.ptr)
    tr_cat = np.concatenate([flags(int(s)) for s in ix.local_seqs]) if ix.local_seqs.shape[0] else np.zeros(0, bool)
    nxt = np.zeros(tr_cat.shape[0], dtype=bool)
    nxt[:-1] = tr_cat[1:]
    if ix.ptr.shape[0] > 1:
        nxt[ix.ptr[1:] - 1] = False  # a sequence's last token predicts nothing
    return np.flatnonzero(nxt), np.repeat(np.arange(ix.local_seqs.shape[0]), lens)


def token_ids(sequences: Sequence[Any], plan: Plan, ix: RowIndex, dev: torch.device) -> torch.Tensor:
    """[ptr[-1]] int64 token ids of the local sequences, concatenated."""
    tokens = concat_arrays(sequences, ix.local_seqs, plan, dev, what="sequences")
    if tokens.ndim != 1 or tokens.dtype.is_floating_point or tokens.dtype.is_complex or tokens.dtype == torch.bool:
        raise InputTypeError(
            f"expected 1-D integer token ids, got {tokens.dtype} with per-token shape {tuple(tokens.shape[1:])}",
            path="$.sequences",
            rule="dtype",
        )
    return tokens.to(torch.int64)


def row_tensors(
    tokens: torch.Tensor,
    ix: RowIndex,
    tok_flat: torch.Tensor,
    gather_src: torch.Tensor,
    shape: tuple[int, int],
    pad_id: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Flat [K * C] ``input_ids``, ``position_ids``, ``subtree_end``: one gather of the token
    ids, padding as the contract says (``pad_id``, position 0, sees only itself)."""
    K, C = shape
    dev = tokens.device
    input_ids = torch.full((K * C,), int(pad_id), dtype=torch.int64, device=dev)
    input_ids[tok_flat] = tokens[gather_src]
    position_ids = torch.zeros(K * C, dtype=torch.int64, device=dev)
    position_ids[tok_flat] = index_tensor(ix.tok_pos, dev)
    subtree_end = torch.arange(1, C + 1, dtype=torch.int64, device=dev).repeat(K)
    subtree_end[tok_flat] = index_tensor(ix.tok_se, dev)
    return input_ids, position_ids, subtree_end


def check_row_tokens(
    input_ids: torch.Tensor, tokens: torch.Tensor, ix: RowIndex, seq_of_c: np.ndarray, seq_flat: torch.Tensor
) -> None:
    """Reading each local sequence back from the rows must give its tokens (one gather)."""
    back = input_ids[seq_flat]
    bad = torch.nonzero(back != tokens).flatten()
    if bad.numel():
        c = int(bad[0])
        s = int(ix.local_seqs[seq_of_c[c]])
        raise RequestError(
            f"sequence {s} differs from the planned one at position {c - int(ix.ptr[ix.slot[s]])} "
            f"(token {int(tokens[c])}, the plan's segment holds {int(back[c])}): the sequences do not match the plan",
            path=f"$.sequences[{s}]",
            rule="plan_mismatch",
        )


def check_shared_targets(score_flat: np.ndarray, score_target: torch.Tensor, score_seq: np.ndarray) -> None:
    """A position scored for several sequences must predict the same token for all of them.

    In the default sharing mode no scored position is shared; with shared trainable
    positions (SPEC 2, generalized mode) the sharers must agree on the next token.
    """
    if score_flat.shape[0] == 0:
        return
    # Only positions scored more than once need a look (none in the default mode).
    dup = np.bincount(score_flat) > 1
    if not dup.any():
        return
    keep = np.flatnonzero(dup[score_flat])
    score_flat, score_seq = score_flat[keep], score_seq[keep]
    score_target = score_target[torch.from_numpy(keep).to(score_target.device)]
    order = np.argsort(score_flat, kind="stable")
    f = score_flat[order]
    tgt = score_target.cpu().numpy()[order]
    same = f[1:] == f[:-1]
    bad = np.flatnonzero(same & (tgt[1:] != tgt[:-1]))
    if bad.shape[0]:
        i = int(bad[0])
        a, b = int(score_seq[order[i]]), int(score_seq[order[i + 1]])
        raise RequestError(
            f"sequences {a} and {b} share the scored row position {int(f[i])} but predict different next tokens "
            f"({int(tgt[i])} vs {int(tgt[i + 1])}): the trainable flags do not match the plan",
            path="$.trainable",
            rule="plan_mismatch",
        )
