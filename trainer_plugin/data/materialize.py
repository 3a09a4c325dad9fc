"""Materialization: a plan plus the trainer's per-sequence data -> packed tensors (SPEC 7).

Index arithmetic runs in numpy over the plan's segment table (integers only, no token
touched); each array the trainer holds (token ids, each payload) is then concatenated
once over the sequences this batch needs and read with **one** vectorized gather. Lazy
per-sequence payloads (a list-like whose ``__getitem__`` loads, or a callable ``s ->
array``) are only touched for those sequences.

Two payload alignments:

- ``payloads`` (target-aligned, the loss side: old/ref logprobs, advantages, weights): a
  per-token array ``x[s][p]`` describes token p *as a prediction target*, like the output
  of :meth:`PackedBatch.unpack_logprobs`. It is kept **per scored entry** (per
  (position, sharer): ``entry_payloads``, what the losses read, so each sharer of a
  shared trainable position keeps its own old logprobs, advantages and weights), and
  lands on the row position that predicts token p (``idx(s, p-1)``) for every trainable
  p >= 1 (``payloads``); a position whose sharers' values differ holds the fill value
  there, never one sharer's value picked at random.
- ``input_payloads`` (token-aligned: MoE routing replay ``[tokens, layers, top_k]``,
  extra embeddings): ``x[s][p]`` lands on ``idx(s, p)``, read from each segment's
  source sequence. A shared token enters the forward once, so every sharer must hold the
  same value there: materialization checks it (each sequence reads its own values back,
  one gather) and raises :class:`PayloadMismatchError` naming the sequences otherwise.
  Plan with ``keys`` from :func:`~treepack.trainer.planning.routing.routing_keys` so that
  the planner never shares tokens whose routing differs.

Unwritten slots are filled with NaN (floating), -1 (integer) or False (bool).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from treepack.proto.errors import InputTypeError, RequestError
from treepack.proto.index import csr_gather, local_row_index, localize_flat, ragged_arange, row_segments, segment_tokens
from treepack.proto.plan import Plan
from treepack.trainer.data.advice import warn_hidden_sharing, warn_no_sharing
from treepack.trainer.data.images import batch_images
from treepack.trainer.data.packed_batch import PackedBatch
from treepack.trainer.data.sequences import check_count, check_rows, concat_arrays, plan_groups, plan_trainable
from treepack.trainer.kernels.index import index_tensor, scatter_filled

__all__ = ["materialize", "cp_shard", "cp_strategy", "PayloadMismatchError"]


@dataclass(frozen=True, slots=True, kw_only=True)
class _RowIndex:
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


def _row_index(plan: Plan, rows: np.ndarray) -> _RowIndex:
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
    return _RowIndex(
        tok_flat=tok_flat,
        tok_src=np.repeat(seg.seq[sel], tok_n),
        tok_pos=np.repeat(seg.seq_start[sel], tok_n) + ragged_arange(tok_n),
        tok_se=np.repeat(seg.subtree_end[sel], tok_n),
        local_seqs=local_seqs,
        ptr=ptr,
        slot=slot,
        seq_flat=seq_flat,
    )


def _scored(flags: Any, ix: _RowIndex) -> tuple[np.ndarray, np.ndarray]:
    """(c_sel, seq_of_c): scored entries as indices into the concatenated local sequences
    (position p of sequence s whose next token p+1 is trainable), and each token's slot."""
    lens = np.diff(ix.ptr)
    tr_cat = np.concatenate([flags(int(s)) for s in ix.local_seqs]) if ix.local_seqs.shape[0] else np.zeros(0, bool)
    nxt = np.zeros(tr_cat.shape[0], dtype=bool)
    nxt[:-1] = tr_cat[1:]
    if ix.ptr.shape[0] > 1:
        nxt[ix.ptr[1:] - 1] = False  # a sequence's last token predicts nothing
    return np.flatnonzero(nxt), np.repeat(np.arange(ix.local_seqs.shape[0]), lens)


def _token_ids(sequences: Sequence[Any], plan: Plan, ix: _RowIndex, dev: torch.device) -> torch.Tensor:
    """[ptr[-1]] int64 token ids of the local sequences, concatenated."""
    tokens = concat_arrays(sequences, ix.local_seqs, plan, dev, what="sequences")
    if tokens.ndim != 1 or tokens.dtype.is_floating_point or tokens.dtype.is_complex or tokens.dtype == torch.bool:
        raise InputTypeError(
            f"expected 1-D integer token ids, got {tokens.dtype} with per-token shape {tuple(tokens.shape[1:])}",
            path="$.sequences",
            rule="dtype",
        )
    return tokens.to(torch.int64)


def _row_tensors(
    tokens: torch.Tensor,
    ix: _RowIndex,
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


def _check_tokens(
    input_ids: torch.Tensor, tokens: torch.Tensor, ix: _RowIndex, seq_of_c: np.ndarray, seq_flat: torch.Tensor
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
    name: str, cat: torch.Tensor, packed_flat: torch.Tensor, ix: _RowIndex, seq_flat: torch.Tensor, size: int
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


def _payloads(
    plan: Plan,
    ix: _RowIndex,
    payloads: Mapping[str, Any] | None,
    input_payloads: Mapping[str, Any] | None,
    index: Mapping[str, torch.Tensor],
    shape: tuple[int, int],
    dev: torch.device,
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(packed [K, C, ...] by name, per scored entry [T, ...] by name), one gather each.

    Args:
        index: the flat index tensors ``entry_src``, ``score_flat``, ``tok_flat``,
            ``gather_src``, ``seq_flat`` (see :func:`materialize`).

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


def materialize(
    plan: Plan,
    sequences: Sequence[Any],
    payloads: Mapping[str, Any] | None = None,
    device: Any = None,
    *,
    trainable: Sequence[Any] | None = None,
    groups: Sequence[Any] | None = None,
    input_payloads: Mapping[str, Any] | None = None,
    rows: Any = None,
    pad_id: int = 0,
    check_tokens: bool = True,
    allow_empty_loss: bool = False,
    advise: bool = True,
    cp: Any = None,
    pixel_values: Sequence[Any] | None = None,
    image_grid_thw: Sequence[Any] | None = None,
    pixel_values_videos: Any = None,
) -> PackedBatch:
    """Build the packed tensors of ``plan`` (all rows, or the given ``rows``).

    Args:
        plan: the plan.
        sequences: the S planned sequences' token ids (list-like; only the sequences of
            the materialized rows are read), each of its submitted or placed length.
        payloads: target-aligned per-token arrays by name (module docstring).
        device: where the tensors live (default CPU).
        trainable: default (None): the flags the plan was made with (``plan.first_trainable``
            / ``plan.trainable``), which give ``targets``/``loss_mask`` and the per-sequence
            counts of the loss normalizations. Given (per sequence a bool array or a prompt
            length), they must equal the plan's, else RequestError.
        groups: default (None): the plan's group codes (per-group normalization). Given
            (per sequence an int/str/None), they must give the plan's groups, else RequestError.
        input_payloads: token-aligned per-token arrays by name (module docstring).
        rows: [K] global rows to materialize, -1 for an empty padding row (a rank's
            ``plan.ranks.rank_rows[rank]``); default all rows.
        pad_id: token id at padding positions.
        check_tokens: verify that reading each materialized sequence back from the rows
            reproduces its tokens (one gather; catches sequences that differ from the
            planned ones in content).
        allow_empty_loss: accept a plan that scores no token at all (a forward-only use);
            by default that raises, since every loss would be a silent 0.
        advise: warn (:class:`~treepack.trainer.data.advice.TreepackWarning`) when the plan
            shares nothing, or when ``min_shared_len`` hides sharing (with what a smaller
            value would share); see :mod:`treepack.trainer.data.advice`.
        cp: a :class:`~treepack.trainer.kernels.cp.ContextParallel` group: this rank's
            shard of every row (the plan must be made with ``cp_size`` equal to the group's
            size): ``[K, ranks.shard_len]`` tensors, the shard's scored entries, and the
            whole batch's normalization counts (see :class:`PackedBatch`).
        pixel_values: per sequence its image inputs as the HF processor gives them for
            that sequence alone (None: no image); kept per distinct image in
            ``batch.images`` (:mod:`~treepack.trainer.data.images`) for the packed forward,
            which runs the vision tower once per distinct image. Plan with
            :func:`~treepack.trainer.planning.images.image_keys`.
        image_grid_thw: per sequence its ``[m, 3]`` image grids (Qwen-VL families), or None.
        pixel_values_videos: refused: video inputs have no tree path yet.

    Returns:
        The :class:`PackedBatch`.

    Raises:
        RequestError: (or a subclass) for inputs that do not match the plan, naming them.
    """
    dev = torch.device("cpu") if device is None else torch.device(device)
    if cp is not None and getattr(cp, "size", None) != plan.ranks.cp_size:
        raise RequestError(
            f"the plan splits rows over {plan.ranks.cp_size} context-parallel ranks, the group has {getattr(cp, 'size', None)}: "
            "plan with cp_size equal to the CP group size",
            path="$.cp",
            rule="cp_size",
        )
    if cp is None and plan.ranks.cp_size > 1:
        raise RequestError(
            f"the plan splits rows over {plan.ranks.cp_size} context-parallel ranks: pass cp=ContextParallel(group)",
            path="$.cp",
            rule="cp_size",
        )
    if pixel_values_videos is not None:
        raise RequestError(
            "video inputs are not supported on tree rows (only images are)",
            path="$.pixel_values_videos",
            rule="unsupported",
        )
    if cp is not None and pixel_values is not None:
        raise RequestError(
            "image inputs are not supported under context parallelism", path="$.pixel_values", rule="unsupported"
        )
    S, C = plan.num_sequences, plan.seq_len
    check_count(sequences, S)
    rows_arr = check_rows(rows, plan)
    K = rows_arr.shape[0]
    size = K * C
    flags, counts = plan_trainable(plan, trainable)
    if not allow_empty_loss and not counts.any():
        raise RequestError(
            "the plan scores no token (no sequence has a trainable token after its first): the loss mask would be "
            "empty and the loss silently 0; plan with trainable= (or pass allow_empty_loss=True for a forward only)",
            path="$.trainable",
            rule="empty_loss_mask",
        )
    codes = plan_groups(plan, groups)
    ix = _row_index(plan, rows_arr)
    c_sel, seq_of_c = _scored(flags, ix)
    score_seq = ix.local_seqs[seq_of_c[c_sel]]
    score_flat = ix.seq_flat[c_sel]

    tokens = _token_ids(sequences, plan, ix, dev)
    if advise:
        warn_no_sharing(plan)
        warn_hidden_sharing(plan, tokens.cpu().numpy(), ix.ptr, ix.local_seqs)
    t = lambda a: index_tensor(a, dev)  # noqa: E731
    tok_flat, seq_flat, entry_src, score_flat_t = t(ix.tok_flat), t(ix.seq_flat), t(c_sel + 1), t(score_flat)
    gather_src = t(ix.gather_src)
    input_ids, position_ids, subtree_end = _row_tensors(tokens, ix, tok_flat, gather_src, (K, C), pad_id)
    if check_tokens and tokens.shape[0]:
        _check_tokens(input_ids, tokens, ix, seq_of_c, seq_flat)

    score_target = tokens[entry_src]
    _check_shared_targets(score_flat, score_target, score_seq)
    loss_mask = torch.zeros(size, dtype=torch.bool, device=dev)
    loss_mask[score_flat_t] = True
    index = dict(
        entry_src=entry_src, score_flat=score_flat_t, tok_flat=tok_flat, gather_src=gather_src, seq_flat=seq_flat
    )
    packed, entries = _payloads(plan, ix, payloads, input_payloads, index, (K, C), dev)
    full = PackedBatch(
        plan=plan,
        rows=rows_arr,
        input_ids=input_ids.view(K, C),
        position_ids=position_ids.view(K, C),
        subtree_end=subtree_end.view(K, C),
        targets=scatter_filled(score_target, score_flat_t, size).view(K, C),
        loss_mask=loss_mask.view(K, C),
        owner=scatter_filled(t(score_seq), score_flat_t, size).view(K, C),
        payloads=packed,
        entry_payloads=entries,
        local_seqs=ix.local_seqs,
        seq_ptr=ix.ptr,
        seq_flat=seq_flat,
        score_seq=t(score_seq),
        score_pos=t(c_sel - ix.ptr[seq_of_c[c_sel]] + 1),
        score_flat=score_flat_t,
        score_target=score_target,
        score_counts=t(counts),
        groups=t(codes),
        device=dev,
        images=batch_images(pixel_values, image_grid_thw, ix.local_seqs, S, dev),
    )
    # What the losses read, prepared here so that the forward and backward never wait on
    # the device: the scored positions from the host's index, the largest target now.
    full._cache["loss_positions"] = t(np.unique(score_flat))
    full._cache["max_target"] = int(score_target.max()) if score_target.numel() else -1
    return full if cp is None else cp_shard(full, cp, pad_id)


def _fill_of(x: torch.Tensor) -> Any:
    return float("nan") if x.dtype.is_floating_point else (False if x.dtype == torch.bool else -1)


def cp_shard(full: PackedBatch, cp: Any, pad_id: int = 0) -> PackedBatch:
    """CP rank ``cp.rank``'s shard of a whole-row batch (see :class:`PackedBatch`).

    The rows are padded to ``cp_size * shard_len`` (pad id, position 0, each padding
    position seeing only itself, nothing scored) and cut at ``[rank * shard_len, (rank + 1) *
    shard_len)``; the scored entries are those whose position lies in the shard.
    """
    if full.images is not None:
        raise RequestError(
            "images are not supported under context parallelism (the vision tower runs on whole sequences)",
            path="$.cp",
            rule="unsupported",
        )
    plan = full.plan
    K, C = full.num_rows, plan.seq_len
    Ls = plan.ranks.shard_len
    Lp = cp.size * Ls
    positions = torch.from_numpy(plan.ranks.shard_positions(full.rows)).to(full.device)  # [P, K, Ls]
    mine = positions[cp.rank]

    def cut(x: torch.Tensor, fill: Any) -> torch.Tensor:
        pad = torch.full((K, Lp - C, *x.shape[2:]), fill, dtype=x.dtype, device=x.device)
        idx = mine.view(K, Ls, *([1] * (x.ndim - 2))).expand(K, Ls, *x.shape[2:])
        return torch.cat([x, pad], dim=1).gather(1, idx).contiguous()

    se_pad = torch.arange(C + 1, Lp + 1, dtype=torch.int64, device=full.device).repeat(K, 1)
    subtree_end = torch.cat([full.subtree_end, se_pad], dim=1).gather(1, mine)
    # Column of each row position in this shard (-1: held by another rank).
    column = torch.full((K, Lp), -1, dtype=torch.int64, device=full.device)
    column.scatter_(1, mine, torch.arange(Ls, device=full.device).expand(K, Ls).contiguous())
    row, col = full.score_flat // C, column[full.score_flat // C, full.score_flat % C]
    keep = col >= 0
    local_flat = row * Ls + col
    return PackedBatch(
        plan=plan,
        rows=full.rows,
        input_ids=cut(full.input_ids, int(pad_id)),
        position_ids=cut(full.position_ids, 0),
        subtree_end=subtree_end,
        targets=cut(full.targets, -1),
        loss_mask=cut(full.loss_mask, False),
        owner=cut(full.owner, -1),
        payloads={k: cut(v, _fill_of(v)) for k, v in full.payloads.items()},
        entry_payloads={k: v[keep] for k, v in full.entry_payloads.items()},
        local_seqs=full.local_seqs,
        seq_ptr=full.seq_ptr,
        seq_flat=full.seq_flat,
        score_seq=full.score_seq[keep],
        score_pos=full.score_pos[keep],
        score_flat=local_flat[keep],
        score_target=full.score_target[keep],
        score_counts=full.score_counts,
        groups=full.groups,
        device=full.device,
        cp=cp,
        cp_full=dataclasses.replace(full, payloads={}, entry_payloads={}),
        cp_positions=positions,
        cp_strategy=cp_strategy(plan, cp),
    )


def cp_strategy(plan: Any, cp: Any) -> str:
    """The attention strategy of ``plan`` (``ranks.cp_attention``) run by group ``cp``:
    the plan's, or the group's where the plan says ``"auto"``.

    Raises:
        RequestError: the plan and the group name different strategies.
    """
    planned, asked = plan.ranks.cp_attention, getattr(cp, "strategy", "auto")
    if planned != "auto" and asked not in ("auto", planned):
        raise RequestError(
            f"the plan was made for cp_attention={planned!r}, the ContextParallel group asks for {asked!r}: "
            "plan with the group's strategy, or leave one of them 'auto'",
            path="$.cp.strategy",
            rule="cp_strategy",
        )
    if asked == "ulysses" and not plan.ranks.contiguous:
        raise RequestError(
            "Ulysses attention needs contiguous CP shards; this plan's split is balanced for all-gather",
            path="$.cp.strategy",
            rule="cp_strategy",
        )
    return asked if planned == "auto" else planned


def _check_shared_targets(score_flat: np.ndarray, score_target: torch.Tensor, score_seq: np.ndarray) -> None:
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
