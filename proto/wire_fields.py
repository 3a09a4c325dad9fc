"""The field types of the wire messages: buffers, bounded numbers, planner options, the base model.

Conventions of every message (:mod:`treepack.proto.messages` lists them):

- Every top-level message has ``"version": 2`` (a request may still say 1:
  :mod:`treepack.proto.version`); unknown fields are errors.
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

INT64 = (-(2**63), 2**63 - 1)
_INT64_MIN = INT64[0]


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

Version = Annotated[
    Literal[1, 2],
    Field(description=f"wire version; this build speaks {WIRE_VERSION} and reads 1 (answering it in 1)"),
]
SeqLen = Annotated[int, Field(ge=1, le=MAX_SEQ_LEN, description="row capacity C in tokens")]
MinShared = Annotated[int, Field(ge=1, le=MAX_SEQ_LEN, description="no shared segment shorter than this (SPEC rule 4)")]
NumRanks = Annotated[int, Field(ge=1, le=MAX_RANKS, description="ranks to deal rows to")]
CpSize = Annotated[
    int,
    Field(ge=1, le=MAX_CP_SIZE, description="context-parallel group size: each row split into this many equal shards"),
]
ConvWidth = Annotated[int, Field(ge=1, le=MAX_CONV_WIDTH, description="GDN short-conv width W")]
Count = Annotated[int, Field(ge=0, le=INT64[1])]


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
        "description": "context-parallel group size: each row split into this many equal, aligned shards "
        "(num_ranks is then the data-parallel size)",
    }
)
CpAttentionOption = _option(
    {
        "enum": list(CP_ATTENTION),
        "default": "auto",
        "description": "attention under CP: ulysses, allgather (shards balanced by attention work), "
        "or auto (contiguous shards; ulysses where heads divide)",
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
Index = Annotated[int, Field(ge=-1, le=INT64[1])]
GroupId = Union[Annotated[int, Field(ge=INT64[0], le=INT64[1])], Annotated[str, Field(max_length=256)], None]
# A request's group ids are judged by the planner's normalisation (treepack.proto.batch_fields.group_codes),
# which gives the embedded planner's errors; the schema documents the same limits.
GroupIdInput = Annotated[
    Any,
    WithJsonSchema(
        {
            "anyOf": [
                {"type": "integer", "minimum": INT64[0], "maximum": INT64[1]},
                {"type": "string", "maxLength": 256},
                {"type": "null"},
            ]
        }
    ),
]
Tag = Optional[Annotated[str, Field(max_length=256)]]


class WireModel(BaseModel):
    """The base of every wire message: unknown fields are errors, no coercion, immutable."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)


class StrategyMessage(WireModel):
    """How a plan packs (:class:`~treepack.proto.strategy.Strategy`): ``tree`` at a ``min_shared_len``, or ``plain``."""

    kind: Literal["tree", "plain"]
    min_shared_len: Optional[MinShared] = Field(
        None, description="the rule-4 threshold the tree was built with; null for plain"
    )

    @model_validator(mode="after")
    def _threshold_of_a_tree(self) -> StrategyMessage:
        if (self.min_shared_len is None) != (self.kind == "plain"):
            raise PydanticCustomError("strategy", "a tree has a min_shared_len and plain packing none")
        return self
