"""Every message on the wire, as pydantic v2 models (wire version :data:`WIRE_VERSION`).

These models are the single schema: the service validates requests with them, the client
validates responses with them, :mod:`treepack.proto.schema` writes them out as JSON Schema
files and the service's OpenAPI document embeds them.

Conventions:

- Every top-level message has ``"version": 1``; unknown fields are errors.
- Buffer fields (:data:`Buffer`) carry a whole column of one dtype: msgpack ``bin``
  (little-endian), or in JSON a base64 string or a list of numbers
  (:mod:`treepack.proto.buffers`).
- A batch travels columnar: ``tokens`` holds every sequence back to back, ``offsets``
  ([S+1], from 0 to the token count, non-decreasing) cuts it into sequences; sequence i
  is ``tokens[offsets[i]:offsets[i+1]]``, called ``$.sequences[i]`` in error paths.
  Optionally (``prefix_src``/``prefix_len``) a sequence starts with a prefix of an earlier
  sequence and ``tokens`` holds only the rest: a GRPO group's prompt travels once.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, PlainValidator, WithJsonSchema, model_validator
from pydantic_core import PydanticCustomError

from treepack.proto.options import (
    CP_ATTENTION,
    MAX_CONV_WIDTH,
    MAX_CP_SIZE,
    MAX_RANKS,
    MAX_REPAIR_MS,
    MAX_SEQ_LEN,
    ON_OVERFLOW,
    PLACEMENTS,
    REPAIR_MS,
)
from treepack.proto.version import WIRE_VERSION

__all__ = [
    "Buffer",
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
    "BatchShapeMessage",
    "Composition",
    "WhatIfRequest",
    "WhatIfResponse",
    "WhatIfResultMessage",
    "Distribution",
    "PoolMessage",
    "HistorySummary",
    "Retention",
    "HealthResponse",
    "ReadyResponse",
    "ErrorBody",
    "PLACEMENTS",
    "ON_OVERFLOW",
    "MAX_SEQ_LEN",
]

_INT64 = (-(2**63), 2**63 - 1)
_INT64_MIN = _INT64[0]


def _check_buffer(value: Any) -> Any:
    # Items are checked by treepack.proto.buffers.decode_buffer, which knows the dtype and
    # names the offending index; here only the container type.
    if isinstance(value, (bytes, bytearray, memoryview, str, list)):
        return value
    raise PydanticCustomError(
        "buffer_type",
        "expected a buffer (msgpack bin, base64 string or list of numbers), got {got}",
        {"got": type(value).__name__},
    )


Buffer = Annotated[
    Any,
    PlainValidator(_check_buffer),
    WithJsonSchema(
        {
            "anyOf": [
                {
                    "type": "string",
                    "contentEncoding": "base64",
                    "description": "little-endian items, base64 (JSON); msgpack sends a bin",
                },
                {"type": "array", "items": {"type": "number"}},
            ]
        }
    ),
]

_ITEM_SCHEMA = {
    "<u4": {"type": "integer", "minimum": 0, "maximum": 2**32 - 1},
    "<i8": {"type": "integer", "minimum": _INT64_MIN, "maximum": 2**63 - 1},
    "<u8": {"type": "integer", "minimum": 0, "maximum": 2**64 - 1},
    "|u1": {"type": "integer", "minimum": 0, "maximum": 1},
}


def _typed_buffer(dtype: str, *, min_items: int = 0, item_min: int | None = None) -> Any:
    """A request's buffer field of one dtype: its schema states the item type and range the
    server checks (a list of other numbers is refused), so a schema-valid list is accepted."""
    listed: dict[str, Any] = {
        "type": "array",
        "items": {**_ITEM_SCHEMA[dtype], **({} if item_min is None else {"minimum": item_min})},
    }
    text: dict[str, Any] = {
        "type": "string",
        "contentEncoding": "base64",
        "description": f"{dtype} items, little-endian, base64 (JSON); msgpack sends a bin",
    }
    if min_items:
        listed["minItems"] = min_items
        text["minLength"] = 4 * ((min_items * int(dtype[-1]) + 2) // 3)
    return Annotated[Any, PlainValidator(_check_buffer), WithJsonSchema({"anyOf": [text, listed]})]


TokensBuffer = _typed_buffer("<u4")
OffsetsBuffer = _typed_buffer("<i8", min_items=1)
I8Buffer = _typed_buffer("<i8")
U8Buffer = _typed_buffer("<u8")
FlagsBuffer = _typed_buffer("|u1")
RunLenBuffer = _typed_buffer("<i8", item_min=1)
CountBuffer = _typed_buffer("<i8", item_min=0)

Version = Annotated[Literal[1], Field(description=f"wire version; this build speaks {WIRE_VERSION}")]
SeqLen = Annotated[int, Field(ge=1, le=MAX_SEQ_LEN, description="row capacity C in tokens")]
MinShared = Annotated[int, Field(ge=1, le=MAX_SEQ_LEN, description="no shared segment shorter than this (SPEC rule 4)")]
NumRanks = Annotated[int, Field(ge=1, le=MAX_RANKS, description="ranks to deal rows to")]
CpSize = Annotated[
    int,
    Field(ge=1, le=MAX_CP_SIZE, description="context-parallel group size: each row split into this many equal shards"),
]
ConvWidth = Annotated[int, Field(ge=1, le=MAX_CONV_WIDTH, description="GDN short-conv width W")]
Count = Annotated[int, Field(ge=0, le=_INT64[1])]


def _option(schema: dict[str, Any]) -> Any:
    # A planner option as the caller sent it: the planner's one check
    # (treepack.service.planner.options.check_options) judges it, so the embedded planner
    # and the sidecar give the same error; the schema only documents the rule.
    return Annotated[Any, WithJsonSchema(schema)]


SeqLenOption = _option(
    {"type": "integer", "minimum": 1, "maximum": MAX_SEQ_LEN, "description": "row capacity C in tokens"}
)
MinSharedOption = _option(
    {
        "type": "integer",
        "minimum": 1,
        "maximum": MAX_SEQ_LEN,
        "default": 64,
        "description": "no shared segment shorter than this (SPEC rule 4)",
    }
)
PlacementOption = _option({"enum": list(PLACEMENTS), "default": "auto"})
NumRanksOption = _option(
    {"type": "integer", "minimum": 1, "maximum": MAX_RANKS, "default": 1, "description": "ranks to deal rows to"}
)
CpSizeOption = _option(
    {
        "type": "integer",
        "minimum": 1,
        "maximum": MAX_CP_SIZE,
        "default": 1,
        "description": "context-parallel group size: each row split into this many equal, aligned shards (num_ranks is then the data-parallel size)",
    }
)
CpAttentionOption = _option(
    {
        "enum": list(CP_ATTENTION),
        "default": "auto",
        "description": "attention under CP: ulysses, allgather (shards balanced by attention work), or auto (contiguous shards; ulysses where heads divide)",
    }
)
ConvWidthOption = _option(
    {"type": "integer", "minimum": 1, "maximum": MAX_CONV_WIDTH, "default": 4, "description": "GDN short-conv width W"}
)
OverflowOption = _option({"enum": list(ON_OVERFLOW), "default": "error"})
SavingOption = _option(
    {
        "type": "integer",
        "minimum": 0,
        "maximum": MAX_SEQ_LEN,
        "default": 0,
        "description": "0: off; else also share a run shorter than min_shared_len when (sharers - 1) x length >= this",
    }
)
RepairOption = _option(
    {
        "type": "number",
        "minimum": 0,
        "maximum": MAX_REPAIR_MS,
        "default": REPAIR_MS,
        "description": "budget of auto's repair pass in ms (0: none)",
    }
)
ShareOption = _option(
    {
        "type": "boolean",
        "default": False,
        "description": "generalized sharing mode: trainable tokens shared up to a scored divergence",
    }
)
Index = Annotated[int, Field(ge=-1, le=_INT64[1])]
GroupId = Union[Annotated[int, Field(ge=_INT64[0], le=_INT64[1])], Annotated[str, Field(max_length=256)], None]
# A request's group ids are judged by the planner's normalisation (treepack.proto.batch.group_codes),
# which gives the embedded planner's errors; the schema documents the same limits.
GroupIdInput = Annotated[
    Any,
    WithJsonSchema(
        {
            "anyOf": [
                {"type": "integer", "minimum": _INT64[0], "maximum": _INT64[1]},
                {"type": "string", "maxLength": 256},
                {"type": "null"},
            ]
        }
    ),
]
Tag = Optional[Annotated[str, Field(max_length=256)]]


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)


class PackRequest(_Model):
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
        description="<i8 [S]: sequence i starts with the first prefix_len[i] tokens of sequence prefix_src[i] (< i; -1: none), "
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


class ArrayMessage(_Model):
    """A typed array: ``data`` holds ``prod(shape)`` items of ``dtype``, C order."""

    dtype: Literal["<u4", "<i8", "<u8", "<i4", "<f8", "|u1"]
    shape: list[Count]
    data: Buffer


class SegmentsMessage(_Model):
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


class AttentionMessage(_Model):
    """Ancestor chains (``AttentionMeta``); ``<i8``, 1-D."""

    anc_ptr: ArrayMessage
    anc_segs: ArrayMessage
    key_lens: ArrayMessage


class GdnLevelMessage(_Model):
    """One GDN depth level; ``cu_seqlens`` is ``<i4``, ``conv_context`` ``<i8`` [n, W-1], the rest ``<i8`` 1-D."""

    depth: Count
    segs: ArrayMessage
    cu_seqlens: ArrayMessage
    parent: ArrayMessage
    parent_slot: ArrayMessage
    conv_context: ArrayMessage


class GdnMessage(_Model):
    conv_width: ConvWidth
    levels: list[GdnLevelMessage]


class RanksMessage(_Model):
    """Rows per rank: ``rank_rows`` ``<i8`` [P, K] (-1 = padding row), costs ``<f8``."""

    num_ranks: NumRanks
    cp_size: CpSize = 1
    shard_len: Optional[Count] = Field(
        None, description="tokens of each CP rank's shard of a row (seq_len when cp_size is 1)"
    )
    cp_attention: Literal["auto", "ulysses", "allgather"] = "auto"
    cp_tiles: Optional[ArrayMessage] = Field(
        None,
        description="<i4 [R, cp_size * shard_len / 16]: the CP rank holding each 16-token tile of each row (allgather's balanced split; absent: contiguous shards)",
    )
    rank_rows: ArrayMessage
    row_cost: ArrayMessage
    rank_cost: ArrayMessage


class StatsMessage(_Model):
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


class OverflowMessage(_Model):
    index: Count
    length: Count
    action: Literal["truncate", "drop"]


class PlanMessage(_Model):
    """A plan (:class:`treepack.proto.plan.Plan`), with what it was planned with."""

    version: Version
    seq_len: SeqLen
    num_rows: Count
    placement: Literal["auto", "bfd", "in_order", "no_share"]
    strategy: Annotated[str, Field(max_length=64)]
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
        description="|u1 [sum seq_lens]: trainable flags of the placed tokens when given as flags (null: from first_trainable on)",
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


class PackResponse(_Model):
    version: Version
    plan: PlanMessage
    recorded: bool = Field(description="the batch's shape was queued for the history")


class BatchShapeMessage(_Model):
    """A batch as shapes only (no tokens): per sequence its runs (hash, length).

    Sequence i's runs are ``run_hash/run_len[seq_ptr[i]:seq_ptr[i+1]]``, root first; a run
    is a tree node's token run (hash = 64-bit BLAKE2b of its tokens, and keys when any is
    non-zero), the shareable rest of its leaf, or its unshareable tail (hash 0).
    """

    seq_len: SeqLen
    min_shared_len: MinShared
    seq_ptr: OffsetsBuffer = Field(description="<i8 [S+1]")
    run_hash: U8Buffer = Field(description="<u8 [P]")
    run_len: RunLenBuffer = Field(description="<i8 [P], each >= 1")
    first_trainable: CountBuffer = Field(description="<i8 [S]: index of the first trainable token (= length if none)")
    groups: list[GroupId] = Field(description="[S]")
    tags: Optional[list[Tag]] = Field(None, description="[S]")


class Composition(_Model):
    """A candidate batch: ``groups`` groups of any tag, or ``by_tag`` groups per task tag."""

    model_config = ConfigDict(
        extra="forbid",
        strict=True,
        frozen=True,
        json_schema_extra={
            "oneOf": [
                {"required": ["groups"], "properties": {"groups": {"type": "integer"}, "by_tag": {"type": "null"}}},
                {
                    "required": ["by_tag"],
                    "properties": {
                        "groups": {"type": "null"},
                        "by_tag": {"type": "object", "minProperties": 1},
                    },
                },
            ]
        },
    )

    name: Annotated[str, Field(max_length=128)] = ""
    groups: Optional[Annotated[int, Field(ge=1, le=1_000_000)]] = None
    by_tag: Optional[dict[Annotated[str, Field(max_length=256)], Annotated[int, Field(ge=0, le=1_000_000)]]] = None

    @model_validator(mode="after")
    def _one_of(self) -> Composition:
        if (self.groups is None) == (self.by_tag is None):
            raise PydanticCustomError("one_of", "give exactly one of `groups` and `by_tag`")
        if self.by_tag is not None and sum(self.by_tag.values()) < 1:
            raise PydanticCustomError("non_empty", "`by_tag` asks for no group at all")
        return self


class WhatIfRequest(_Model):
    """``POST /v1/whatif``: row distributions for candidate compositions."""

    version: Version
    seq_len: SeqLenOption
    compositions: Annotated[list[Composition], Field(min_length=1, max_length=64)]
    trials: Annotated[int, Field(ge=1, le=100_000)] = 32
    seed: Annotated[int, Field(ge=0, le=_INT64[1])] = 0
    min_shared_len: MinSharedOption = 64
    placement: PlacementOption = "auto"
    num_ranks: NumRanksOption = 1
    conv_width: ConvWidthOption = 4
    on_overflow: OverflowOption = "error"
    share_trainable: ShareOption = False
    min_shared_saving: SavingOption = 0
    repair_ms: RepairOption = REPAIR_MS
    cp_size: CpSizeOption = 1
    cp_attention: CpAttentionOption = "auto"
    max_rows: Optional[Count] = Field(None, description="report the probability of needing more rows than this")
    history_batches: Optional[Annotated[int, Field(ge=1, le=1_000_000)]] = Field(
        None, description="sample from the most recent N recorded batches (default: all retained)"
    )
    shapes: Optional[Annotated[list[BatchShapeMessage], Field(max_length=4096)]] = Field(
        None, description="sample from these batches instead of the recorded history"
    )


class Distribution(_Model):
    mean: float
    p50: float
    p90: float
    min: float
    max: float


class WhatIfResultMessage(_Model):
    name: str
    groups: Count
    by_tag: Optional[dict[str, Count]]
    trials: Count
    rows: Distribution
    packed_tokens: Distribution
    unpacked_tokens: Distribution
    saved_fraction: Distribution
    max_rows: Optional[Count]
    p_rows_over: Optional[float] = Field(description="fraction of trials with rows > max_rows")
    row_counts: list[Count] = Field(description="rows of each trial, in trial order")
    step_ms: Optional[Distribution] = Field(
        None, description="predicted step time over the trials, ms (with a cost model)"
    )


class PoolMessage(_Model):
    batches: Count
    groups: Count
    sequences: Count
    tokens: Count
    tags: dict[str, Count] = Field(description="groups per task tag ('' for untagged)")


class WhatIfResponse(_Model):
    version: Version
    source: Literal["history", "shapes"]
    pool: PoolMessage
    results: list[WhatIfResultMessage]


class Retention(_Model):
    max_batches: Count
    max_age_s: Optional[float]


class HistorySummary(_Model):
    """``GET /v1/history``: what the shape history holds."""

    version: Version
    enabled: bool
    batches: Count
    sequences: Count
    groups: Count
    tokens: Count
    oldest: Optional[float] = Field(description="unix time of the oldest retained batch")
    newest: Optional[float]
    seq_lens: list[Count] = Field(description="distinct seq_len values recorded")
    tags: dict[str, Count] = Field(description="groups per task tag ('' for untagged)")
    mean_rows: Optional[float]
    mean_saved_fraction: Optional[float]
    retention: Retention


class HealthResponse(_Model):
    version: Version
    status: Literal["ok"]


class ReadyResponse(_Model):
    version: Version
    status: Literal["ready", "not_ready"]
    checks: dict[str, str]


class ErrorBody(_Model):
    """Every 4xx/5xx body (always JSON): the error kind, message, where and which rule."""

    version: Version
    error: str
    message: str
    path: str
    rule: str
    retry_after: Optional[float] = None
