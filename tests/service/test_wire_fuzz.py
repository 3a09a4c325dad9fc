"""Integer extremes in every numeric field of every message: a 4xx or an answer, never a crash, a 5xx or a runaway.

Hypothesis picks a field of a valid pack request, what-if request (inline shapes) or plan,
an extreme integer, where it goes (one item of a buffer, all of them, or a scalar), and
how a buffer travels (typed bytes, so the value wraps to the dtype as an attacker would
send it, or a list of numbers). The service's decode-and-plan path
(:class:`~treepack.service.planning.PlanningService`) must answer or refuse with a
:class:`RequestError` within its work bounds; the client's plan decoder must refuse or
give a plan whose per-token arrays can be derived.
"""

from __future__ import annotations

import copy
from collections import Counter

import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from treepack.proto.codec import encode_body
from treepack.proto.errors import RequestError, TreepackError
from treepack.proto.plan_wire import plan_from_wire, plan_to_wire
from treepack.proto.shape_wire import shape_to_wire
from treepack.service import Settings
from treepack.service.planner import plan_batch
from treepack.service.planner.fingerprint import shape_job
from treepack.service.planning import PlanningService
from treepack.service.pool import Ticket

from helpers.service import pack_message, plan_kwargs, small_batch

EXTREMES = [
    0,
    1,
    -1,
    2,
    255,
    256,
    2**31 - 1,
    2**31,
    2**32 - 1,
    2**32,
    2**48,
    2**53 + 1,
    2**62,
    2**63 - 1,
    -(2**63),
    2**63,
    2**64 - 1,
    2**64,
    -(2**64),
]
_DTYPE = {
    "tokens": "<u4",
    "offsets": "<i8",
    "prompt_lens": "<i8",
    "keys": "<u8",
    "prefix_src": "<i8",
    "prefix_len": "<i8",
    "trainable": "|u1",
    "seq_ptr": "<i8",
    "run_hash": "<u8",
    "run_len": "<i8",
    "first_trainable": "<i8",
}
OUTCOMES: Counter = Counter()


@pytest.fixture(scope="module")
def svc():
    s = PlanningService(
        Settings(
            history_enabled=False, max_tokens=20_000, max_sequences=64, whatif_max_trials=200, whatif_max_work=400_000
        )
    )
    yield s
    s.close()


def _wrap(value: int, dtype: str) -> bytes:
    """``value`` as one item of ``dtype``, wrapped modulo its width (typed bytes carry no range)."""
    dt = np.dtype(dtype)
    bits = 8 * dt.itemsize
    return int(value % 2**bits).to_bytes(dt.itemsize, "little")


def _put(msg: dict, key: str, value: int, where: int | None, as_list: bool, pair: bool = False) -> None:
    """Put ``value`` in ``msg[key]``: the scalar, one buffer item (``where``), or every item (None).

    With ``pair`` (typed bytes, one item), ``value`` goes into two neighbouring items and
    a third absorbs the change modulo the dtype's width: the buffer's wrapped sum stays
    what it was and, for ``2**63 - 1``, every item stays positive, so every check done in
    wrapped arithmetic passes (the issue's attack: run lengths that sum past int64).
    """
    old = msg.get(key)
    if key not in _DTYPE:
        msg[key] = value
        return
    dtype = _DTYPE[key]
    n = 4 if old is None else len(bytes(old)) // np.dtype(dtype).itemsize
    n = max(n, 1)
    if as_list:
        items = list(np.frombuffer(bytes(old), dtype=dtype).tolist()) if old is not None else [0] * n
        items = items or [0]
        if where is None:
            items = [value] * len(items)
        else:
            items[where % len(items)] = value
        msg[key] = items
        return
    raw = bytearray(bytes(old) if old is not None else b"\x00" * (n * np.dtype(dtype).itemsize)) or bytearray(
        np.dtype(dtype).itemsize
    )
    size = np.dtype(dtype).itemsize
    count = len(raw) // size
    if pair and where is not None and count >= 3:
        i = where % (count - 2)
        old = [int(x) for x in np.frombuffer(bytes(raw[i * size : (i + 3) * size]), dtype=dtype).tolist()]
        raw[i * size : (i + 1) * size] = _wrap(value, dtype)
        raw[(i + 1) * size : (i + 2) * size] = _wrap(value, dtype)
        raw[(i + 2) * size : (i + 3) * size] = _wrap(sum(old) - 2 * value, dtype)
        msg[key] = bytes(raw)
        return
    for i in range(count) if where is None else [where % count]:
        raw[i * size : (i + 1) * size] = _wrap(value, dtype)
    msg[key] = bytes(raw)


def _run(svc: PlanningService, method: str, msg: dict) -> None:
    work = svc.pack if method == "pack" else svc.whatif
    try:
        body = encode_body(msg, "msgpack")
    except OverflowError:  # msgpack carries integers in [-2**63, 2**64) only: nothing to send
        return
    try:
        work(body, "msgpack", "msgpack", Ticket(20.0))
        OUTCOMES[method, "answered"] += 1
    except RequestError:
        OUTCOMES[method, "refused"] += 1
    # Anything else (ServerError, DeadlineError, IndexError, MemoryError, ...) fails the test.


PACK_FIELDS = [
    "seq_len",
    "min_shared_len",
    "min_shared_saving",
    "repair_ms",
    "num_ranks",
    "conv_width",
    "version",
    "tokens",
    "offsets",
    "prompt_lens",
    "keys",
    "prefix_src",
    "prefix_len",
    "trainable",
]
_BASE_PACK = {
    k: bytes(v) if isinstance(v, memoryview) else v for k, v in pack_message(small_batch(), dedup=True).items()
}


@settings(
    max_examples=250, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    key=st.sampled_from(PACK_FIELDS + ["groups"]),
    value=st.sampled_from(EXTREMES),
    where=st.one_of(st.none(), st.integers(0, 3000)),
    as_list=st.booleans(),
    pair=st.booleans(),
)
@example(key="prefix_len", value=2**63 - 1, where=1, as_list=False, pair=True)
def test_pack_request_extremes(svc, key, value, where, as_list, pair):
    msg = copy.deepcopy(_BASE_PACK)
    if key == "trainable":
        msg.pop("prompt_lens")
        msg["trainable"] = b"\x00" * (len(msg["tokens"]) // 4 + int(sum(np.frombuffer(msg["prefix_len"], "<i8"))))
    if key == "groups":
        msg["groups"] = [value if i == (where or 0) % 6 else i for i in range(6)]
    else:
        _put(msg, key, value, where, as_list, pair)
    _run(svc, "pack", msg)


def _materialize(msg: dict) -> dict:
    """Buffers as plain bytes (shape_to_wire gives memoryviews)."""
    for s in msg.get("shapes", []):
        for k, v in s.items():
            if isinstance(v, memoryview):
                s[k] = bytes(v)
    return msg


def _base_whatif() -> dict:
    plan_input = small_batch()
    from treepack.proto.batch import PackInput
    from treepack.proto.options import PlanOptions
    from treepack.service.planner.api import plan_request

    opts = PlanOptions(seq_len=512, min_shared_len=8)
    result = plan_request(
        PackInput(
            sequences=plan_input["sequences"],
            trainable=plan_input["trainable"],
            groups=plan_input["groups"],
            options=opts,
        )
    )
    shape = shape_job(result)()
    return {
        "version": 1,
        "seq_len": 512,
        "trials": 3,
        "min_shared_len": 8,
        "compositions": [{"groups": 2}],
        "shapes": [shape_to_wire(shape, "msgpack")],
    }


_BASE_WHATIF = _materialize(_base_whatif())
_WHATIF_FIELDS = [
    "seq_len",
    "trials",
    "seed",
    "min_shared_len",
    "min_shared_saving",
    "repair_ms",
    "num_ranks",
    "conv_width",
    "max_rows",
    "history_batches",
    "comp.groups",
    "comp.by_tag",
]
_SHAPE_FIELDS = [
    "shape.seq_len",
    "shape.min_shared_len",
    "shape.seq_ptr",
    "shape.run_hash",
    "shape.run_len",
    "shape.first_trainable",
    "shape.groups",
]


@settings(
    max_examples=250, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    key=st.sampled_from(_WHATIF_FIELDS + _SHAPE_FIELDS),
    value=st.sampled_from(EXTREMES),
    where=st.one_of(st.none(), st.integers(0, 50)),
    as_list=st.booleans(),
    pair=st.booleans(),
)
@example(key="shape.run_len", value=2**63 - 1, where=0, as_list=False, pair=True)  # the SIGSEGV of issue 12
def test_whatif_request_extremes(svc, key, value, where, as_list, pair):
    msg = copy.deepcopy(_BASE_WHATIF)
    if key == "comp.groups":
        msg["compositions"] = [{"groups": value}]
    elif key == "comp.by_tag":
        msg["compositions"] = [{"by_tag": {"": value}}]
    elif key == "shape.groups":
        shape = msg["shapes"][0]
        shape["groups"] = [
            value if i == (where or 0) % len(shape["groups"]) else g for i, g in enumerate(shape["groups"])
        ]
    elif key.startswith("shape."):
        _put(msg["shapes"][0], key.removeprefix("shape."), value, where, as_list, pair)
    else:
        _put(msg, key, value, where, as_list, pair)
    _run(svc, "whatif", msg)


# repair_ms=0: the plan (and so the fields the sweep draws from) must not depend on how busy the machine is.
_PLAN = plan_batch(**{**plan_kwargs(small_batch()), "repair_ms": 0})
# A decoded plan may legitimately ask for rows of 2**31 - 1 tokens; its per-token arrays are then
# not materialized here (a row of that length is gigabytes), only the structure is checked.
_MAX_MATERIALIZED = 1 << 22


def _plan_fields() -> list[tuple[str, ...]]:
    wire = plan_to_wire(_PLAN, "json")
    out: list[tuple[str, ...]] = [("num_rows",), ("seq_len",), ("min_shared_len",)]

    def walk(obj, path):
        if isinstance(obj, dict) and set(obj) == {"dtype", "shape", "data"}:
            out.append(path + ("data",))
            out.append(path + ("shape",))
        elif isinstance(obj, dict):
            for k, v in obj.items():
                walk(v, path + (k,))
        elif isinstance(obj, list) and obj and isinstance(obj[0], dict):
            walk(obj[0], path + (0,))

    walk(wire, ())
    return out


PLAN_FIELDS = _plan_fields()


@settings(max_examples=400, deadline=None, derandomize=True)
@given(field=st.sampled_from(PLAN_FIELDS), value=st.sampled_from(EXTREMES), where=st.integers(0, 500))
def test_decoded_plan_extremes(field, value, where):
    wire = plan_to_wire(_PLAN, "json")
    parent = wire
    for part in field[:-1]:
        parent = parent[part]
    last = field[-1]
    if last in ("data", "shape"):
        items = parent[last]
        if items:
            items[where % len(items)] = value
        else:
            parent[last] = [value]
    else:
        parent[last] = value
    try:
        plan = plan_from_wire(wire)
    except TreepackError:
        OUTCOMES["plan", "refused"] += 1
        return
    OUTCOMES["plan", "decoded"] += 1
    if plan.num_rows * plan.seq_len > _MAX_MATERIALIZED:
        OUTCOMES["plan", "decoded_huge_rows"] += 1
        assert plan.seq_len > _PLAN.seq_len or plan.num_rows > _PLAN.num_rows  # only the size fields can make it huge
        return
    # Structurally sound: the per-token arrays derive without an index error.
    assert plan.position_ids().shape == (plan.num_rows, plan.seq_len)
    plan.token_source()
    plan.segment_ids()


def test_the_fuzzing_reached_both_outcomes():
    """Guard against a vacuous run: each message had answered and refused cases (runs after the sweeps)."""
    for kind, ok in (("pack", "answered"), ("whatif", "answered"), ("plan", "decoded")):
        assert OUTCOMES[kind, ok] > 0 and OUTCOMES[kind, "refused"] > 0, dict(OUTCOMES)
