"""The catalogue of every message on the wire, as pydantic v2 models.

Wire version :data:`~treepack.proto.version.WIRE_VERSION`.

These models are the single schema: the service validates requests with them, the client
validates responses with them, :mod:`treepack.proto.schema` writes them out as JSON Schema
files and the service's OpenAPI document embeds them. They live by endpoint:

- :mod:`~treepack.proto.pack_messages`: ``POST /v1/pack``, the request and the plan;
- :mod:`~treepack.proto.whatif_messages`: ``POST /v1/whatif``, batch shapes, compositions
  and results;
- :mod:`~treepack.proto.service_messages`: the history summary, health, readiness and the
  error body;

and share their field types and conventions (:mod:`~treepack.proto.wire_fields`). This
module lists them all, for the readers of the whole schema (schema files, OpenAPI, the
service's routes).
"""

from __future__ import annotations

from treepack.proto.pack_messages import (
    ArrayMessage,
    AttentionMessage,
    GdnLevelMessage,
    GdnMessage,
    OverflowMessage,
    PackRequest,
    PackResponse,
    PlanMessage,
    RanksMessage,
    SegmentsMessage,
    StatsMessage,
)
from treepack.proto.service_messages import ErrorBody, HealthResponse, HistorySummary, ReadyResponse, Retention
from treepack.proto.whatif_messages import (
    BatchShapeMessage,
    Composition,
    Distribution,
    PoolMessage,
    WhatIfRequest,
    WhatIfResponse,
    WhatIfResultMessage,
)
from treepack.proto.wire_fields import Buffer

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
]
