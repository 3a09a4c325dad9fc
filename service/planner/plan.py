"""The plan: everything the trainer needs, in metadata space (SPEC sections 3 and 5).

A :class:`Plan` holds integers only: sequence indices, positions, lengths. Per-token
arrays ([R, C]) derive from the segment table with vectorized numpy on demand
(:meth:`Plan.token_source`, :meth:`Plan.position_ids`, :meth:`Plan.subtree_end`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from treepack.service.planner.arrays import ragged_arange
from treepack.service.planner.inputs import OverflowEvent
from treepack.service.planner.layout import Segments
from treepack.service.planner.metadata import AttentionMeta, GdnMeta
from treepack.service.planner.ranks import Ranks
from treepack.service.planner.tree import Tree

__all__ = ["Plan", "PlanStats"]


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


@dataclass(frozen=True, slots=True, kw_only=True)
class Plan:
    """A packed batch.

    Attributes:
        seq_len: row capacity C.
        num_rows: R.
        placement: the placement asked for.
        strategy: the candidate ``auto`` picked (else the placement).
        min_shared_len: rule-4 threshold used.
        share_trainable: planned in the generalized mode (scored positions may be shared).
        seq_lens: [S] int64 placed length of each sequence (after truncation; 0 if dropped).
        orig_lens: [S] int64 submitted lengths.
        row_of: [S] int64 row of each sequence, -1 if dropped.
        segments: the segment table of every row.
        attention: ancestor chains (varlen attention).
        gdn: GDN levels and conv context.
        ranks: rows per rank.
        stats: summary figures.
        overflow: sequences truncated or dropped.
        tree: the global tree (planner side only; not sent over the wire).
    """

    seq_len: int
    num_rows: int
    placement: str
    strategy: str
    min_shared_len: int
    seq_lens: np.ndarray
    orig_lens: np.ndarray
    row_of: np.ndarray
    segments: Segments
    attention: AttentionMeta
    gdn: GdnMeta
    ranks: Ranks
    stats: PlanStats
    overflow: tuple[OverflowEvent, ...] = ()
    tree: Tree | None = None
    share_trainable: bool = False

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
        pos = np.repeat(seg.row * C + seg.row_start, seg.length) + ragged_arange(seg.length)
        flat[pos] = np.repeat(np.arange(seg.num_segments, dtype=np.int64), seg.length)
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
        segs = seg.segments_of(s)
        lens = seg.length[segs]
        return r, np.repeat(seg.row_start[segs], lens) + ragged_arange(lens)

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
        seg = self.segments
        segs = seg.seq_segs
        lens = seg.length[segs]
        flat = np.repeat(seg.row[segs] * self.seq_len + seg.row_start[segs], lens) + ragged_arange(lens)
        return np.concatenate([[0], np.cumsum(self.seq_lens)]).astype(np.int64), flat
