"""The service's own messages: the history summary, health and readiness, and the error body of every 4xx/5xx.

Field types and wire conventions: :mod:`treepack.proto.wire_fields`.
"""

from __future__ import annotations

from typing import Literal, Optional

from pydantic import Field

from treepack.proto.wire_fields import Count, Version, WireModel

__all__ = ["HistorySummary", "Retention", "HealthResponse", "ReadyResponse", "ErrorBody"]


class Retention(WireModel):
    max_batches: Count
    max_age_s: Optional[float]


class HistorySummary(WireModel):
    """``GET /v1/history``: what the shape history holds."""

    version: Version
    enabled: bool
    batches: Count = Field(description="retained batches a what-if can sample (every figure below counts these)")
    skipped: Count = Field(
        0, description="retained batches that cannot be used: their shape fails its checksum or does not decode"
    )
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


class HealthResponse(WireModel):
    version: Version
    status: Literal["ok"]


class ReadyResponse(WireModel):
    version: Version
    status: Literal["ready", "not_ready"]
    checks: dict[str, str]


class ErrorBody(WireModel):
    """Every 4xx/5xx body (always JSON): the error kind, message, where and which rule."""

    version: Version
    error: str
    message: str
    path: str
    rule: str
    retry_after: Optional[float] = None
