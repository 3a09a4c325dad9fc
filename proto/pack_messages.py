"""The messages of ``POST /v1/pack``: the request (a columnar batch and its options) and the plan it gets back.

Field types and wire conventions: :mod:`treepack.proto.wire_fields`.
"""

from __future__ import annotations

from typing import Annotated, Literal, Optional

from pydantic import Field

from treepack.proto.options import MAX_REPAIR_MS, MAX_SEQ_LEN, REPAIR_MS
from treepack.proto.wire_fields import (
    Buffer,
    ConvWidth,
    ConvWidthOption,
    Count,
    CountBuffer,
    CpAttentionOption,
    CpSize,
    CpSizeOption,
    FlagsBuffer,
    GroupIdInput,
    I8Buffer,
    MinShared,
    MinSharedOption,
    NumRanks,
    NumRanksOption,
    OffsetsBuffer,
    OverflowOption,
    PlacementOption,
    RepairOption,
    SavingOption,
    SeqLen,
    SeqLenOption,
    ShareOption,
    StrategyMessage,
    Tag,
    TokensBuffer,
    U8Buffer,
    Version,
    WireModel,
)

__all__ = [
    "PackRequest",
    "PackResponse",
    "PlanMessage",
    "ArrayMessage",
    "SegmentsMessage",
    "AttentionMessage",
    "GdnLevelMessage",
    "GdnMessage",
    "RanksMessage",
    "StatsMessage",
    "OverflowMessage",
]


class PackRequest(WireModel):
    """``POST /v1/pack``: a batch and how to pack it (the arguments of ``plan_batch``)."""

    version: Version
    seq_len: SeqLenOption
    tokens: TokensBuffer = Field(description="<u4 [T]: all token ids, sequence after sequence")
    offsets: OffsetsBuffer = Field(
        description="<i8 [S+1]: sequence i is tokens[offsets[i]:offsets[i+1]]; 0 first, T last, non-decreasing"
    )
    trainable: Optional[FlagsBuffer] = Field(
        None, description="|u1 [T]: 1 where a token is a loss target (0/1); exclusive with prompt_lens"
    )
    prompt_lens: Optional[CountBuffer] = Field(
        None, description="<i8 [S]: tokens prompt_lens[i].. of sequence i are trainable; exclusive with trainable"
    )
    keys: Optional[U8Buffer] = Field(
        None, description="<u8 [T]: per-token keys that must also match to share (default all 0)"
    )
    prefix_src: Optional[I8Buffer] = Field(
        None,
        description="<i8 [S]: sequence i starts with the first prefix_len[i] tokens of sequence prefix_src[i] "
        "(< i; -1: none), "
        "then its own tokens; with prefix_len (dedup of shared prompts; trainable and keys still cover every token)",
    )
    prefix_len: Optional[I8Buffer] = Field(None, description="<i8 [S]: see prefix_src (0 where prefix_src is -1)")
    groups: Optional[list[GroupIdInput]] = Field(None, description="[S] group id (int, string or null) per sequence")
    tags: Optional[list[Tag]] = Field(
        None, description="[S] task tag per sequence (recorded in history for what-if by tag)"
    )
    min_shared_len: MinSharedOption = 64
    placement: PlacementOption = "auto"
    num_ranks: NumRanksOption = 1
    on_overflow: OverflowOption = "error"
    conv_width: ConvWidthOption = 4
    share_trainable: ShareOption = False
    min_shared_saving: SavingOption = 0
    repair_ms: RepairOption = REPAIR_MS
    cp_size: CpSizeOption = 1
    cp_attention: CpAttentionOption = "auto"
    record: bool = Field(True, description="record this batch's shape in the history (false: opt out)")


class ArrayMessage(WireModel):
    """A typed array: ``data`` holds ``prod(shape)`` items of ``dtype``, C order."""

    dtype: Literal["<u4", "<i8", "<u8", "<i4", "<f8", "|u1"]
    shape: list[Count]
    data: Buffer


class SegmentsMessage(WireModel):
    """The segment table (``treepack.service.planner.Segments``); every array ``<i8``, 1-D."""

    row: ArrayMessage
    row_start: ArrayMessage
    length: ArrayMessage
    seq: ArrayMessage
    seq_start: ArrayMessage
    parent: ArrayMessage
    depth: ArrayMessage
    subtree_end: ArrayMessage
    sharers: ArrayMessage
    row_ptr: ArrayMessage
    row_len: ArrayMessage
    seq_ptr: ArrayMessage
    seq_segs: ArrayMessage


class AttentionMessage(WireModel):
    """Ancestor chains (``AttentionMeta``); ``<i8``, 1-D."""

    anc_ptr: ArrayMessage
    anc_segs: ArrayMessage
    key_lens: ArrayMessage


class GdnLevelMessage(WireModel):
    """One GDN depth level; ``cu_seqlens`` is ``<i4``, ``conv_context`` ``<i8`` [n, W-1], the rest ``<i8`` 1-D."""

    depth: Count
    segs: ArrayMessage
    cu_seqlens: ArrayMessage
    parent: ArrayMessage
    parent_slot: ArrayMessage
    conv_context: ArrayMessage


class GdnMessage(WireModel):
    conv_width: ConvWidth
    levels: list[GdnLevelMessage]


class RanksMessage(WireModel):
    """Rows per rank: ``rank_rows`` ``<i8`` [P, K] (-1 = padding row), costs ``<f8``."""

    num_ranks: NumRanks
    cp_size: CpSize = 1
    shard_len: Optional[Count] = Field(
        None, description="tokens of each CP rank's shard of a row (seq_len when cp_size is 1)"
    )
    cp_attention: Literal["auto", "ulysses", "allgather"] = "auto"
    cp_tiles: Optional[ArrayMessage] = Field(
        None,
        description="<i4 [R, cp_size * shard_len / 16]: the CP rank holding each 16-token tile of each row "
        "(allgather's balanced split; absent: contiguous shards)",
    )
    rank_rows: ArrayMessage
    row_cost: ArrayMessage
    rank_cost: ArrayMessage


class StatsMessage(WireModel):
    sequences: Count
    kept_sequences: Count
    unpacked_tokens: Count
    tree_tokens: Count
    packed_tokens: Count
    rows: Count
    lower_bound_rows: Count
    padding_tokens: Count
    saved_fraction: float
    timings_ms: dict[str, float]
    predicted_ms: Optional[Annotated[float, Field(ge=0, allow_inf_nan=False)]] = None


class OverflowMessage(WireModel):
    index: Count
    length: Count
    action: Literal["truncate", "drop"]


class PlanMessage(WireModel):
    """A plan (:class:`treepack.proto.plan.Plan`), with what it was planned with."""

    version: Version
    seq_len: SeqLen
    num_rows: Count
    placement: Literal["auto", "bfd", "in_order", "no_share"]
    strategy: Annotated[str, Field(max_length=64, description="the planner's reason, free text")]
    packing: Optional[StrategyMessage] = Field(
        None, description="the strategy, typed (version 2; a version-1 answer has none)"
    )
    min_shared_len: MinShared
    share_trainable: bool = False
    on_overflow: Literal["error", "truncate", "drop"] = "error"
    min_shared_saving: Annotated[int, Field(ge=0, le=MAX_SEQ_LEN)] = 0
    repair_ms: Annotated[float, Field(ge=0, le=MAX_REPAIR_MS)] = REPAIR_MS
    seq_lens: ArrayMessage
    orig_lens: ArrayMessage
    row_of: ArrayMessage
    first_trainable: ArrayMessage = Field(
        description="<i8 [S]: index of each sequence's first trainable placed token (its length if none)"
    )
    trainable: Optional[ArrayMessage] = Field(
        None,
        description="|u1 [sum seq_lens]: trainable flags of the placed tokens when given as flags "
        "(null: from first_trainable on)",
    )
    group_codes: ArrayMessage = Field(
        description="<i8 [S]: dense group code per sequence, in order of first appearance"
    )
    segments: SegmentsMessage
    attention: AttentionMessage
    gdn: GdnMessage
    ranks: RanksMessage
    stats: StatsMessage
    overflow: list[OverflowMessage]


class PackResponse(WireModel):
    version: Version
    plan: PlanMessage
    recorded: bool = Field(description="the batch's shape was queued for the history")
