"""What a plan costs: a calibrated linear cost model of one training step (numbers only).

A :class:`CostModel` predicts the forward+backward time of a plan on one device, for one
model and one attention backend, as a sum of measured terms, each a coefficient (ms per
unit) times a count read from the plan's segment tables (vectorized numpy, no tokens):

- ``step``: 1 per step (launches and Python work that do not grow with the batch);
- ``rows``: rows R; ``positions``: computed positions R x C (padding included: the model
  runs on it); ``loss_tokens``: positions whose next token is trainable (the head's
  log-softmax and the loss); ``segments``: segments G (per-segment metadata and dispatch);
- ``attention_pairs``: the query-key pairs the backend computes. ``sdpa`` runs the dense
  [C, C] mask of every row (R x C^2); ``flex`` and ``flash`` the pairs the tree mask
  allows (query i sees key j iff ``j <= i < subtree_end[j]``): a segment of n queries whose
  chain holds k keys sees ``n (k - n) + n (n + 1) / 2``;
- ``gathered_keys`` (``flash``): keys gathered along ancestor chains (sum of chain lengths);
- per mixer kind ``K`` of the model (:data:`MIXER_KINDS`): ``K.levels`` (one varlen call
  per tree depth), ``K.chunks`` (chunked-scan replays: ``ceil(n / chunk_size)`` per
  segment), ``K.contexts`` (segments below a root: a state fork and a conv context gather);
  for ``sparse`` (top-k indexer attention) ``sparse.pairs``, the visible pairs it scores.

Coefficients come from ``treepack.trainer.calibrate`` (timing forward+backward on the
local device) through :func:`~treepack.proto.cost_fit.fit_cost_model`, a non-negative
least-squares fit of relative error; :meth:`CostModel.save` / :func:`load_cost_model` keep
them in a small versioned JSON file. The planner (``plan_batch(..., cost_model=)``) puts :meth:`CostModel.predict_ms` in
``plan.stats.predicted_ms`` and lets ``placement="auto"`` choose tree or plain packing by
predicted time (:class:`CostWarning` when the tree does not pay).
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from treepack.proto.errors import CostModelError, TreepackWarning
from treepack.proto.plan import Plan

__all__ = [
    "COST_FORMAT",
    "COST_VERSION",
    "COST_BACKENDS",
    "MIXER_KINDS",
    "BASE_TERMS",
    "CostModel",
    "CostModelError",
    "CostWarning",
    "cost_terms",
    "plan_features",
    "load_cost_model",
    "naive_attention_pairs",
]

COST_FORMAT = "treepack-cost-model"
COST_VERSION = 1
COST_BACKENDS = ("sdpa", "flex", "flash")
MIXER_KINDS = ("gdn", "gdn_olmo", "mamba2", "mamba", "kda", "short_conv", "sparse")
BASE_TERMS = ("step", "rows", "positions", "loss_tokens", "segments", "attention_pairs")
_RECURRENT_TERMS = ("levels", "chunks", "contexts")


class CostWarning(TreepackWarning):
    """The cost model predicts that tree packing does not pay on this batch."""


def cost_terms(backend: str, mixers: Sequence[str] = ()) -> tuple[str, ...]:
    """The terms a cost model of ``backend`` and these mixer kinds has, in order.

    Raises:
        CostModelError: an unknown backend or mixer kind.
    """
    if backend not in COST_BACKENDS:
        raise CostModelError(f"backend must be one of {COST_BACKENDS}, got {backend!r}", path="$.backend", rule="enum")
    terms = list(BASE_TERMS) + (["gathered_keys"] if backend == "flash" else [])
    for i, kind in enumerate(mixers):
        if kind not in MIXER_KINDS:
            raise CostModelError(
                f"mixer kind must be one of {MIXER_KINDS}, got {kind!r}", path=f"$.mixers[{i}]", rule="enum"
            )
        terms += ["sparse.pairs"] if kind == "sparse" else [f"{kind}.{t}" for t in _RECURRENT_TERMS]
    if len(set(terms)) != len(terms):
        raise CostModelError(f"mixer kinds repeat: {list(mixers)}", path="$.mixers", rule="unique")
    return tuple(terms)


def _visible_pairs(plan: Plan) -> float:
    seg = plan.segments
    n = seg.length.astype(np.float64)
    k = plan.attention.key_lens.astype(np.float64)
    return float((n * (k - n) + n * (n + 1) / 2).sum())


def naive_attention_pairs(plan: Plan) -> int:
    """Reference for the visible pairs: count ``j <= i < subtree_end[j]`` over real tokens, row by row."""
    total = 0
    seg_ids = plan.segment_ids()
    ends = plan.subtree_end()
    for r in range(plan.num_rows):
        real = seg_ids[r] >= 0
        for i in np.flatnonzero(real):
            j = np.arange(i + 1)
            total += int((real[j] & (i < ends[r, j])).sum())
    return total


def _loss_tokens(plan: Plan) -> float:
    """Row positions whose next token (of the segment's source sequence) is trainable."""
    seg = plan.segments
    if seg.num_segments == 0:
        return 0.0
    s, a, n = seg.seq, seg.seq_start, seg.length
    lens = plan.seq_lens[s]
    lo, hi = a + 1, np.minimum(a + n + 1, lens)  # next-token indices [lo, hi)
    if plan.trainable is None:
        count = np.maximum(hi - np.maximum(lo, plan.first_trainable[s]), 0)
    else:
        cs = np.zeros(plan.trainable.shape[0] + 1, dtype=np.int64)
        np.cumsum(plan.trainable, out=cs[1:])
        base = plan.seq_ptr[s]
        count = np.where(hi > lo, cs[base + np.maximum(hi, lo)] - cs[base + lo], 0)
    return float(count.sum())


def plan_features(plan: Plan, terms: Sequence[str], *, backend: str, chunk_size: int = 64) -> np.ndarray:
    """[len(terms)] float64 counts of each term for ``plan`` (module docstring).

    Args:
        plan: any plan.
        terms: as from :func:`cost_terms`.
        backend: ``sdpa`` (dense pairs) or ``flex`` / ``flash`` (visible pairs).
        chunk_size: tokens per chunk of the chunked recurrent scans.
    """
    seg = plan.segments
    R, C = plan.num_rows, plan.seq_len
    cache: dict[str, float] = {}

    def visible() -> float:
        if "v" not in cache:
            cache["v"] = _visible_pairs(plan)
        return cache["v"]

    out = np.zeros(len(terms), dtype=np.float64)
    for i, t in enumerate(terms):
        kind, _, what = t.rpartition(".")
        if t == "step":
            v = 1.0
        elif t == "rows":
            v = float(R)
        elif t == "positions":
            v = float(R) * C
        elif t == "loss_tokens":
            v = _loss_tokens(plan)
        elif t == "segments":
            v = float(seg.num_segments)
        elif t == "attention_pairs":
            v = float(R) * C * C if backend == "sdpa" else visible()
        elif t == "gathered_keys":
            v = float(plan.attention.key_lens.sum())
        elif t == "sparse.pairs":
            v = visible()
        elif what == "levels":
            v = float(len(plan.gdn.levels))
        elif what == "chunks":
            v = float(np.ceil(seg.length / chunk_size).sum())
        elif what == "contexts":
            v = float((seg.depth > 0).sum())
        else:
            raise CostModelError(f"unknown cost term {t!r}", path="$.coefficients", rule="unknown")
        out[i] = v
    return out


@dataclass(frozen=True, slots=True, kw_only=True)
class CostModel:
    """Step time of a plan on one device, model and backend: ms = sum(coefficient x count).

    Attributes:
        backend: the attention backend it was measured with (:data:`COST_BACKENDS`).
        mixers: the model's token-mixer kinds beside attention (:data:`MIXER_KINDS`).
        coefficients: ms per unit of each term of :func:`cost_terms` (all present, >= 0).
        chunk_size: tokens per chunk of the recurrent scans (the ``chunks`` terms).
        device: where it was measured (free text, e.g. ``cpu x86_64 2 threads``).
        description: what was measured (model, dtype, seq_len; free text).
        fit: how the calibration went (batches, relative errors; free numbers).
    """

    backend: str
    mixers: tuple[str, ...] = ()
    coefficients: Mapping[str, float]
    chunk_size: int = 64
    device: str = ""
    description: str = ""
    fit: Mapping[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        terms = cost_terms(self.backend, self.mixers)
        missing = [t for t in terms if t not in self.coefficients]
        extra = [t for t in self.coefficients if t not in terms]
        if missing or extra:
            what = f"missing {missing}" if missing else f"unknown {extra}"
            raise CostModelError(
                f"coefficients must be exactly {list(terms)}: {what}", path="$.coefficients", rule="terms"
            )
        for t in terms:
            v = self.coefficients[t]
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
                raise CostModelError(
                    f"coefficient must be a finite number >= 0, got {v!r}", path=f"$.coefficients.{t}", rule="range"
                )
        if isinstance(self.chunk_size, bool) or not isinstance(self.chunk_size, int) or self.chunk_size < 1:
            raise CostModelError(
                f"chunk_size must be an integer >= 1, got {self.chunk_size!r}", path="$.chunk_size", rule="range"
            )

    @property
    def terms(self) -> tuple[str, ...]:
        return cost_terms(self.backend, self.mixers)

    def features(self, plan: Plan) -> np.ndarray:
        """[len(terms)] float64 counts of each term for ``plan``."""
        return plan_features(plan, self.terms, backend=self.backend, chunk_size=self.chunk_size)

    def breakdown_ms(self, plan: Plan) -> dict[str, float]:
        """Predicted ms of each term for ``plan`` (they sum to :meth:`predict_ms`)."""
        f = self.features(plan)
        return {t: float(c) for t, c in zip(self.terms, f * self._coef())}

    def row_ms(self, seq_len: int) -> float:
        """Predicted ms one more row of ``seq_len`` positions adds to a step, all else equal:
        its ``rows`` and ``positions`` terms and, for ``sdpa``, its dense [C, C] attention
        pairs (the tokens, segments and visible pairs stay where they are). What a row is
        worth to the planner's repair pass."""
        c = self.coefficients
        C = float(seq_len)
        dense = float(c["attention_pairs"]) * C * C if self.backend == "sdpa" else 0.0
        return float(c["rows"]) + float(c["positions"]) * C + dense

    def predict_ms(self, plan: Plan) -> float:
        """Predicted forward+backward time of ``plan``, milliseconds.

        Raises:
            CostModelError: the prediction is no finite number (a coefficient too large
                for this plan's counts; :func:`~treepack.proto.cost_range.check_cost_range`
                refuses such a model for a whole range of plans up front).
        """
        features, coef = self.features(plan), self._coef()
        with np.errstate(over="ignore", invalid="ignore"):  # an overflow is refused below, by name
            ms = float(features @ coef)
            terms = features * coef
        if not math.isfinite(ms):
            worst = self.terms[int(np.argmax(np.where(np.isfinite(terms), terms, np.inf)))]
            raise CostModelError(
                f"the predicted step time of this plan is {ms} ms: coefficient {worst} "
                f"({float(self.coefficients[worst]):.6g}) is too large for its counts",
                path=f"$.coefficients.{worst}",
                rule="range",
            )
        return ms

    def _coef(self) -> np.ndarray:
        return np.array([float(self.coefficients[t]) for t in self.terms], dtype=np.float64)

    def to_dict(self) -> dict[str, Any]:
        """The JSON form (``format`` and ``version`` first)."""
        return {
            "format": COST_FORMAT,
            "version": COST_VERSION,
            "backend": self.backend,
            "mixers": list(self.mixers),
            "chunk_size": self.chunk_size,
            "coefficients": {t: float(self.coefficients[t]) for t in self.terms},
            "device": self.device,
            "description": self.description,
            "fit": {k: float(v) for k, v in self.fit.items()},
        }

    @classmethod
    def from_dict(cls, d: Any) -> CostModel:
        """Read the JSON form, checking every field.

        Raises:
            CostModelError: not a cost model, another version, or a bad field (named).
        """
        if not isinstance(d, dict):
            raise CostModelError(f"a cost model is a JSON object, got {type(d).__name__}", path="$", rule="type")
        if d.get("format") != COST_FORMAT:
            raise CostModelError(
                f"not a treepack cost model: format is {d.get('format')!r}, expected {COST_FORMAT!r}",
                path="$.format",
                rule="format",
            )
        if d.get("version") != COST_VERSION:
            raise CostModelError(
                f"cost model version {d.get('version')!r} is not supported "
                f"(this build reads {COST_VERSION}); recalibrate",
                path="$.version",
                rule="version",
            )
        known = {"format", "version", "backend", "mixers", "chunk_size", "coefficients", "device", "description", "fit"}
        unknown = sorted(set(d) - known)
        if unknown:
            raise CostModelError(f"unknown field {unknown[0]!r}", path=f"$.{unknown[0]}", rule="unknown")
        for name, typ in (("backend", str), ("mixers", list), ("coefficients", dict)):
            if not isinstance(d.get(name), typ):
                raise CostModelError(
                    f"{name} must be a {typ.__name__}, got {type(d.get(name)).__name__}", path=f"$.{name}", rule="type"
                )
        for name in ("device", "description"):
            if not isinstance(d.get(name, ""), str):
                raise CostModelError(f"{name} must be a string", path=f"$.{name}", rule="type")
        fit = d.get("fit", {})
        if not isinstance(fit, dict) or not all(
            isinstance(v, (int, float)) and not isinstance(v, bool) for v in fit.values()
        ):
            raise CostModelError("fit must be an object of numbers", path="$.fit", rule="type")
        return cls(
            backend=d["backend"],
            mixers=tuple(d["mixers"]),
            coefficients=dict(d["coefficients"]),
            chunk_size=d.get("chunk_size", 64),
            device=d.get("device", ""),
            description=d.get("description", ""),
            fit=dict(fit),
        )

    def save(self, path: str | os.PathLike) -> None:
        """Write the JSON file (atomically: a temporary file renamed over ``path``)."""
        tmp = f"{os.fspath(path)}.tmp"
        with open(tmp, "w") as f:
            json.dump(self.to_dict(), f, indent=1)
        os.replace(tmp, path)


def load_cost_model(path: str | os.PathLike) -> CostModel:
    """Read a cost file written by :meth:`CostModel.save`.

    Raises:
        CostModelError: the file is missing, not JSON, or not a valid cost model (the
            message names the file and the field).
    """
    try:
        with open(path) as f:
            d = json.load(f)
    except FileNotFoundError:
        raise CostModelError(f"cost file {os.fspath(path)!r} does not exist", path="$", rule="missing") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CostModelError(f"cost file {os.fspath(path)!r} is not JSON: {e}", path="$", rule="json") from None
    try:
        return CostModel.from_dict(d)
    except CostModelError as e:
        raise CostModelError(f"cost file {os.fspath(path)!r}: {e.message}", path=e.path, rule=e.rule) from None
