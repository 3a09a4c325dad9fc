"""The planner never crashes or stalls on a valid batch: Hypothesis over the batch shapes a
trainer sends (:func:`helpers.shapes.shapes`), every placement and option, each plan
through ``validate_plan`` and within a time per token.

Shapes: 1..4096 groups of 1..64 sequences, prompts 0..32k and completions 1..32k tokens
(log-uniform: hundreds of short leaves per row are common), ``seq_len`` 16..1M, deep
multi-turn chains, one prompt with thousands of completions, duplicates, sequences of
exactly ``seq_len``, random trees; ``share_trainable``, ``min_shared_len``,
``min_shared_saving``, ranks and ``cp_size``. Two profiles (``TREEPACK_FUZZ``):

- ``fast`` (the default, in ``make test``): 100 shapes of at most 3,000 sequences and
  150,000 tokens, replayed identically every run (the ``ci`` Hypothesis profile), ~30 s.
- ``large`` (``make fuzz``, nightly-style, runnable locally): 300 fresh shapes of up to
  100,000 sequences and 4M tokens (``TREEPACK_FUZZ_EXAMPLES`` sets the count).

The issue's crash (``RecursionError``: 512 GRPO groups of 4 x 80 tokens in rows of 8,192;
256 already crash outside Hypothesis, which raises the recursion limit to about 2,000) is
an explicit example; any shape this finds failing becomes a named test beside it.
"""

from __future__ import annotations

import os
import time
from collections import Counter

from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from treepack.service.planner import PLACEMENTS, plan_batch, repair, validate_plan

from helpers.shapes import KINDS, shape_batch, shapes

PROFILES = {
    "fast": dict(examples=100, max_sequences=3_000, max_tokens=150_000, derandomize=True),
    "large": dict(examples=300, max_sequences=100_000, max_tokens=4_000_000, derandomize=False),
}
PROFILE = PROFILES[os.environ.get("TREEPACK_FUZZ", "fast")] | (
    {"examples": int(os.environ["TREEPACK_FUZZ_EXAMPLES"])} if "TREEPACK_FUZZ_EXAMPLES" in os.environ else {}
)
# CPU time allowed per batch (a stall, not a loaded machine, should fail): a constant for
# the fixed costs, and 40 us per token, planning and the autouse validation together (the
# validation dominates; planning alone takes about 1-5 us per token here).
FIXED_S, PER_TOKEN_S = 2.0, 40e-6

ISSUE_37 = dict(
    kind=0, seed=0, seq_len=8192, groups=512, per_group=4, prompt=64, completion=16, spread=0, system=0, duplicates=0,
    min_shared_len=64, share_trainable=0, min_shared_saving=0, max_tokens=10**6,
)  # fmt: skip
# A budget the repair pass never reaches there, so a loaded machine cannot skip the deep searches.
PLAIN = dict(placement="auto", num_ranks=1, cp_size=1, cp_attention="auto", repair_ms=60_000.0)


@st.composite
def plan_options(draw) -> dict:
    cp = draw(st.sampled_from([1, 1, 2, 4]))
    return dict(
        placement=draw(st.sampled_from(PLACEMENTS + ("auto", "auto"))),
        num_ranks=draw(st.sampled_from([1, 1, 2, 8])),
        cp_size=cp,
        cp_attention=draw(st.sampled_from(["auto", "ulysses", "allgather"])) if cp > 1 else "auto",
    )


def _record(seen: Counter, shape: dict, plan, ms: float) -> None:
    rows = max(plan.num_rows, 1)
    seen["plans"] += 1
    seen[KINDS[shape["kind"]]] += 1
    seen["100+ leaves a row"] += plan.num_sequences / rows >= 100
    seen["1000+ sequences"] += plan.num_sequences >= 1000
    seen["shared"] += bool((plan.segments.sharers >= 2).any())
    seen["deep"] += bool((plan.segments.depth >= 4).any())
    seen["above the bound"] += plan.num_rows > plan.stats.lower_bound_rows  # the repair pass ran
    seen["ms"] += ms


def test_every_trainer_shape_plans_validly(monkeypatch):
    seen: Counter = Counter()
    handed = [0]

    class Spy(repair.RowFit):
        __slots__ = ()

        def __init__(self, items, *args) -> None:
            handed[0] = max(handed[0], len(items))
            super().__init__(items, *args)

    monkeypatch.setattr(repair, "RowFit", Spy)

    @settings(
        max_examples=PROFILE["examples"],
        deadline=None,
        derandomize=PROFILE["derandomize"],
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )
    @given(
        shape=shapes(max_sequences=PROFILE["max_sequences"], max_tokens=PROFILE["max_tokens"]),
        options=plan_options(),
    )
    @example(shape=ISSUE_37, options=PLAIN)
    def check(shape, options):
        kw = shape_batch(shape)
        tokens = sum(s.shape[0] for s in kw["sequences"])
        t0 = time.thread_time()
        plan = plan_batch(**kw, **options)
        spent = time.thread_time() - t0
        validate_plan(plan, kw["sequences"], trainable=kw["trainable"])
        assert spent <= FIXED_S + PER_TOKEN_S * tokens, (spent, tokens, shape, options)
        assert plan.num_rows >= plan.stats.lower_bound_rows
        _record(seen, shape, plan, spent * 1e3)

    check()
    print(f"shape fuzz ({os.environ.get('TREEPACK_FUZZ', 'fast')}): {dict(seen)}")  # noqa: T201
    if PROFILE["examples"] < 100:
        return  # a short run (TREEPACK_FUZZ_EXAMPLES) need not draw every structure
    # Not vacuous: every kind drawn, many short leaves per row, big batches, deep and shared
    # trees, the repair pass at work, and the exact search handed several rows of short leaves.
    assert all(seen[k] for k in KINDS), seen
    for what in ("100+ leaves a row", "1000+ sequences", "shared", "deep", "above the bound"):
        assert seen[what] >= 2, (what, seen)
    # The exact search handed a neighbourhood of many short leaves. The batches that used to hand it
    # 2,048+ at once (deeper than Hypothesis' raised recursion limit) are now proven optimal by the
    # count bound and skip the repair pass; tests/planner/test_exact_scale.py drives the search with
    # 1,000+ leaves explicitly.
    assert handed[0] >= 32, handed
