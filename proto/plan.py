"""The plan: everything the trainer needs, in metadata space (SPEC sections 3 and 5).

A :class:`Plan` holds integers only: sequence indices, positions, lengths. Per-token
arrays ([R, C]) derive from the segment table with vectorized numpy on demand
(:meth:`Plan.token_source`, :meth:`Plan.position_ids`, :meth:`Plan.subtree_end`).

These are the contract types: the planner (:mod:`treepack.service.planner`) builds them,
the wire codecs carry them, the client and the trainer read them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from treepack.proto.index import ragged_arange, segment_rows, segment_tokens
from treepack.proto.options import PlanOptions
from treepack.proto.strategy import Strategy

__all__ = ["Plan", "PlanStats", "OverflowEvent", "Segments", "AttentionMeta", "GdnLevel", "GdnMeta", "Ranks"]


@dataclass(frozen=True, slots=True, kw_only=True)
class OverflowEvent:
    """A sequence longer than ``seq_len`` that was truncated or dropped."""

    index: int
    length: int
    action: str  # "truncate" | "drop"


@dataclass(frozen=True, slots=True, kw_only=True)
class Segments:
    """Every row's segments, rows in order, each row's segments in pre-order.

    Attributes (G segments, R rows, S sequences):
        row: [G] int64 row of each segment.
        row_start: [G] int64 first row index of the segment.
        length: [G] int64 tokens (>= 1).
        seq: [G] int64 a sequence of the same row holding these tokens (its ``source``).
        seq_start: [G] int64 position in ``seq`` of the segment's first token.
        parent: [G] int64 parent segment (global index), -1 for a row's roots.
        depth: [G] int64 depth in the row's tree, roots 0.
        subtree_end: [G] int64 one past the last row index of the segment's subtree.
        sharers: [G] int64 sequences of the row through the segment.
        row_ptr: [R+1] int64 CSR: segments of row r are row_ptr[r]..row_ptr[r+1]-1.
        row_len: [R] int64 tokens used in each row.
        seq_ptr: [S+1] int64 CSR into ``seq_segs``.
        seq_segs: [P] int64 each sequence's segments, root to leaf (empty if dropped).
    """

    row: np.ndarray
    row_start: np.ndarray
    length: np.ndarray
    seq: np.ndarray
    seq_start: np.ndarray
    parent: np.ndarray
    depth: np.ndarray
    subtree_end: np.ndarray
    sharers: np.ndarray
    row_ptr: np.ndarray
    row_len: np.ndarray
    seq_ptr: np.ndarray
    seq_segs: np.ndarray

    @property
    def num_segments(self) -> int:
        return int(self.row.shape[0])

    def segments_of(self, s: int) -> np.ndarray:
        """Segments of sequence s, root to leaf."""
        return self.seq_segs[self.seq_ptr[s] : self.seq_ptr[s + 1]]


@dataclass(frozen=True, slots=True, kw_only=True)
class AttentionMeta:
    """Ancestor chains of every segment (CSR).

    Attributes:
        anc_ptr: [G+1] int64 offsets into ``anc_segs``.
        anc_segs: [A] int64 each segment's chain, root first, the segment itself last.
        key_lens: [G] int64 keys each segment's queries see at its last token
            (= the chain's token count = ``seq_start + length``).
    """

    anc_ptr: np.ndarray
    anc_segs: np.ndarray
    key_lens: np.ndarray

    def chain(self, g: int) -> np.ndarray:
        return self.anc_segs[self.anc_ptr[g] : self.anc_ptr[g + 1]]


@dataclass(frozen=True, slots=True, kw_only=True)
class GdnLevel:
    """One tree depth across all rows.

    Attributes:
        depth: the level's depth (0 = row roots).
        segs: [n] int64 segments of this depth, in row-major order.
        cu_seqlens: [n+1] int32 cumulative lengths, starting at 0.
        parent: [n] int64 parent segment (global index), -1 at depth 0.
        parent_slot: [n] int64 index of the parent within the previous level's ``segs``.
        conv_context: [n, W-1] int64 flat row positions of the conv context, -1 = zero.
    """

    depth: int
    segs: np.ndarray
    cu_seqlens: np.ndarray
    parent: np.ndarray
    parent_slot: np.ndarray
    conv_context: np.ndarray


@dataclass(frozen=True, slots=True, kw_only=True)
class GdnMeta:
    """GDN execution schedule: ``levels[d]`` for d = 0 .. max depth."""

    conv_width: int
    levels: tuple[GdnLevel, ...]


@dataclass(frozen=True, slots=True, kw_only=True)
class Ranks:
    """Rank assignment: rows dealt to the P data-parallel ranks, each row split over a
    context-parallel (CP) group of ``cp_size`` ranks.

    Attributes:
        num_ranks: P, the data-parallel ranks.
        rank_rows: [P, K] int64 rows of each rank, -1 for an empty (padding) row.
        row_cost: [R] float64 estimated cost of each row.
        rank_cost: [P] float64 summed cost per rank.
        cp_size: ranks of each CP group (1: rows are not split).
        shard_len: tokens of each CP rank's shard: CP rank k holds row positions
            ``[k * shard_len, (k + 1) * shard_len)`` of the row padded to
            ``cp_size * shard_len`` tokens (positions past ``seq_len`` are padding);
            :func:`~treepack.proto.options.cp_shard_len` (``seq_len`` when ``cp_size`` is 1).
            Which positions: :meth:`shard_positions`.
        cp_attention: the attention strategy under CP (``PlanOptions.cp_attention``).
        cp_tiles: [R, padded_len / CP_ALIGN] int32, the CP rank holding each
            ``CP_ALIGN``-token tile of each row: the split balanced by attention work
            (``cp_attention == "allgather"``), every rank holding ``shard_len / CP_ALIGN``
            tiles of every row, in row order. Empty ([R, 0] or [0, 0]): contiguous shards,
            CP rank k holding positions ``[k * shard_len, (k + 1) * shard_len)``.
    """

    num_ranks: int
    rank_rows: np.ndarray
    row_cost: np.ndarray
    rank_cost: np.ndarray
    cp_size: int = 1
    shard_len: int = 0
    cp_attention: str = "auto"
    cp_tiles: np.ndarray = field(default_factory=lambda: np.zeros((0, 0), dtype=np.int32))

    @property
    def padded_len(self) -> int:
        """Tokens of a row split over its CP group (``cp_size * shard_len``)."""
        return self.cp_size * self.shard_len

    @property
    def contiguous(self) -> bool:
        """Whether every CP rank holds one contiguous range of each row (no ``cp_tiles``)."""
        return self.cp_tiles.size == 0

    def shard_positions(self, rows: np.ndarray) -> np.ndarray:
        """[cp_size, K, shard_len] int64: the padded-row positions each CP rank holds of
        each of ``rows`` ([K] global rows, -1 for an empty row: contiguous), ascending.

        Column i of CP rank k's shard of local row j is row position ``out[k, j, i]``.
        """
        rows = np.asarray(rows, dtype=np.int64)
        P, Ls = self.cp_size, self.shard_len
        out = np.broadcast_to(np.arange(P * Ls, dtype=np.int64).reshape(P, 1, Ls), (P, rows.shape[0], Ls)).copy()
        if self.contiguous or P == 1:
            return out
        tile = self.cp_tiles.shape[1] and (P * Ls) // self.cp_tiles.shape[1]
        real = np.flatnonzero(rows >= 0)
        if real.size:
            # Tiles grouped by rank, in row order within a rank (a stable sort).
            order = np.argsort(self.cp_tiles[rows[real]], axis=1, kind="stable").reshape(real.size, P, Ls // tile)
            pos = order[..., None] * tile + np.arange(tile)
            out[:, real] = pos.reshape(real.size, P, Ls).transpose(1, 0, 2)
        return out


@dataclass(frozen=True, slots=True, kw_only=True)
class PlanStats:
    """Summary figures of a plan.

    Attributes:
        sequences: sequences in the request.
        kept_sequences: sequences placed (all but dropped ones).
        unpacked_tokens: tokens of the kept sequences, each counted in full.
        tree_tokens: tokens of the global tree (each shared run once).
        packed_tokens: tokens laid out in rows (shared runs once per row holding them).
        rows: rows used.
        lower_bound_rows: proven lower bound on the rows any placement needs.
        padding_tokens: rows * seq_len - packed_tokens.
        saved_fraction: 1 - packed_tokens / unpacked_tokens.
        timings_ms: planner phases (``normalize``, ``tree``, ``placement``, ``layout``,
            ``metadata``, ``total``), milliseconds.
        predicted_ms: the step time a cost model predicts for the plan
            (:meth:`treepack.proto.cost.CostModel.predict_ms`), None when planned without one.
    """

    sequences: int
    kept_sequences: int
    unpacked_tokens: int
    tree_tokens: int
    packed_tokens: int
    rows: int
    lower_bound_rows: int
    padding_tokens: int
    saved_fraction: float
    timings_ms: dict[str, float] = field(default_factory=dict)
    predicted_ms: float | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class Plan:
    """A packed batch, with what it was planned with.

    Attributes (S sequences):
        options: the checked options it was planned with (``seq_len``, ``placement``,
            ``min_shared_len``, ``share_trainable`` ... also read as properties).
        num_rows: R.
        strategy: the planner's reason, free text: the candidate ``auto`` picked (with a
            cost model, the predicted ms of the winner and the runner-up), else the placement.
        packing: the same, typed: ``"tree"`` and the ``min_shared_len`` used, or ``"plain"``
            (:class:`~treepack.proto.strategy.Strategy`).
        seq_lens: [S] int64 placed length of each sequence (after truncation; 0 if dropped).
        orig_lens: [S] int64 submitted lengths.
        row_of: [S] int64 row of each sequence, -1 if dropped.
        first_trainable: [S] int64 index of each sequence's first trainable token
            (``seq_lens[s]`` when none), of the placed tokens.
        trainable: [sum seq_lens] bool trainable flags of the placed tokens, sequence after
            sequence, when they were given as flags; None when every sequence was given
            by a prompt length (or nothing was trainable): then token p of s is trainable
            iff ``p >= first_trainable[s]``. :meth:`trainable_of` reads either form.
        group_codes: [S] int64 dense group ids in order of first appearance (a sequence
            without a group has a code of its own).
        segments: the segment table of every row.
        attention: ancestor chains (varlen attention).
        gdn: GDN levels and conv context.
        ranks: rows per rank.
        stats: summary figures.
        overflow: sequences truncated or dropped.
    """

    options: PlanOptions
    num_rows: int
    strategy: str
    packing: Strategy
    seq_lens: np.ndarray
    orig_lens: np.ndarray
    row_of: np.ndarray
    first_trainable: np.ndarray
    trainable: np.ndarray | None
    group_codes: np.ndarray
    segments: Segments
    attention: AttentionMeta
    gdn: GdnMeta
    ranks: Ranks
    stats: PlanStats
    overflow: tuple[OverflowEvent, ...] = ()

    @property
    def seq_len(self) -> int:
        """Row capacity C."""
        return self.options.seq_len

    @property
    def placement(self) -> str:
        """The placement asked for."""
        return self.options.placement

    @property
    def min_shared_len(self) -> int:
        """Rule-4 threshold used."""
        return self.options.min_shared_len

    @property
    def share_trainable(self) -> bool:
        """Planned in the generalized mode (scored positions may be shared)."""
        return self.options.share_trainable

    @property
    def seq_ptr(self) -> np.ndarray:
        """[S+1] int64 offsets of each sequence's placed tokens in :attr:`trainable`."""
        out = np.zeros(self.seq_lens.shape[0] + 1, dtype=np.int64)
        np.cumsum(self.seq_lens, out=out[1:])
        return out

    def trainable_of(self, s: int) -> np.ndarray:
        """[seq_lens[s]] bool trainable flags of sequence s's placed tokens."""
        n = int(self.seq_lens[s])
        if self.trainable is not None:
            a = int(self.seq_ptr[s])
            return self.trainable[a : a + n]
        return np.arange(n) >= self.first_trainable[s]

    @property
    def num_sequences(self) -> int:
        return int(self.seq_lens.shape[0])

    @property
    def row_len(self) -> np.ndarray:
        """[R] int64 tokens used in each row."""
        return self.segments.row_len

    def _per_token(self) -> tuple[np.ndarray, np.ndarray]:
        """(segment [R*C] int64 with -1 at padding, offset within segment [R*C] int64)."""
        seg = self.segments
        C = self.seq_len
        flat = np.full(self.num_rows * C, -1, dtype=np.int64)
        off = np.zeros(self.num_rows * C, dtype=np.int64)
        every = np.arange(seg.num_segments, dtype=np.int64)
        pos = segment_tokens(seg, C, every)
        flat[pos] = np.repeat(every, seg.length)
        off[pos] = ragged_arange(seg.length)
        return flat, off

    def segment_ids(self) -> np.ndarray:
        """[R, C] int64 segment of each row position, -1 at padding."""
        return self._per_token()[0].reshape(self.num_rows, self.seq_len)

    def token_source(self) -> tuple[np.ndarray, np.ndarray]:
        """([R, C] source sequence, [R, C] position in it), -1 / 0 at padding.

        ``tokens[seq][pos]`` is the token at each row position: the materialization gather.
        """
        g, off = self._per_token()
        seg = self.segments
        valid = g >= 0
        gi = np.maximum(g, 0)
        seq = np.where(valid, seg.seq[gi], -1)
        pos = np.where(valid, seg.seq_start[gi] + off, 0)
        shape = (self.num_rows, self.seq_len)
        return seq.reshape(shape), pos.reshape(shape)

    def position_ids(self) -> np.ndarray:
        """[R, C] int64 position of each token in its own sequence (0 at padding)."""
        return self.token_source()[1]

    def subtree_end(self) -> np.ndarray:
        """[R, C] int64 one past the last row index of each token's segment subtree.

        Mask contract: query i attends key j iff ``j <= i < subtree_end[j]``; padding
        attends only itself (``subtree_end[i] = i + 1``).
        """
        g, _ = self._per_token()
        C = self.seq_len
        idx = np.tile(np.arange(C, dtype=np.int64), self.num_rows)
        out = np.where(g >= 0, self.segments.subtree_end[np.maximum(g, 0)], idx + 1)
        return out.reshape(self.num_rows, C)

    def locate(self, s: int) -> tuple[int, np.ndarray]:
        """(row, [len(s)] int64 row indices holding sequence s's tokens, in order).

        Raises:
            ValueError: if s was dropped.
        """
        r = int(self.row_of[s])
        if r < 0:
            raise ValueError(f"sequence {s} was dropped (on_overflow='drop'); it has no row")
        seg = self.segments
        return r, segment_rows(seg, seg.segments_of(s))

    def segment_sharers(self) -> tuple[np.ndarray, np.ndarray]:
        """(ptr [G+1] int64, seqs [sum sharers] int64): the sequences through each segment.

        Sharers are listed in increasing sequence index. In the generalized mode a shared
        loss position's weight is the sum of these sequences' weights.
        """
        seg = self.segments
        counts = np.diff(seg.seq_ptr)
        owner = np.repeat(np.arange(self.num_sequences, dtype=np.int64), counts)
        order = np.lexsort((owner, seg.seq_segs))
        ptr = np.zeros(seg.num_segments + 1, dtype=np.int64)
        np.cumsum(np.bincount(seg.seq_segs, minlength=seg.num_segments), out=ptr[1:])
        return ptr, owner[order]

    def token_index(self) -> tuple[np.ndarray, np.ndarray]:
        """For all sequences at once: (seq_ptr [S+1], flat row positions [sum len]).

        Sequence s's tokens are at flat positions ``row * C + index``
        ``out[seq_ptr[s]:seq_ptr[s+1]]``, in order (the vectorized :meth:`locate`).
        """
        flat = segment_tokens(self.segments, self.seq_len, self.segments.seq_segs)
        return np.concatenate([[0], np.cumsum(self.seq_lens)]).astype(np.int64), flat
