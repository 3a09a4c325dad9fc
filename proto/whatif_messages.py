"""The messages of ``POST /v1/whatif``: batch shapes (also the history's stored form), the request, the results.

Field types and wire conventions: :mod:`treepack.proto.wire_fields`.
"""

from __future__ import annotations

from typing import Annotated, Literal, Optional, Union

from pydantic import ConfigDict, Field, model_validator
from pydantic_core import PydanticCustomError

from treepack.proto.options import REPAIR_MS
from treepack.proto.wire_fields import (
    INT64,
    ConvWidthOption,
    Count,
    CountBuffer,
    CpAttentionOption,
    CpSizeOption,
    GroupId,
    MinShared,
    MinSharedOption,
    NumRanksOption,
    OffsetsBuffer,
    OverflowOption,
    PlacementOption,
    RepairOption,
    RunLenBuffer,
    SavingOption,
    SeqLen,
    SeqLenOption,
    ShareOption,
    StrategyMessage,
    Tag,
    U8Buffer,
    Version,
    WireModel,
)

__all__ = [
    "BatchShapeMessage",
    "Composition",
    "WhatIfRequest",
    "WhatIfResponse",
    "WhatIfResultMessage",
    "Distribution",
    "PoolMessage",
]


class BatchShapeMessage(WireModel):
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


class Composition(WireModel):
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


class WhatIfRequest(WireModel):
    """``POST /v1/whatif``: row distributions for candidate compositions."""

    version: Version
    seq_len: SeqLenOption
    compositions: Annotated[list[Composition], Field(min_length=1, max_length=64)]
    trials: Annotated[int, Field(ge=1, le=100_000)] = 32
    seed: Annotated[int, Field(ge=0, le=INT64[1])] = 0
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
    max_step_ms: Optional[Annotated[float, Field(gt=0, allow_inf_nan=False)]] = Field(
        None, description="with a cost model, report the probability of a predicted step longer than this, ms"
    )
    history_batches: Optional[Annotated[int, Field(ge=1, le=1_000_000)]] = Field(
        None, description="sample from the most recent N recorded batches (of history_seq_len; default: all retained)"
    )
    history_seq_len: Optional[Union[SeqLen, Literal["any"]]] = Field(
        None,
        description="sample batches recorded at this seq_len (default: the request's seq_len); 'any': every batch",
    )
    history_tags: Optional[list[Annotated[str, Field(max_length=256)]]] = Field(
        None, description="sample only groups of these task tags ('' for untagged; default: every tag)"
    )
    shapes: Optional[Annotated[list[BatchShapeMessage], Field(max_length=4096)]] = Field(
        None, description="sample from these batches instead of the recorded history"
    )


class Distribution(WireModel):
    mean: float
    p50: float
    p90: float
    min: float
    max: float
    std: Optional[float] = Field(None, description="sample standard deviation over the trials (version 2)")
    stderr: Optional[float] = Field(None, description="standard error of the mean, std / sqrt(trials) (version 2)")


class WhatIfResultMessage(WireModel):
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
    strategies: Optional[list[StrategyMessage]] = Field(
        None, description="how each trial was packed, in trial order (version 2)"
    )
    trial_step_ms: Optional[list[float]] = Field(
        None, description="predicted step time of each trial, ms, in trial order (with a cost model)"
    )
    max_step_ms: Optional[float] = Field(None, description="the step-time threshold asked about, ms")
    p_step_over: Optional[float] = Field(
        None, description="fraction of trials predicted slower than max_step_ms (with a cost model)"
    )
    suggested_trials: Optional[Count] = Field(
        None,
        description="trials for the standard error of the mean step_ms (rows without a cost model) "
        "to be at most 1% of it (version 2)",
    )


class PoolMessage(WireModel):
    batches: Count
    groups: Count
    sequences: Count
    tokens: Count
    tags: dict[str, Count] = Field(
        description="groups per task tag ('' for untagged); the max_tags tags with the most groups"
    )
    tags_omitted: Count = Field(0, description="distinct tags of the pool not listed in tags")


class WhatIfResponse(WireModel):
    version: Version
    source: Literal["history", "shapes"]
    pool: PoolMessage
    results: list[WhatIfResultMessage]
