"""What-if questions and answers: a :class:`WhatIfQuery` of candidate batch compositions,
and the distributions the planner reports for each.

The contract types of ``POST /v1/whatif``; the sampling that fills them lives in the
planner (:mod:`treepack.service.planner.whatif`), the codecs in :mod:`~.whatif_wire`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Union

import numpy as np

from treepack.proto.errors import InputTypeError
from treepack.proto.options import PlanOptions, as_options
from treepack.proto.shape import BatchShape
from treepack.proto.strategy import Strategy

__all__ = [
    "Composition",
    "CompositionLike",
    "Distribution",
    "WhatIfQuery",
    "WhatIfResult",
    "as_composition",
    "suggest_trials",
    "TARGET_REL_STDERR",
    "MIN_SUGGESTED_TRIALS",
]

TARGET_REL_STDERR = 0.01
"""The precision :func:`suggest_trials` aims at: the mean's standard error at most 1% of the mean."""
MIN_SUGGESTED_TRIALS = 8
"""Fewest trials :func:`suggest_trials` suggests: below that a sample's spread says little about its own noise."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Composition:
    """A candidate batch: ``groups`` groups of any tag, or ``by_tag`` groups per task tag.

    ``name`` defaults to what the composition asks for: ``"12 groups"``,
    ``"math 20 + code 12"`` (tags in the order given).
    """

    name: str = ""
    groups: int | None = None
    by_tag: Mapping[str, int] | None = None

    def __post_init__(self) -> None:
        if not self.name:
            object.__setattr__(self, "name", default_name(self.groups, self.by_tag))

    @property
    def total_groups(self) -> int:
        return int(self.groups) if self.groups is not None else int(sum((self.by_tag or {}).values()))


CompositionLike = Union[Composition, int, Mapping[str, Any]]


def default_name(groups: Any, by_tag: Any) -> str:
    """``"12 groups"`` / ``"math 20 + code 12"``: a composition's name when none is given."""
    if groups is not None:
        return f"{groups} group{'' if groups == 1 else 's'}"
    if isinstance(by_tag, Mapping) and by_tag:
        return " + ".join(f"{tag or '(untagged)'} {k}" for tag, k in by_tag.items())
    return "(empty)"


def as_composition(c: CompositionLike, i: int = 0) -> Composition:
    """A :class:`Composition` from itself, a group count, or a dict (``groups``/``by_tag``/``name``).

    Raises:
        InputTypeError: another type, or a dict with another key (path ``$.compositions[i]``).
    """
    if isinstance(c, Composition):
        return c
    if isinstance(c, int) and not isinstance(c, bool):
        return Composition(groups=c)
    if isinstance(c, Mapping):
        unknown = set(c) - {"name", "groups", "by_tag"}
        if unknown:
            raise InputTypeError(
                f"unknown composition field(s) {sorted(unknown)}", path=f"$.compositions[{i}]", rule="unknown_field"
            )
        return Composition(name=c.get("name", ""), groups=c.get("groups"), by_tag=c.get("by_tag"))
    raise InputTypeError(
        f"expected a Composition, an int or a dict, got {type(c).__name__}", path=f"$.compositions[{i}]", rule="type"
    )


@dataclass(frozen=True, slots=True, kw_only=True)
class WhatIfQuery:
    """One what-if question, as both client backends and the wire codec take it.

    Attributes:
        compositions: the candidates.
        options: the plan options of every trial, as given (the planner checks them);
            ``seq_len`` is the row capacity to plan for. Shapes record no trainable
            tokens: the generalized mode shares none in a trial.
        trials: trials per composition; ``seed`` makes them reproducible.
        seed: the sampling seed.
        max_rows: also report the probability of needing more rows than this.
        max_step_ms: with a cost model, also report the probability of a predicted step
            longer than this, ms.
        history_batches: sample only the most recent N recorded batches (of those
            ``history_seq_len`` selects; None: all).
        history_seq_len: sample only batches recorded at this ``seq_len``: None (the
            default) is the query's own ``seq_len``, so batches packed for other row
            lengths (a test at ``seq_len`` 16, another run's) stay out; ``"any"``: every
            recorded batch (the rows are then planned at the query's ``seq_len``).
        history_tags: sample only groups of these task tags (``""``: untagged groups),
            e.g. one run's tag; None: every tag. ``by_tag`` compositions draw from their
            own tags in any case.
        shapes: sample these batches instead of the history (as given: no scope applies).
    """

    compositions: tuple[Composition, ...]
    options: PlanOptions
    trials: int = 32
    seed: int = 0
    max_rows: int | None = None
    history_batches: int | None = None
    shapes: Sequence[BatchShape] | None = None
    history_seq_len: int | str | None = None
    history_tags: Sequence[str] | None = None
    max_step_ms: float | None = None

    @classmethod
    def of(
        cls,
        compositions: Sequence[CompositionLike],
        options: PlanOptions | None = None,
        *,
        trials: int = 32,
        seed: int = 0,
        max_rows: int | None = None,
        history_batches: int | None = None,
        shapes: Sequence[BatchShape] | None = None,
        history_seq_len: int | str | None = None,
        history_tags: Sequence[str] | None = None,
        max_step_ms: float | None = None,
        **option_kwargs: Any,
    ) -> WhatIfQuery:
        """The query from the clients' ``whatif`` arguments (the attributes above).

        Args:
            compositions: each a :class:`Composition`, a group count, or a dict such as
                ``{"by_tag": {"math": 20, "code": 12}}`` (:func:`as_composition`).
            options: a :class:`~treepack.proto.options.PlanOptions`, or its fields as
                keywords instead, not both.
        """
        comps = tuple(as_composition(c, i) for i, c in enumerate(compositions))
        opts = as_options(options, option_kwargs)
        return cls(
            compositions=comps,
            options=opts,
            trials=trials,
            seed=seed,
            max_rows=max_rows,
            history_batches=history_batches,
            shapes=shapes,
            history_seq_len=history_seq_len,
            history_tags=None if history_tags is None else tuple(history_tags),
            max_step_ms=max_step_ms,
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class Distribution:
    """Summary of one figure over the trials (percentiles interpolate linearly).

    Attributes:
        mean, p50, p90, min, max: of the trials' values.
        std: their sample standard deviation (n - 1 in the denominator; 0 for one trial).
        stderr: the standard error of ``mean``, ``std / sqrt(trials)``: two compositions
            whose means differ by less than about twice their stderrs are not told apart
            by this many trials.
    """

    mean: float
    p50: float
    p90: float
    min: float
    max: float
    std: float = 0.0
    stderr: float = 0.0

    @classmethod
    def of(cls, values: np.ndarray) -> Distribution:
        """The summary of ``values`` ([trials], at least one)."""
        v = np.asarray(values, dtype=np.float64)
        p50, p90 = np.percentile(v, [50, 90])
        std = float(v.std(ddof=1)) if v.size > 1 else 0.0
        return cls(
            mean=float(v.mean()),
            p50=float(p50),
            p90=float(p90),
            min=float(v.min()),
            max=float(v.max()),
            std=std,
            stderr=std / math.sqrt(v.size),
        )


def suggest_trials(d: Distribution) -> int:
    """Trials for the mean's standard error to be at most :data:`TARGET_REL_STDERR` of it.

    From the observed spread: ``(std / (0.01 x mean))^2`` (the standard error falls as
    1/sqrt(trials)), never fewer than :data:`MIN_SUGGESTED_TRIALS`.
    """
    if d.mean <= 0 or d.std <= 0:
        return MIN_SUGGESTED_TRIALS
    return max(MIN_SUGGESTED_TRIALS, math.ceil((d.std / (TARGET_REL_STDERR * d.mean)) ** 2))


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
        strategies: [trials] how each trial was packed
            (:class:`~treepack.proto.strategy.Strategy`: ``tree`` and its
            ``min_shared_len``, or ``plain``; with a cost model ``auto`` chooses per trial).
        trial_step_ms: [trials] float64 predicted step time of each trial, ms (None
            without a cost model).
        max_step_ms: the step-time threshold asked about, ms, or None.
        p_step_over: fraction of trials predicted slower than ``max_step_ms`` (None
            without a threshold or a cost model).
        suggested_trials: trials for the standard error of the mean of ``step_ms`` (of
            ``rows`` without a cost model) to be at most 1% of it (:func:`suggest_trials`);
            more than ``trials`` means this answer's means are noisier than that.
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
    strategies: tuple[Strategy, ...] = ()
    trial_step_ms: np.ndarray | None = None
    max_step_ms: float | None = None
    p_step_over: float | None = None
    suggested_trials: int = MIN_SUGGESTED_TRIALS
