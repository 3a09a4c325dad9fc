"""Materialization: a plan plus the trainer's per-sequence data -> packed tensors (SPEC 7).

Index arithmetic runs in numpy over the plan's segment table (integers only, no token
touched); each array the trainer holds (token ids, each payload) is then concatenated
once over the sequences this batch needs and read with **one** vectorized gather. Lazy
per-sequence payloads (a list-like whose ``__getitem__`` loads, or a callable ``s ->
array``) are only touched for those sequences.

Two payload alignments:

- ``payloads`` (target-aligned, the loss side: old/ref logprobs, advantages, weights): a
  per-token array ``x[s][p]`` describes token p *as a prediction target*, like the output
  of :meth:`PackedBatch.unpack_logprobs`. It lands on the row position that predicts
  token p (``idx(s, p-1)``) for every trainable p >= 1, and also stays available per
  scored entry (``entry_payloads``) so that shared positions can sum their sharers'
  values.
- ``input_payloads`` (token-aligned: MoE routing replay ``[tokens, layers, top_k]``,
  extra embeddings): ``x[s][p]`` lands on ``idx(s, p)``, read from each segment's
  source sequence (tokens a segment shares are identical in every sharer; use the
  planner's ``keys`` to make that true for payloads such as routing decisions).

Unwritten slots are filled with NaN (floating), -1 (integer) or False (bool).
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, Sequence

import numpy as np
import torch

from treepack.proto.errors import InputTypeError, RequestError
from treepack.proto.index import ragged_arange
from treepack.proto.plan import Plan
from treepack.trainer.data.packed_batch import PackedBatch

__all__ = ["materialize", "normalize_trainable", "scored_counts", "group_codes"]


def _device(device: Any) -> torch.device:
    return torch.device("cpu") if device is None else torch.device(device)


def _as_tensor(x: Any, *, path: str) -> torch.Tensor:
    """One sequence's array as a tensor (numpy unsigned ids widened to int64)."""
    if isinstance(x, torch.Tensor):
        return x
    arr = np.asarray(x)
    if arr.dtype == object:
        raise InputTypeError(f"expected a numeric array, got {type(x).__name__} of objects", path=path, rule="dtype")
    if arr.dtype.kind == "u" and arr.dtype.itemsize >= 2:
        arr = arr.astype(np.int64)
    return torch.from_numpy(np.ascontiguousarray(arr))


def normalize_trainable(trainable: Sequence[Any] | None, plan: Plan) -> Callable[[int], np.ndarray]:
    """Per-sequence trainable flags in the planner's forms, cut to the placed length.

    Args:
        trainable: None (nothing trainable), or per sequence a bool array (of the
            submitted or the placed length) or a prompt length.
        plan: the plan (for the lengths).

    Returns:
        ``flags(s)`` -> [seq_lens[s]] bool.

    Raises:
        RequestError: wrong count or a length that matches neither the submitted nor the
            placed length of the sequence.
    """
    S = plan.num_sequences
    if trainable is None:
        return lambda s: np.zeros(int(plan.seq_lens[s]), dtype=bool)
    if len(trainable) != S:
        raise RequestError(f"trainable has {len(trainable)} entries for the plan's {S} sequences", path="$.trainable", rule="length_mismatch")

    def flags(s: int) -> np.ndarray:
        n, m = int(plan.seq_lens[s]), int(plan.orig_lens[s])
        x = trainable[s]
        path = f"$.trainable[{s}]"
        if isinstance(x, (bool, np.bool_)):
            raise InputTypeError(f"expected a bool array or a prompt length, got {x!r}", path=path, rule="type")
        if isinstance(x, (int, np.integer)):
            out = np.zeros(n, dtype=bool)
            out[min(int(x), n):] = True
            return out
        arr = x.detach().cpu().numpy() if isinstance(x, torch.Tensor) else np.asarray(x)
        if arr.ndim != 1 or arr.shape[0] not in (n, m):
            raise RequestError(f"trainable has shape {arr.shape} for a sequence of {m} tokens ({n} placed)", path=path, rule="length_mismatch")
        return arr[:n].astype(bool)

    return flags


def scored_counts(flags: Callable[[int], np.ndarray], plan: Plan, trainable: Sequence[Any] | None = None) -> np.ndarray:
    """[S] int64 scored positions of every sequence (trainable tokens at index >= 1).

    Prompt lengths (the common case) are counted without building flag arrays.
    """
    if trainable is None:
        return np.zeros(plan.num_sequences, dtype=np.int64)
    if all(isinstance(x, (int, np.integer)) and not isinstance(x, (bool, np.bool_)) for x in trainable):
        p = np.maximum(np.asarray(trainable, dtype=np.int64), 1)
        return np.maximum(plan.seq_lens - p, 0)
    return np.array([int(flags(s)[1:].sum()) for s in range(plan.num_sequences)], dtype=np.int64)


def _check_rows(rows: Any, plan: Plan) -> np.ndarray:
    if rows is None:
        return np.arange(plan.num_rows, dtype=np.int64)
    arr = np.asarray(rows)
    if arr.ndim != 1 or arr.dtype.kind not in "iu":
        raise InputTypeError(f"rows must be a 1-D integer array, got shape {arr.shape} dtype {arr.dtype}", path="$.rows", rule="type")
    arr = arr.astype(np.int64)
    bad = (arr < -1) | (arr >= plan.num_rows)
    if bad.any():
        raise RequestError(f"row {int(arr[np.argmax(bad)])} is not in [-1, {plan.num_rows})", path="$.rows", rule="range")
    real = arr[arr >= 0]
    if np.unique(real).shape[0] != real.shape[0]:
        raise RequestError("rows lists a row twice", path="$.rows", rule="unique")
    return arr


def _per_sequence(value: Any, s: int, offsets: np.ndarray | None) -> Any:
    if callable(value) and not isinstance(value, (torch.Tensor, np.ndarray)):
        return value(s)
    if offsets is not None:
        return value[int(offsets[s]) : int(offsets[s + 1])]
    return value[s]


def _concat(value: Any, seqs: np.ndarray, plan: Plan, device: torch.device, *, what: str) -> torch.Tensor:
    """Concatenate ``value``'s arrays of ``seqs`` (each cut to its placed length) on ``device``.

    ``value`` is a list-like of per-sequence arrays (lazy ones are indexed only at
    ``seqs``), a callable ``s -> array``, or one array/tensor whose first dimension is the
    sum of the submitted lengths (sequences concatenated in order).
    """
    offsets = None
    if isinstance(value, (torch.Tensor, np.ndarray)):
        total = int(plan.orig_lens.sum())
        if value.ndim == 0 or value.shape[0] != total:
            raise RequestError(
                f"{what} is one array of shape {tuple(value.shape)}; a flat array needs the sum of the "
                f"sequence lengths ({total}) as its first dimension",
                path=f"$.{what}",
                rule="length_mismatch",
            )
        offsets = np.concatenate([[0], np.cumsum(plan.orig_lens)])
    elif not callable(value) and len(value) != plan.num_sequences:
        raise RequestError(f"{what} has {len(value)} entries for the plan's {plan.num_sequences} sequences", path=f"$.{what}", rule="length_mismatch")
    probe = seqs
    if seqs.shape[0] == 0:
        # No sequence here (a rank holding only empty rows): read one kept sequence's
        # array for its dtype and per-token shape.
        probe = np.flatnonzero(plan.row_of >= 0)[:1]
    parts = []
    for s in probe.tolist():
        t = _as_tensor(_per_sequence(value, s, offsets), path=f"$.{what}[{s}]")
        n, m = int(plan.seq_lens[s]), int(plan.orig_lens[s])
        if t.ndim == 0 or t.shape[0] not in (n, m):
            raise RequestError(
                f"{what}[{s}] has shape {tuple(t.shape)}, expected {m} rows (one per token; {n} placed)",
                path=f"$.{what}[{s}]",
                rule="length_mismatch",
            )
        parts.append(t[: n if seqs.shape[0] else 0].to(device))
    shapes = {tuple(p.shape[1:]) for p in parts}
    if len(shapes) > 1:
        raise RequestError(f"{what}: per-token shapes differ between sequences: {sorted(shapes)}", path=f"$.{what}", rule="shape")
    return torch.cat(parts)


def _fill_value(dtype: torch.dtype) -> Any:
    if dtype.is_floating_point or dtype.is_complex:
        return float("nan")
    return False if dtype == torch.bool else -1


def _scatter(values: torch.Tensor, index: torch.Tensor, size: int) -> torch.Tensor:
    """[size, ...] buffer filled with the dtype's fill value, ``values`` written at ``index``."""
    out = torch.full((size, *values.shape[1:]), _fill_value(values.dtype), dtype=values.dtype, device=values.device)
    out[index] = values
    return out


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
) -> PackedBatch:
    """Build the packed tensors of ``plan`` (all rows, or the given ``rows``).

    Args:
        plan: the plan.
        sequences: the S planned sequences' token ids (list-like; only the sequences of
            the materialized rows are read), each of its submitted or placed length.
        payloads: target-aligned per-token arrays by name (module docstring).
        device: where the tensors live (default CPU).
        trainable: as given to the planner (per sequence a bool array or a prompt
            length; None: nothing trainable). Needed for ``targets``/``loss_mask`` and
            for every sequence (the loss normalizations count all sequences' tokens).
        groups: per sequence a group id (int/str/None), for per-group normalization;
            default: each sequence its own group.
        input_payloads: token-aligned per-token arrays by name (module docstring).
        rows: [K] global rows to materialize, -1 for an empty padding row (a rank's
            ``plan.ranks.rank_rows[rank]``); default all rows.
        pad_id: token id at padding positions.
        check_tokens: verify that reading each materialized sequence back from the rows
            reproduces its tokens (one gather; catches sequences that differ from the
            planned ones in content).

    Returns:
        The :class:`PackedBatch`.

    Raises:
        RequestError: (or a subclass) for inputs that do not match the plan, naming them.
    """
    dev = _device(device)
    S, C = plan.num_sequences, plan.seq_len
    if isinstance(sequences, (str, bytes)) or not hasattr(sequences, "__len__") or len(sequences) != S:
        got = len(sequences) if hasattr(sequences, "__len__") else type(sequences).__name__
        raise RequestError(f"sequences has {got} entries, the plan has {S}", path="$.sequences", rule="length_mismatch")
    rows_arr = _check_rows(rows, plan)
    K = rows_arr.shape[0]
    seg = plan.segments
    flags = normalize_trainable(trainable, plan)
    counts = scored_counts(flags, plan, trainable)
    codes = group_codes(groups, S)

    # Segments of the local rows, in row order (pre-order inside each row).
    local_of_row = np.full(plan.num_rows, -1, dtype=np.int64)
    real = np.flatnonzero(rows_arr >= 0)
    local_of_row[rows_arr[real]] = real
    nseg = seg.row_ptr[rows_arr[real] + 1] - seg.row_ptr[rows_arr[real]]
    sel = np.repeat(seg.row_ptr[rows_arr[real]], nseg) + ragged_arange(nseg)
    sel_base = np.repeat(real, nseg) * C + seg.row_start[sel]
    tok_n = seg.length[sel]
    tok_flat = np.repeat(sel_base, tok_n) + ragged_arange(tok_n)
    tok_src = np.repeat(seg.seq[sel], tok_n)
    tok_pos = np.repeat(seg.seq_start[sel], tok_n) + ragged_arange(tok_n)
    tok_se = np.repeat(seg.subtree_end[sel], tok_n)

    # Sequences of the local rows, concatenated in index order: the gather source.
    local_seqs = np.flatnonzero((plan.row_of >= 0) & np.isin(plan.row_of, rows_arr[real]))
    lens = plan.seq_lens[local_seqs]
    ptr = np.zeros(local_seqs.shape[0] + 1, dtype=np.int64)
    np.cumsum(lens, out=ptr[1:])
    slot = np.full(S, -1, dtype=np.int64)
    slot[local_seqs] = np.arange(local_seqs.shape[0])
    # Row positions of every local sequence's tokens (the vectorized locate).
    nss = seg.seq_ptr[local_seqs + 1] - seg.seq_ptr[local_seqs]
    ss = seg.seq_segs[np.repeat(seg.seq_ptr[local_seqs], nss) + ragged_arange(nss)]
    ss_n = seg.length[ss]
    seq_flat = np.repeat(local_of_row[seg.row[ss]] * C + seg.row_start[ss], ss_n) + ragged_arange(ss_n)

    # Scored entries: position p of sequence s whose next token p+1 is trainable.
    tr_cat = np.concatenate([flags(int(s)) for s in local_seqs]) if local_seqs.shape[0] else np.zeros(0, bool)
    nxt = np.zeros(tr_cat.shape[0], dtype=bool)
    nxt[:-1] = tr_cat[1:]
    if ptr.shape[0] > 1:
        nxt[ptr[1:] - 1] = False  # a sequence's last token predicts nothing
    c_sel = np.flatnonzero(nxt)
    seq_of_c = np.repeat(np.arange(local_seqs.shape[0]), lens)
    score_seq = local_seqs[seq_of_c[c_sel]]
    score_flat = seq_flat[c_sel]

    tokens = _concat(sequences, local_seqs, plan, dev, what="sequences")
    if tokens.ndim != 1 or tokens.dtype.is_floating_point or tokens.dtype.is_complex or tokens.dtype == torch.bool:
        raise InputTypeError(f"expected 1-D integer token ids, got {tokens.dtype} with per-token shape {tuple(tokens.shape[1:])}", path="$.sequences", rule="dtype")
    tokens = tokens.to(torch.int64)
    t = lambda a: torch.from_numpy(np.ascontiguousarray(a, dtype=np.int64)).to(dev)  # noqa: E731
    tok_flat_t, seq_flat_t, c_sel_t, score_flat_t = t(tok_flat), t(seq_flat), t(c_sel), t(score_flat)
    gather_src = t(ptr[slot[tok_src]] + tok_pos) if tok_src.shape[0] else t(np.zeros(0))

    size = K * C
    input_ids = torch.full((size,), int(pad_id), dtype=torch.int64, device=dev)
    input_ids[tok_flat_t] = tokens[gather_src]
    position_ids = torch.zeros(size, dtype=torch.int64, device=dev)
    position_ids[tok_flat_t] = t(tok_pos)
    subtree_end = torch.arange(1, C + 1, dtype=torch.int64, device=dev).repeat(K)
    subtree_end[tok_flat_t] = t(tok_se)
    if check_tokens and tokens.shape[0]:
        back = input_ids[seq_flat_t]
        bad = torch.nonzero(back != tokens).flatten()
        if bad.numel():
            c = int(bad[0])
            s = int(local_seqs[seq_of_c[c]])
            raise RequestError(
                f"sequence {s} differs from the planned one at position {c - int(ptr[slot[s]])} "
                f"(token {int(tokens[c])}, the plan's segment holds {int(back[c])}): the sequences do not match the plan",
                path=f"$.sequences[{s}]",
                rule="plan_mismatch",
            )

    score_target = tokens[c_sel_t + 1]
    targets = _scatter(score_target, score_flat_t, size)
    _check_shared_targets(score_flat, score_target, score_seq)
    loss_mask = torch.zeros(size, dtype=torch.bool, device=dev)
    loss_mask[score_flat_t] = True
    owner = _scatter(t(score_seq), score_flat_t, size)

    packed: dict[str, torch.Tensor] = {}
    entries: dict[str, torch.Tensor] = {}
    for name, value in (payloads or {}).items():
        cat = _concat(value, local_seqs, plan, dev, what=f"payloads.{name}")
        entries[name] = cat[c_sel_t + 1]
        packed[name] = _scatter(entries[name], score_flat_t, size).view(K, C, *cat.shape[1:])
    for name, value in (input_payloads or {}).items():
        if name in packed:
            raise RequestError(f"payload name {name!r} is both target- and token-aligned", path=f"$.input_payloads.{name}", rule="unique")
        cat = _concat(value, local_seqs, plan, dev, what=f"input_payloads.{name}")
        packed[name] = _scatter(cat[gather_src], tok_flat_t, size).view(K, C, *cat.shape[1:])

    return PackedBatch(
        plan=plan,
        rows=rows_arr,
        input_ids=input_ids.view(K, C),
        position_ids=position_ids.view(K, C),
        subtree_end=subtree_end.view(K, C),
        targets=targets.view(K, C),
        loss_mask=loss_mask.view(K, C),
        owner=owner.view(K, C),
        payloads=packed,
        entry_payloads=entries,
        local_seqs=local_seqs,
        seq_ptr=ptr,
        seq_flat=seq_flat_t,
        score_seq=t(score_seq),
        score_pos=t(c_sel - ptr[seq_of_c[c_sel]] + 1),
        score_flat=score_flat_t,
        score_target=score_target,
        score_counts=t(counts),
        groups=t(codes),
        device=dev,
    )


def group_codes(groups: Sequence[Any] | None, S: int) -> np.ndarray:
    """[S] int64 dense group codes in order of first appearance (None: each sequence its own group).

    Raises:
        RequestError: a count other than S. InputTypeError: a group id that is not an int or a string.
    """
    if groups is None:
        return np.arange(S, dtype=np.int64)
    if len(groups) != S:
        raise RequestError(f"groups has {len(groups)} entries for the plan's {S} sequences", path="$.groups", rule="length_mismatch")
    codes = np.empty(S, dtype=np.int64)
    index: dict[Any, int] = {}
    for s, g in enumerate(groups):
        if g is None:
            g = ("__own__", s)
        elif isinstance(g, np.integer):
            g = int(g)
        elif isinstance(g, (bool, np.bool_)) or not isinstance(g, (int, str)):
            raise InputTypeError(f"group must be an int or a string, got {type(g).__name__}", path=f"$.groups[{s}]", rule="type")
        codes[s] = index.setdefault(g, len(index))
    return codes


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
