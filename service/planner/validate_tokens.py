"""Plan invariants against the planned sequences themselves.

Every token at ``idx(s, p)`` is ``s[p]`` (keys too), a shared segment is at least
``min_shared_len`` long (or, with ``min_shared_saving``, saves enough: at least that many
tokens over the sequences that could share its end) and holds no trainable token and no
scored position of any sharer (generalized mode: no scored position its sharers predict
differently); the per-token gather views read every sequence back.
"""

from __future__ import annotations

import numpy as np

from treepack.proto.batch import SequenceBatch
from treepack.proto.index import csr_gather, ragged_arange
from treepack.proto.plan import Plan
from treepack.service.planner.invariant import _check

__all__ = ["check_tokens", "check_gather"]

_BLOCK_TOKENS = 1 << 22  # tokens per vectorized pass of check_tokens (its memory: a few arrays of this many)


def _prefix_sharers(batch: SequenceBatch, plan: Plan, src: int, end: int) -> int:
    """Kept sequences that agree with ``src`` on positions ``0 .. end-1`` (tokens and keys)
    and may share them (default mode: within their shareable prefix)."""
    limit = batch.lens if plan.share_trainable else batch.shareable_lens()
    ref = batch.tokens[src][:end]
    src_keys = None if batch.keys is None else batch.keys[src]
    rkey = None if src_keys is None else src_keys[:end]
    count = 0
    for t in np.flatnonzero((plan.row_of >= 0) & (limit >= end)).tolist():
        if not np.array_equal(batch.tokens[t][:end], ref):
            continue
        if batch.keys is not None:
            k = batch.keys[t]
            mine = np.zeros(end, np.uint64) if k is None else k[:end]
            if not np.array_equal(mine, np.zeros(end, np.uint64) if rkey is None else rkey):
                continue
        count += 1
    return count


class _FlatBatch:
    """The batch's tokens (and keys, absent ones as zeros) in one array each, for checks
    that gather a whole sequence at once; an array is None where its parts do not share
    one dtype and length (then nothing is decided from it)."""

    __slots__ = ("offs", "lens", "tokens", "has_keys", "keys")

    def __init__(self, batch: SequenceBatch) -> None:
        self.lens = np.array([t.shape[0] for t in batch.tokens], dtype=np.int64)
        self.offs = np.concatenate([[0], np.cumsum(self.lens)]).astype(np.int64)
        self.tokens = _joined(list(batch.tokens), self.lens)
        self.has_keys = batch.keys is not None
        self.keys = None
        if batch.keys is not None:
            n = self.lens.tolist()
            self.keys = _joined([np.zeros(m, np.uint64) if k is None else k for k, m in zip(batch.keys, n)], self.lens)


def _joined(parts: list[np.ndarray], lens: np.ndarray) -> np.ndarray | None:
    """``parts`` concatenated, or None unless they are 1-d, of one dtype and of ``lens``."""
    if not parts:
        return np.zeros(0, np.uint64)
    if len({p.dtype for p in parts}) != 1 or any(p.shape != (m,) for p, m in zip(parts, lens.tolist())):
        return None
    return np.concatenate(parts)


def _undecided(plan: Plan, flat: _FlatBatch, sh: np.ndarray, seqs: np.ndarray) -> np.ndarray:
    """The sequences of ``seqs`` (kept, ascending) for which the per-segment checks of
    :func:`_check_sequence_segments` are not all seen to hold, ascending.

    One numpy pass over their (sequence, segment) pairs and tokens finds the sequences
    whose every segment has equal tokens and keys to its source and keeps the sharing rule
    without needing :func:`_prefix_sharers`; the rest (a check fails, a run past a sequence's
    end, parts of another dtype, a shared segment shorter than ``min_shared_len``) are left
    to the per-segment checks, which name the failing segment.
    """
    seg = plan.segments
    cnt = seg.seq_ptr[seqs + 1] - seg.seq_ptr[seqs]
    g = csr_gather(seg.seq_ptr, seg.seq_segs, seqs)
    p_s = np.repeat(seqs, cnt)
    a, n, src = seg.seq_start[g], seg.length[g], seg.seq[g]
    bad = (n < 0) | (src < 0) | (src >= flat.lens.shape[0])
    if flat.tokens is None or (flat.has_keys and flat.keys is None):
        bad[:] = True
    take = np.where(bad, 0, n)
    t_pair = np.repeat(np.arange(g.shape[0]), take)
    pos = a[t_pair] + ragged_arange(take)
    t_s, t_src = p_s[t_pair], src[t_pair]
    fail = (pos < 0) | (pos >= flat.lens[t_s]) | (pos >= flat.lens[t_src])
    ok = ~fail
    mine, theirs = flat.offs[t_s[ok]] + pos[ok], flat.offs[t_src[ok]] + pos[ok]
    differ = flat.tokens[mine] != flat.tokens[theirs] if flat.tokens is not None else np.zeros(0, bool)
    if flat.has_keys and flat.keys is not None:
        differ |= flat.keys[mine] != flat.keys[theirs]
    fail[ok] = differ
    bad |= np.bincount(t_pair, weights=fail, minlength=g.shape[0]) > 0
    shared = seg.sharers[g] >= 2
    if not plan.share_trainable:
        bad |= shared & (a + n > sh[p_s])
    if plan.placement != "no_share":
        bad |= shared & (n < plan.min_shared_len)
    return np.unique(p_s[bad])


def check_tokens(plan: Plan, batch: SequenceBatch) -> None:
    """Token-level rules against the batch: equal runs, sharing rules, what it was planned with."""
    seg = plan.segments
    S = plan.num_sequences
    _check(batch.num_sequences == S, "sequence count differs from the plan")
    _check(
        bool(np.array_equal(batch.lens[plan.row_of >= 0], plan.seq_lens[plan.row_of >= 0])), "sequence lengths differ"
    )
    kept = plan.row_of >= 0
    _check(
        bool(np.array_equal(batch.first_trainable[kept], plan.first_trainable[kept])),
        "first_trainable differs from the batch's",
    )
    for s in np.flatnonzero(kept).tolist():
        _check(
            bool(np.array_equal(batch.trainable_of(s), plan.trainable_of(s))), f"trainable flags of sequence {s} differ"
        )
    sh = batch.shareable_lens()
    flat = _FlatBatch(batch)
    could_share: dict[int, int] = {}
    seqs = np.flatnonzero(kept)
    # A block of sequences at a time bounds the pass's memory; the per-segment checks run
    # only where it could not see them hold, in sequence order (so the same one speaks first).
    csum = np.cumsum(flat.lens[seqs])
    start = 0
    while start < seqs.shape[0]:
        before = int(csum[start] - flat.lens[seqs[start]])
        stop = max(start + 1, int(np.searchsorted(csum, before + _BLOCK_TOKENS, side="right")))
        for s in _undecided(plan, flat, sh, seqs[start:stop]).tolist():
            _check_sequence_segments(plan, batch, s, int(sh[s]), could_share)
        start = stop
    if plan.share_trainable:
        # A shared position may be scored only if every sharer predicts the same next
        # token; inside a segment they do by construction, so check each segment's last.
        ptr_sh, who = plan.segment_sharers()
        for g in np.flatnonzero(seg.sharers >= 2).tolist():
            members = who[ptr_sh[g] : ptr_sh[g + 1]].tolist()
            q = int(seg.seq_start[g] + seg.length[g])
            scored = any(q < batch.lens[m] and batch.trainable_of(m)[q] for m in members)
            if scored:
                nxt = {int(batch.tokens[m][q]) if q < batch.lens[m] else -1 for m in members}
                _check(
                    len(nxt) == 1 and -1 not in nxt,
                    f"shared segment {g} ends on a scored position its sharers predict differently",
                )


def _check_sequence_segments(plan: Plan, batch: SequenceBatch, s: int, sh: int, could_share: dict[int, int]) -> None:
    """Sequence s against the batch, segment by segment: its tokens (and keys) equal its
    segments' sources', and each shared segment within the sharing rules.

    Args:
        plan, batch: the plan and its batch.
        s: a kept sequence.
        sh: its shareable prefix length.
        could_share: per short shared segment, the sequences that could share its end
            (filled on first use, shared across sequences).
    """
    seg = plan.segments
    msl = plan.min_shared_len
    saving = plan.options.min_shared_saving
    tok = batch.tokens[s]
    key = None if batch.keys is None else batch.keys[s]
    for g in seg.segments_of(s).tolist():
        a, n, src = int(seg.seq_start[g]), int(seg.length[g]), int(seg.seq[g])
        _check(
            bool(np.array_equal(tok[a : a + n], batch.tokens[src][a : a + n])),
            f"sequence {s} tokens differ in segment {g}",
        )
        if batch.keys is not None:
            k1 = np.zeros(n, np.uint64) if key is None else key[a : a + n]
            k2 = batch.keys[src]
            k2 = np.zeros(n, np.uint64) if k2 is None else k2[a : a + n]
            _check(bool(np.array_equal(k1, k2)), f"sequence {s} keys differ in segment {g}")
        if seg.sharers[g] >= 2:
            if not plan.share_trainable:
                _check(a + n <= sh, f"segment {g} shares a trainable token or scored position of sequence {s}")
            if n < msl and plan.placement != "no_share":
                _check(saving > 0, f"shared segment {g} shorter than min_shared_len")
                if g not in could_share:
                    could_share[g] = _prefix_sharers(batch, plan, src, a + n)
                # The segment's last tree node saves (sharers - 1) x its length >= saving,
                # and its sharers are among those that could share the segment's end.
                _check(
                    (could_share[g] - 1) * n >= saving,
                    f"shared segment {g} shorter than min_shared_len saves too little",
                )


def check_gather(plan: Plan, batch: SequenceBatch) -> None:
    """The gather itself: materialize row tokens and read every sequence back."""
    S = plan.num_sequences
    src_seq, src_pos = plan.token_source()
    offs = np.concatenate([[0], np.cumsum(batch.lens)])
    flat_tokens = np.concatenate(batch.tokens) if S else np.zeros(0, np.uint32)
    valid = src_seq >= 0
    rows_tok = np.zeros(src_seq.shape, dtype=np.int64)
    rows_tok[valid] = flat_tokens[offs[src_seq[valid]] + src_pos[valid]]
    ptr, flat = plan.token_index()
    kept = plan.row_of >= 0
    want = np.concatenate([batch.tokens[s] for s in range(S) if kept[s]]) if kept.any() else np.zeros(0)
    got_tok = rows_tok.reshape(-1)[flat]
    _check(bool(np.array_equal(got_tok, want.astype(np.int64))), "row tokens do not reproduce the sequences")
    pos = src_pos.reshape(-1)[flat]
    exp_pos = (
        np.concatenate([np.arange(int(plan.seq_lens[s])) for s in range(S) if kept[s]]) if kept.any() else np.zeros(0)
    )
    _check(bool(np.array_equal(pos, exp_pos)), "position_ids are not 0..len-1 per sequence")
    _check(bool(np.array_equal(np.diff(ptr), plan.seq_lens)), "token_index pointer mismatch")
