"""The receiver's guard, ``check_plan_structure``: one forged plan per structural check.

Every index bound is tried at exactly its limits: the first value outside (``hi`` and
``lo - 1``) is refused naming the field, the last value inside (``hi - 1``, ``lo``) is not
refused by that bound; every size, CSR pointer and cross-table rule is broken alone. A
source scan fails when ``check_plan_structure`` gains a bound this table does not try.
"""

from __future__ import annotations

import copy
import dataclasses
import inspect
import re

import numpy as np
import pytest

from treepack.proto import plan_wire
from treepack.proto.errors import RequestError
from treepack.proto.plan_wire import check_plan_structure, plan_from_wire, plan_to_wire
from treepack.service.planner import plan_batch, validate_plan

from helpers.trees import tree_sequences


@pytest.fixture(scope="module")
def base():
    seqs = tree_sequences(5, trees=3, depth=3, max_len=60)
    plan = plan_batch(seqs, seq_len=128, min_shared_len=2, num_ranks=2, trainable=[len(s) - 3 for s in seqs])
    validate_plan(plan, seqs)
    check_plan_structure(plan)
    assert plan.num_rows >= 3 and len(plan.gdn.levels) >= 3 and plan.gdn.levels[0].segs.shape[0] >= 2
    return plan


def _level(p, d):
    return p.gdn.levels[d]


# (path, array getter, lo, hi(plan)): the bounds check_plan_structure promises, [lo, hi).
BOUNDS = [
    ("$.segments.seq_segs", lambda p: p.segments.seq_segs, 0, lambda p: p.segments.num_segments),
    ("$.segments.row", lambda p: p.segments.row, 0, lambda p: p.num_rows),
    ("$.segments.seq", lambda p: p.segments.seq, 0, lambda p: p.num_sequences),
    ("$.segments.parent", lambda p: p.segments.parent, -1, lambda p: p.segments.num_segments),
    ("$.segments.length", lambda p: p.segments.length, 1, lambda p: p.seq_len + 1),
    ("$.segments.row_start", lambda p: p.segments.row_start, 0, lambda p: p.seq_len),
    ("$.segments.subtree_end", lambda p: p.segments.subtree_end, 0, lambda p: p.seq_len + 1),
    ("$.segments.row_len", lambda p: p.segments.row_len, 0, lambda p: p.seq_len + 1),
    ("$.seq_lens", lambda p: p.seq_lens, 0, lambda p: 2**48),
    ("$.segments.seq_start", lambda p: p.segments.seq_start, 0, lambda p: 2**48),
    ("$.row_of", lambda p: p.row_of, -1, lambda p: p.num_rows),
    ("$.attention.anc_segs", lambda p: p.attention.anc_segs, 0, lambda p: p.segments.num_segments),
    ("$.gdn.levels[1].segs", lambda p: _level(p, 1).segs, 0, lambda p: p.segments.num_segments),
    ("$.gdn.levels[1].conv_context", lambda p: _level(p, 1).conv_context, -1, lambda p: p.num_rows * p.seq_len),
    ("$.gdn.levels[1].parent", lambda p: _level(p, 1).parent, -1, lambda p: p.segments.num_segments),
    ("$.gdn.levels[1].parent_slot", lambda p: _level(p, 1).parent_slot, -1, lambda p: _level(p, 0).segs.shape[0]),
    ("$.gdn.levels[0].parent_slot", lambda p: _level(p, 0).parent_slot, -1, lambda p: 0),
    ("$.ranks.rank_rows", lambda p: p.ranks.rank_rows, -1, lambda p: p.num_rows),
]


def _set_one(plan, getter, value):
    p = copy.deepcopy(plan)
    a = getter(p)
    a.reshape(-1)[-1] = value  # the last entry: every earlier entry keeps its valid value
    return p


def _refusal(plan) -> RequestError | None:
    try:
        check_plan_structure(plan)
    except RequestError as e:
        return e
    return None


@pytest.mark.parametrize("path", [b[0] for b in BOUNDS])
def test_every_index_bound_is_exact(base, path):
    _, getter, lo, hi_of = next(b for b in BOUNDS if b[0] == path)
    hi = hi_of(base)
    for bad in (hi, lo - 1):
        e = _refusal(_set_one(base, getter, bad))
        assert e is not None, f"{path} = {bad} (outside [{lo}, {hi})) was not refused"
        assert e.path == path and e.rule == "plan_structure" and f"values outside [{lo}, {hi})" in str(e), (
            path,
            bad,
            str(e),
            e.path,
        )
    for edge in (hi - 1, lo):
        if edge < lo or edge >= hi:
            continue  # an empty range ([-1, 0) holds only -1)
        e = _refusal(_set_one(base, getter, edge))
        # Other rules may object to the edited plan, but never this bound.
        assert e is None or not (e.path == path and "values outside" in str(e)), (
            f"{path} = {edge} (inside [{lo}, {hi})) refused: {e}"
        )


def test_the_issue_example_seq_equal_to_S_does_not_decode(base):
    """A source index equal to the number of sequences, sent over the wire, is refused at decode."""
    wire = plan_to_wire(base, "json")
    wire["segments"]["seq"]["data"][-1] = base.num_sequences
    with pytest.raises(RequestError, match=r"values outside \[0, \d+\)") as e:
        plan_from_wire(wire)
    assert e.value.path == "$.segments.seq"
    wire["segments"]["seq"]["data"][-1] = base.num_sequences - 1
    try:
        plan_from_wire(wire)
    except RequestError as e2:
        assert e2.path != "$.segments.seq", str(e2)


def _replace_seg(p, **kw):
    return dataclasses.replace(p, segments=dataclasses.replace(p.segments, **kw))


def _replace_level(p, d, **kw):
    levels = list(p.gdn.levels)
    levels[d] = dataclasses.replace(levels[d], **kw)
    return dataclasses.replace(p, gdn=dataclasses.replace(p.gdn, levels=tuple(levels)))


def _edit(fn):
    def forge(plan):
        p = copy.deepcopy(plan)
        out = fn(p)
        return p if out is None else out

    return forge


# name -> (forge, path, message regex): every other structural rule, broken alone.
RULES = {
    "orig_lens size": (
        _edit(lambda p: dataclasses.replace(p, orig_lens=p.orig_lens[:-1])),
        "$.orig_lens",
        r"orig_lens has \d+ entries for \d+ sequences",
    ),
    "group_codes size": (
        _edit(lambda p: dataclasses.replace(p, group_codes=p.group_codes[:-1])),
        "$.group_codes",
        r"group_codes has",
    ),
    "segment column size": (
        _edit(lambda p: _replace_seg(p, sharers=p.segments.sharers[:-1])),
        "$.segments.sharers",
        r"sharers has \d+ entries for \d+ segments",
    ),
    "row tables": (
        _edit(lambda p: _replace_seg(p, row_len=p.segments.row_len[:-1])),
        "$.segments.row_ptr",
        r"row tables for \d+ rows",
    ),
    "row_ptr start": (
        _edit(lambda p: p.segments.row_ptr.__setitem__(0, 1)),
        "$.segments.row_ptr",
        r"must run from 0 to \d+",
    ),
    "row_ptr end": (
        _edit(lambda p: p.segments.row_ptr.__setitem__(-1, p.segments.row_ptr[-1] - 1)),
        "$.segments.row_ptr",
        r"must run from 0 to \d+",
    ),
    "row_ptr order": (
        _edit(lambda p: p.segments.row_ptr.__setitem__(1, p.segments.row_ptr[2] + 1)),
        "$.segments.row_ptr",
        r"must not decrease",
    ),
    "seq_ptr size": (
        _edit(lambda p: _replace_seg(p, seq_ptr=p.segments.seq_ptr[:-1])),
        "$.segments.seq_ptr",
        r"seq_ptr for \d+ sequences",
    ),
    "seq_ptr end": (
        _edit(lambda p: p.segments.seq_ptr.__setitem__(-1, p.segments.seq_ptr[-1] + 1)),
        "$.segments.seq_ptr",
        r"must run from 0 to \d+",
    ),
    "seq_ptr order": (
        _edit(lambda p: p.segments.seq_ptr.__setitem__(1, p.segments.seq_ptr[2] + 1)),
        "$.segments.seq_ptr",
        r"must not decrease",
    ),
    "segment past seq_len": (
        _edit(lambda p: p.segments.row_start.__setitem__(-1, p.seq_len - int(p.segments.length[-1]) + 1)),
        "$.segments.length",
        r"segments end past seq_len 128",
    ),
    "segment past its source": (
        _edit(lambda p: p.segments.seq_start.__setitem__(-1, p.segments.seq_start[-1] + 1)),
        "$.segments.seq_start",
        r"run past their source",
    ),
    "first_trainable": (
        _edit(lambda p: p.first_trainable.__setitem__(0, p.seq_lens[0] + 1)),
        "$.first_trainable",
        r"first_trainable outside",
    ),
    "attention tables": (
        _edit(
            lambda p: dataclasses.replace(
                p, attention=dataclasses.replace(p.attention, key_lens=p.attention.key_lens[:-1])
            )
        ),
        "$.attention.anc_ptr",
        r"attention tables for \d+ segments",
    ),
    "anc_ptr end": (
        _edit(lambda p: p.attention.anc_ptr.__setitem__(-1, p.attention.anc_ptr[-1] + 1)),
        "$.attention.anc_ptr",
        r"must run from 0 to \d+",
    ),
    "anc_ptr order": (
        _edit(lambda p: p.attention.anc_ptr.__setitem__(1, p.attention.anc_ptr[2] + 1)),
        "$.attention.anc_ptr",
        r"must not decrease",
    ),
    "gdn level sizes": (
        _edit(lambda p: _replace_level(p, 1, parent_slot=_level(p, 1).parent_slot[:-1])),
        "$.gdn.levels[1].parent_slot",
        r"parent_slot has",
    ),
    "cu_seqlens size": (
        _edit(lambda p: _replace_level(p, 1, cu_seqlens=_level(p, 1).cu_seqlens[:-1])),
        "$.gdn.levels[1].cu_seqlens",
        r"cu_seqlens for \d+ segments",
    ),
    "cu_seqlens end": (
        _edit(lambda p: _level(p, 1).cu_seqlens.__setitem__(-1, _level(p, 1).cu_seqlens[-1] + 1)),
        "$.gdn.levels[1].cu_seqlens",
        r"must run from 0 to \d+",
    ),
    "cu_seqlens order": (
        _edit(lambda p: _level(p, 1).cu_seqlens.__setitem__(1, _level(p, 1).cu_seqlens[2] + 1)),
        "$.gdn.levels[1].cu_seqlens",
        r"must not decrease",
    ),
    "rank tables": (
        _edit(lambda p: dataclasses.replace(p, ranks=dataclasses.replace(p.ranks, rank_cost=p.ranks.rank_cost[:-1]))),
        "$.ranks.rank_rows",
        r"rank tables for 2 ranks",
    ),
    "row_cost": (
        _edit(lambda p: dataclasses.replace(p, ranks=dataclasses.replace(p.ranks, row_cost=p.ranks.row_cost[:-1]))),
        "$.ranks.row_cost",
        r"row_cost for \d+ rows",
    ),
    "cp_tiles shape": (
        _edit(
            lambda p: dataclasses.replace(
                p, ranks=dataclasses.replace(p.ranks, cp_tiles=np.zeros((p.num_rows, 3), np.int32))
            )
        ),
        "$.ranks.cp_tiles",
        r"cp_tiles of shape \[\d+, 3\], expected none without CP",
    ),
    "stats rows": (
        _edit(lambda p: dataclasses.replace(p, stats=dataclasses.replace(p.stats, rows=p.stats.rows + 1))),
        "$.stats.rows",
        r"stats\.rows \d+ for num_rows \d+",
    ),
}


@pytest.mark.parametrize("name", list(RULES))
def test_every_structural_rule_refuses_alone(base, name):
    forge, path, msg = RULES[name]
    e = _refusal(forge(base))
    assert e is not None, f"{name}: not refused"
    assert e.path == path and re.search(msg, str(e)) and e.rule == "plan_structure", (name, e.path, str(e))


def test_every_bound_of_the_guard_is_tried():
    """The source's ``_in(...)`` and ``_need``/``_csr``/``_sizes`` paths all appear in the tables above.

    The guard is ``check_plan_structure`` and its named steps (``_check_*``), all scanned.
    """
    steps = [plan_wire.check_plan_structure] + [
        getattr(plan_wire, n) for n in dir(plan_wire) if n.startswith("_check_")
    ]
    src = "".join(inspect.getsource(fn) for fn in steps).replace("{where}", "$.gdn.levels[{d}]")
    bound_paths = {re.sub(r"\{d\}", "1", m) for m in re.findall(r'_in\([^\n]*?f?"(\$[^"]*)"\)', src)}
    assert len(bound_paths) >= 15, f"the scan found {len(bound_paths)} bounds: its pattern no longer matches"
    tried = {b[0] for b in BOUNDS}
    assert bound_paths <= tried, f"bounds not tried at their limits: {sorted(bound_paths - tried)}"
    paths = {p for p in re.findall(r'"(\$[^"]*)"', src) if not p.endswith(("]", "."))}  # not the prefixes
    ruled = {path for _, path, _ in RULES.values()} | tried
    missing = {p for p in paths if p not in ruled and p.replace("{d}", "1") not in ruled}
    assert not missing, f"structural rules with no forged plan: {sorted(missing)}"
