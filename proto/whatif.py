"""What-if answers: candidate batch compositions and the distributions the planner reports.

The contract types of ``POST /v1/whatif``; the sampling that fills them lives in the
planner (:mod:`treepack.service.planner.whatif`), the codecs in :mod:`~.whatif_wire`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

import numpy as np

__all__ = ["Composition", "Distribution", "WhatIfResult"]


@dataclass(frozen=True, slots=True, kw_only=True)
class Composition:
    """A candidate batch: ``groups`` groups of any tag, or ``by_tag`` groups per task tag."""

    name: str = ""
    groups: int | None = None
    by_tag: Mapping[str, int] | None = None

    @property
    def total_groups(self) -> int:
        return int(self.groups) if self.groups is not None else int(sum((self.by_tag or {}).values()))


@dataclass(frozen=True, slots=True, kw_only=True)
class Distribution:
    """Summary of one figure over the trials (percentiles interpolate linearly)."""

    mean: float
    p50: float
    p90: float
    min: float
    max: float

    @classmethod
    def of(cls, values: np.ndarray) -> "Distribution":
        v = np.asarray(values, dtype=np.float64)
        p50, p90 = np.percentile(v, [50, 90])
        return cls(mean=float(v.mean()), p50=float(p50), p90=float(p90), min=float(v.min()), max=float(v.max()))


@dataclass(frozen=True, slots=True, kw_only=True)
class WhatIfResult:
    """What-if figures of one composition.

    Attributes:
        name: the composition's name.
        groups: groups per trial.
        by_tag: groups per tag, if the composition was given by tag.
        trials: number of trials.
        rows, packed_tokens, unpacked_tokens, saved_fraction: distributions over trials.
        max_rows: the threshold asked about, or None.
        p_rows_over: fraction of trials needing more than ``max_rows`` rows (None without one).
        row_counts: [trials] int64 rows of each trial.
        step_ms: predicted step time over the trials, ms, when a cost model was given
            (:mod:`treepack.proto.cost`), else None.
    """

    name: str
    groups: int
    by_tag: dict[str, int] | None
    trials: int
    rows: Distribution
    packed_tokens: Distribution
    unpacked_tokens: Distribution
    saved_fraction: Distribution
    max_rows: int | None
    p_rows_over: float | None
    row_counts: np.ndarray
    step_ms: Distribution | None = None
