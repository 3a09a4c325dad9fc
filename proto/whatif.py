"""What-if questions and answers: a :class:`WhatIfQuery` of candidate batch compositions,
and the distributions the planner reports for each.

The contract types of ``POST /v1/whatif``; the sampling that fills them lives in the
planner (:mod:`treepack.service.planner.whatif`), the codecs in :mod:`~.whatif_wire`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Union

import numpy as np

from treepack.proto.errors import InputTypeError
from treepack.proto.options import PlanOptions, as_options
from treepack.proto.shape import BatchShape

__all__ = ["Composition", "CompositionLike", "Distribution", "WhatIfQuery", "WhatIfResult", "as_composition"]


@dataclass(frozen=True, slots=True, kw_only=True)
class Composition:
    """A candidate batch: ``groups`` groups of any tag, or ``by_tag`` groups per task tag."""

    name: str = ""
    groups: int | None = None
    by_tag: Mapping[str, int] | None = None

    @property
    def total_groups(self) -> int:
        return int(self.groups) if self.groups is not None else int(sum((self.by_tag or {}).values()))


CompositionLike = Union[Composition, int, Mapping[str, Any]]


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
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class Distribution:
    """Summary of one figure over the trials (percentiles interpolate linearly)."""

    mean: float
    p50: float
    p90: float
    min: float
    max: float

    @classmethod
    def of(cls, values: np.ndarray) -> Distribution:
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
