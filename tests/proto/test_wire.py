"""The wire format: buffers, round trips plan -> wire -> plan, batch encode/decode, schema files."""

from __future__ import annotations

import base64
import json

import jsonschema
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from treepack.proto.batch import PackInput, normalize_batch
from treepack.proto.batch_wire import Limits, decode_pack_request, encode_pack_request
from treepack.proto.buffers import array_from_wire, array_to_wire, decode_buffer
from treepack.proto.codec import decode_body, encode_body, parse_message, response_format
from treepack.proto.errors import DecodeError, InputTypeError, RequestError, UnsupportedMediaTypeError
from treepack.proto.pack_messages import PackRequest
from treepack.proto.plan_wire import plan_differences, plan_from_wire, plan_to_wire
from treepack.proto.schema import SCHEMAS, path_of, schema_text, stale_schemas
from treepack.proto.version import WIRE_VERSION
from treepack.service.cli.workloads import agentic, curriculum, distillation, golden_example
from treepack.service.planner import plan_batch, validate_plan

from helpers.service import pack_message, small_batch

FORMATS = ("msgpack", "json")


def _roundtrip(plan, fmt):
    return plan_from_wire(decode_body(encode_body(plan_to_wire(plan, fmt), fmt), fmt))


def _plans():
    rng = np.random.default_rng(3)
    keyed = [rng.integers(0, 5, 300, dtype=np.uint32) for _ in range(6)]
    keys = [np.where(np.arange(300) < 150, 7, i).astype(np.uint64) for i in range(6)]
    yield "golden", plan_batch(**golden_example().plan_kwargs()), None
    w = curriculum(12)
    yield "curriculum-ranks", plan_batch(**w.plan_kwargs(), num_ranks=3, conv_width=6), w
    w = agentic(4)
    yield "agentic-bfd", plan_batch(**w.plan_kwargs(), placement="bfd"), w
    w = distillation(4)
    yield "distill-no_share", plan_batch(**w.plan_kwargs(), placement="no_share"), w
    yield "keys", plan_batch(keyed, keys=keys, seq_len=1024, min_shared_len=8), None
    yield (
        "overflow",
        plan_batch([np.arange(50), np.arange(80), np.arange(20)], seq_len=60, on_overflow="drop", min_shared_len=4),
        None,
    )
    yield "all-dropped", plan_batch([np.arange(50), np.arange(80)], seq_len=10, on_overflow="drop"), None
    w = curriculum(6)
    yield "generalized", plan_batch(**w.plan_kwargs(), share_trainable=True), w


@pytest.mark.parametrize("fmt", FORMATS)
def test_plan_round_trip_is_exact_and_valid(fmt):
    names = []
    for name, plan, w in _plans():
        back = _roundtrip(plan, fmt)
        assert back.options == plan.options and (back.trainable is None) == (plan.trainable is None)
        assert plan_differences(plan, back, timings=True) == [], name
        validate_plan(back, w.sequences if w is not None else None, trainable=w.trainable if w is not None else None)
        names.append(name)
    assert len(names) == 8


def test_plan_differences_sees_a_changed_array():
    # Negative control for the equality the round-trip and backend tests rely on.
    plan = plan_batch(**curriculum(6).plan_kwargs())
    back = _roundtrip(plan, "msgpack")
    back.segments.row_start[-1] += 1
    back.gdn.levels[0].cu_seqlens[1] += 1
    diff = plan_differences(plan, back)
    assert any(d.startswith("segments.row_start") for d in diff)
    assert any(d.startswith("gdn.levels[0].cu_seqlens") for d in diff)


def test_plan_decoder_checks_dtype_and_shape():
    plan = plan_batch(**curriculum(4).plan_kwargs())
    msg = plan_to_wire(plan, "json")
    lv = msg["gdn"]["levels"][0]
    lv["cu_seqlens"] = array_to_wire(np.asarray(lv["cu_seqlens"]["data"]), "<i8", "json")
    with pytest.raises(RequestError, match=r"expected dtype <i4") as e:
        plan_from_wire(msg)
    assert e.value.path == "$.gdn.levels[0].cu_seqlens.dtype"
    msg = plan_to_wire(plan, "json")
    msg["segments"]["row"]["shape"] = [999]
    with pytest.raises(RequestError, match="needs 999 items") as e:
        plan_from_wire(msg)
    assert e.value.path == "$.segments.row.data"


BUFFER_CASES = [
    # (value, dtype, expected array or (exception, rule, path))
    (np.arange(4, dtype="<u4").tobytes(), "<u4", [0, 1, 2, 3]),
    (base64.b64encode(np.arange(3, dtype="<i8").tobytes()).decode(), "<i8", [0, 1, 2]),
    ([5, 6, 2**32 - 1], "<u4", [5, 6, 2**32 - 1]),
    ([True, 0, 1], "|u1", [1, 0, 1]),
    ([2**64 - 1], "<u8", [2**64 - 1]),
    ([], "<u4", []),
    (b"\x00" * 7, "<u4", (RequestError, "buffer_size", "$.x")),
    ("not base64!", "<u4", (RequestError, "base64", "$.x")),
    ([1, -1], "<u4", (RequestError, "range", "$.x[1]")),
    ([1, 2**32], "<u4", (RequestError, "range", "$.x[1]")),
    ([1, True], "<u4", (InputTypeError, "type", "$.x[1]")),
    ([1, 2.5], "<i8", (InputTypeError, "type", "$.x[1]")),
    ([2**64], "<u8", (RequestError, "range", "$.x[0]")),
    ({"a": 1}, "<u4", (InputTypeError, "type", "$.x")),
]


@pytest.mark.parametrize("value,dtype,expect", BUFFER_CASES)
def test_decode_buffer(value, dtype, expect):
    if isinstance(expect, tuple):
        exc, rule, path = expect
        with pytest.raises(exc) as e:
            decode_buffer(value, dtype, "$.x")
        assert (e.value.rule, e.value.path) == (rule, path)
    else:
        got = decode_buffer(value, dtype, "$.x")
        assert got.dtype == np.dtype(dtype).newbyteorder("=") and got.tolist() == expect


def test_array_objects_round_trip_2d():
    a = np.arange(12, dtype=np.int64).reshape(3, 4) - 5
    for fmt in FORMATS:
        obj = decode_body(encode_body(array_to_wire(a, "<i8", fmt), fmt), fmt)
        b = array_from_wire(obj, dtype="<i8", ndim=2, path="$.a")
        assert b.dtype == a.dtype and np.array_equal(a, b) and b.flags.writeable


def _same_batch(a, b):
    assert a.num_sequences == b.num_sequences
    for x, y in zip(a.tokens, b.tokens):
        assert x.dtype == y.dtype == np.uint32 and np.array_equal(x, y)
    assert np.array_equal(a.first_trainable, b.first_trainable)
    assert np.array_equal(a.group_codes, b.group_codes) and a.group_labels == b.group_labels
    assert (a.keys is None) == (b.keys is None)


@pytest.mark.parametrize("fmt", FORMATS)
def test_pack_request_round_trip(fmt):
    w = agentic(3)  # bool trainable arrays, interleaved
    batch = dict(sequences=w.sequences, trainable=w.trainable, groups=w.groups, seq_len=w.seq_len, tags=w.tags)
    msg = parse_message(PackRequest, decode_body(encode_body(pack_message(batch, fmt), fmt), fmt))
    got, opts = _decoded(msg)
    _same_batch(got, normalize_batch(w.sequences, seq_len=w.seq_len, trainable=w.trainable, groups=w.groups))
    assert opts.tags == tuple(w.tags) and opts.record
    # msgpack tokens are views of the one body buffer: no per-sequence copy.
    if fmt == "msgpack":
        assert all(t.base is not None for t in got.tokens)


def test_dedup_sends_each_group_prompt_once_and_rebuilds_the_same_batch():
    w = curriculum(16)
    kw = dict(sequences=w.sequences, trainable=w.trainable, groups=w.groups, seq_len=w.seq_len)
    plain = encode_body(encode_pack_request(PackInput.of(**kw), dedup=False), "msgpack")
    small = encode_body(encode_pack_request(PackInput.of(**kw)), "msgpack")
    assert len(small) < 0.6 * len(plain)
    got, _ = _decoded(parse_message(PackRequest, decode_body(small, "msgpack")))
    _same_batch(got, normalize_batch(w.sequences, seq_len=w.seq_len, trainable=w.trainable, groups=w.groups))
    # max_tokens counts the rebuilt sequences, not the bytes sent.
    with pytest.raises(RequestError, match="over the limit") as e:
        decode_pack_request(
            parse_message(PackRequest, decode_body(small, "msgpack")), Limits(max_tokens=len(small) // 4)
        )
    assert e.value.rule == "max_tokens"


def _decoded(msg, limits=Limits()):
    """(the normalized batch, the decoded request) of a pack message."""
    req = decode_pack_request(msg, limits)
    return req.normalize(req.options.seq_len, req.options.on_overflow), req


def test_pack_request_limits():
    msg = parse_message(PackRequest, pack_message(small_batch()))
    with pytest.raises(RequestError, match="over the limit of 100") as e:
        decode_pack_request(msg, Limits(max_tokens=100))
    assert e.value.rule == "max_tokens"
    with pytest.raises(RequestError, match="6 sequences, over the limit of 5"):
        decode_pack_request(msg, Limits(max_sequences=5))


@settings(max_examples=25, deadline=None)
@given(
    lens=st.lists(st.integers(1, 40), min_size=1, max_size=8),
    fmt=st.sampled_from(FORMATS),
    mode=st.sampled_from(["none", "prompt", "flags"]),
    with_keys=st.booleans(),
    grouped=st.booleans(),
    dedup=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_random_batches_survive_the_wire(lens, fmt, mode, with_keys, grouped, dedup, seed):
    rng = np.random.default_rng(seed)
    seqs = [rng.integers(0, 3, n).astype(np.int64) for n in lens]  # tiny vocabulary: lots of sharing
    trainable = None
    if mode == "prompt":
        trainable = [int(rng.integers(0, n + 1)) for n in lens]
    elif mode == "flags":
        trainable = [rng.random(n) < 0.3 for n in lens]
    keys = [rng.integers(0, 2, n).astype(np.uint64) for n in lens] if with_keys else None
    groups = [int(g) for g in rng.integers(0, 3, len(lens))] if grouped else None
    # dedup with min_prefix=1: prefix references (chains of them without groups) on tiny data
    request = PackInput.of(seqs, seq_len=64, trainable=trainable, keys=keys, groups=groups, min_shared_len=2)
    msg = encode_pack_request(request, fmt=fmt, dedup=dedup, min_prefix=1)
    body = encode_body(msg, fmt)
    msg = parse_message(PackRequest, decode_body(body, fmt))
    got, opts = _decoded(msg)
    ref = normalize_batch(seqs, seq_len=64, trainable=trainable, keys=keys, groups=groups)
    _same_batch(got, ref)
    plan = plan_batch(seqs, seq_len=64, trainable=trainable, keys=keys, groups=groups, min_shared_len=2)
    from treepack.service.planner.api import plan_normalized

    again = plan_normalized(got, opts.options)
    assert plan_differences(plan, again) == []
    validate_plan(again, seqs, trainable=trainable, keys=keys)


def test_codec_errors():
    with pytest.raises(DecodeError, match="malformed msgpack"):
        decode_body(b"\x93\x01", "msgpack")
    with pytest.raises(DecodeError, match="trailing bytes"):
        decode_body(encode_body({"a": 1}, "msgpack") + b"\x01", "msgpack")
    with pytest.raises(DecodeError, match="line 1 column"):
        decode_body(b'{"a": ', "json")
    with pytest.raises(DecodeError, match="NaN is not valid JSON"):
        decode_body(b'{"a": NaN}', "json")
    with pytest.raises(UnsupportedMediaTypeError):
        response_format("text/html, image/png;q=0.5", default="json")
    assert response_format("application/json;q=0.5, application/msgpack", default="json") == "msgpack"
    assert response_format("*/*", default="json") == "json"


def test_schema_files_are_current():
    assert stale_schemas() == [], "run: python -m treepack.proto.schema --write"
    for name in SCHEMAS:
        assert json.loads(path_of(name).read_text()) == json.loads(schema_text(name))


def test_schema_files_validate_real_json_messages():
    plan = plan_batch(**plan_kwargs_small())
    docs = {
        "pack_request": pack_message(small_batch(), "json"),
        "plan": plan_to_wire(plan, "json"),
        "pack_response": {"version": WIRE_VERSION, "plan": plan_to_wire(plan, "json"), "recorded": False},
        "error": RequestError("bad", path="$.x", rule="r").to_payload(),
    }
    for name, doc in docs.items():
        schema = json.loads(path_of(name).read_text())
        jsonschema.validate(json.loads(json.dumps(doc)), schema)
    bad = dict(docs["pack_request"], colour="red")
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(bad, json.loads(path_of("pack_request").read_text()))


def plan_kwargs_small():
    b = small_batch()
    return {k: v for k, v in b.items() if k != "tags"}
