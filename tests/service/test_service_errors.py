"""Bad input never yields a 5xx: each malformed request gets its documented 4xx, naming the field and the rule.

The service runs in-process (``httpx.ASGITransport``) with small limits and a token; after
each bad request a good one must still succeed.
"""

from __future__ import annotations

import ast
import base64
import inspect
from typing import NamedTuple

import httpx
import msgpack
import numpy as np
import pytest

from treepack.proto import batch_wire, codec, errors
from treepack.proto.codec import encode_body
from treepack.proto.errors import HTTP_STATUS
from treepack.proto.version import WIRE_VERSION
from treepack.service import Settings, create_app, dependencies, planning, pool, replay
from treepack.service import app as app_module

from helpers.service import pack_body, pack_message, small_batch

TOKEN = "s3cret-token"
AUTH = {"authorization": f"Bearer {TOKEN}"}
MP = {"content-type": "application/msgpack", **AUTH}
JS = {"content-type": "application/json", **AUTH}
LIMITS = dict(
    max_body_bytes=200_000,
    max_tokens=20_000,
    max_sequences=64,
    whatif_max_trials=50,
    whatif_max_work=20_000,
    max_tags=4,
)


@pytest.fixture(scope="module")
def app():
    app = create_app(Settings(token=TOKEN, **LIMITS))
    yield app
    app.state.service.close()


def _mp(**changes):
    msg = pack_message(small_batch())
    for k, v in changes.items():
        if v is _DROP:
            msg.pop(k)
        else:
            msg[k] = v
    return encode_body(msg, "msgpack")


def _js(**changes):
    msg = pack_message(small_batch(), "json")
    msg.update(changes)
    return encode_body(msg, "json")


_DROP = object()
_B = small_batch()
_T = sum(len(s) for s in _B["sequences"])  # tokens in the good batch
_OFF = np.concatenate([[0], np.cumsum([len(s) for s in _B["sequences"]])]).astype("<i8")
_u4 = lambda xs: np.asarray(xs, "<u4").tobytes()  # noqa: E731
_i8 = lambda xs: np.asarray(xs, "<i8").tobytes()  # noqa: E731
_GOOD = pack_body(_B)
_DEDUP = pack_message(_B, dedup=True)  # the same batch with each group's prompt sent once
assert "prefix_src" in _DEDUP


def _dd(**changes):
    return encode_body({**_DEDUP, **changes}, "msgpack")


class Case(NamedTuple):
    """One malformed request and the error it must get."""

    name: str
    method: str
    path: str
    body: bytes | None
    headers: dict[str, str]
    status: int
    kind: str
    where: str
    rule: str
    text: str  # in the message


_WHATIF = encode_body({"version": 1, "seq_len": 512, "compositions": [{"groups": 1}], "shapes": []}, "msgpack")


def _shape(run_len, seq_ptr=(0, 3)):
    """An inline what-if shape of one sequence with the given run lengths."""
    n = len(run_len)
    return {
        "seq_len": 512,
        "min_shared_len": 8,
        "seq_ptr": _i8(seq_ptr),
        "run_hash": np.arange(1, n + 1, dtype="<u8").tobytes(),
        "run_len": _i8(run_len),
        "first_trainable": _i8([0]),
        "groups": [None],
    }


# Run lengths that wrap int64 to 0: every later check passed on the wrapped sum (SIGSEGV).
_WRAP = encode_body(
    {
        "version": 1,
        "seq_len": 64,
        "trials": 1,
        "compositions": [{"groups": 1}],
        "shapes": [_shape([2**63 - 1, 2**63 - 1, 2])],
    },
    "msgpack",
)
_HEAVY = encode_body(
    {"version": 1, "seq_len": 512, "trials": 50, "compositions": [{"groups": 1}], "shapes": [_shape([300, 100, 100])]},
    "msgpack",
)
_HUGE_KEY = "k" * 150_000  # under max_body_bytes of the fixture

CASES = [
    Case(*c)
    for c in [
        (
            "truncated msgpack",
            "POST",
            "/v1/pack",
            _GOOD[:-37],
            MP,
            400,
            "malformed_body",
            "$",
            "msgpack",
            "malformed msgpack",
        ),
        (
            "garbage bytes",
            "POST",
            "/v1/pack",
            b"\xc1\xc1\xc1",
            MP,
            400,
            "malformed_body",
            "$",
            "msgpack",
            "malformed msgpack",
        ),
        (
            "trailing bytes",
            "POST",
            "/v1/pack",
            _GOOD + b"\x00",
            MP,
            400,
            "malformed_body",
            "$",
            "msgpack",
            "trailing bytes",
        ),
        (
            "non-string map key",
            "POST",
            "/v1/pack",
            msgpack.packb({1: 2}),
            MP,
            400,
            "malformed_body",
            "$",
            "msgpack",
            "malformed msgpack",
        ),
        (
            "malformed JSON",
            "POST",
            "/v1/pack",
            b'{"version": 1, "seq_len":',
            JS,
            400,
            "malformed_body",
            "$",
            "json",
            "malformed JSON",
        ),
        ("empty body", "POST", "/v1/pack", b"", MP, 400, "malformed_body", "$", "empty_body", "empty"),
        (
            "top level is an array",
            "POST",
            "/v1/pack",
            msgpack.packb([1, 2]),
            MP,
            422,
            "invalid_type",
            "$",
            "type",
            "expected a map",
        ),
        (
            "missing version",
            "POST",
            "/v1/pack",
            _mp(version=_DROP),
            MP,
            422,
            "invalid_request",
            "$.version",
            "required",
            "missing required field `version`",
        ),
        (
            "unknown version",
            "POST",
            "/v1/pack",
            _mp(version=3),
            MP,
            422,
            "unsupported_version",
            "$.version",
            "version",
            "wire version 3 is not supported; this build speaks 2 (and reads 1)",
        ),
        (
            "version of wrong type",
            "POST",
            "/v1/pack",
            _mp(version="1"),
            MP,
            422,
            "invalid_type",
            "$.version",
            "type",
            "version must be an integer",
        ),
        (
            "unknown field",
            "POST",
            "/v1/pack",
            _mp(colour="red"),
            MP,
            422,
            "invalid_request",
            "$.colour",
            "unknown_field",
            "unknown field `colour`",
        ),
        (
            "missing tokens",
            "POST",
            "/v1/pack",
            _mp(tokens=_DROP),
            MP,
            422,
            "invalid_request",
            "$.tokens",
            "required",
            "missing required field `tokens`",
        ),
        (
            "seq_len of wrong type",
            "POST",
            "/v1/pack",
            _mp(seq_len="512"),
            MP,
            422,
            "invalid_type",
            "$.seq_len",
            "type",
            "seq_len must be an int, got str",
        ),
        (
            "seq_len zero",
            "POST",
            "/v1/pack",
            _mp(seq_len=0),
            MP,
            422,
            "invalid_request",
            "$.seq_len",
            "positive",
            "seq_len must be > 0, got 0",
        ),
        (
            "tokens of wrong type",
            "POST",
            "/v1/pack",
            _mp(tokens=12),
            MP,
            422,
            "invalid_type",
            "$.tokens",
            "type",
            "expected buffer, got int",
        ),
        (
            "token buffer not whole items",
            "POST",
            "/v1/pack",
            _mp(tokens=_u4(range(_T))[:-1]),
            MP,
            422,
            "invalid_request",
            "$.tokens",
            "buffer_size",
            "not a whole number of <u4 items",
        ),
        (
            "negative token id (JSON)",
            "POST",
            "/v1/pack",
            _js(tokens=[5, 6, -3] + [1] * (_T - 3)),
            JS,
            422,
            "invalid_request",
            "$.tokens[2]",
            "range",
            "value -3 is outside",
        ),
        (
            "token id over uint32 (JSON)",
            "POST",
            "/v1/pack",
            _js(tokens=[2**32] + [1] * (_T - 1)),
            JS,
            422,
            "invalid_request",
            "$.tokens[0]",
            "range",
            "4294967296",
        ),
        (
            "token id of wrong type (JSON)",
            "POST",
            "/v1/pack",
            _js(tokens=[1, "x"] + [1] * (_T - 2)),
            JS,
            422,
            "invalid_type",
            "$.tokens[1]",
            "type",
            "expected an integer, got str",
        ),
        (
            "bad base64 (JSON)",
            "POST",
            "/v1/pack",
            _js(tokens="%%%"),
            JS,
            422,
            "invalid_request",
            "$.tokens",
            "base64",
            "expected base64",
        ),
        (
            "offsets not starting at 0",
            "POST",
            "/v1/pack",
            _mp(offsets=_i8(_OFF + 1)),
            MP,
            422,
            "invalid_request",
            "$.offsets[0]",
            "start",
            "must start at 0",
        ),
        (
            "offsets not monotone",
            "POST",
            "/v1/pack",
            _mp(offsets=_i8([0, 200, 150, *_OFF[3:]])),
            MP,
            422,
            "invalid_request",
            "$.offsets[2]",
            "monotone",
            "must not decrease",
        ),
        (
            "offsets past the buffer",
            "POST",
            "/v1/pack",
            _mp(offsets=_i8([*_OFF[:-1], _T + 5])),
            MP,
            422,
            "invalid_request",
            "$.offsets[6]",
            "buffer_end",
            "points past the end",
        ),
        (
            "offsets short of the buffer",
            "POST",
            "/v1/pack",
            _mp(offsets=_i8([*_OFF[:-1], _T - 5])),
            MP,
            422,
            "invalid_request",
            "$.offsets[6]",
            "buffer_end",
            "leaves tokens unused",
        ),
        (
            "offsets empty",
            "POST",
            "/v1/pack",
            _mp(offsets=b""),
            MP,
            422,
            "invalid_request",
            "$.offsets",
            "non_empty",
            "S+1 entries",
        ),
        (
            "empty batch",
            "POST",
            "/v1/pack",
            _mp(tokens=b"", offsets=_i8([0]), prompt_lens=_DROP, groups=_DROP, tags=_DROP),
            MP,
            422,
            "invalid_request",
            "$.sequences",
            "non_empty",
            "the batch is empty",
        ),
        (
            "empty sequence",
            "POST",
            "/v1/pack",
            _mp(offsets=_i8([0, 0, *_OFF[2:]]), prompt_lens=_DROP),
            MP,
            422,
            "invalid_request",
            "$.sequences[0]",
            "non_empty",
            "no tokens",
        ),
        (
            "trainable length mismatch",
            "POST",
            "/v1/pack",
            _mp(prompt_lens=_DROP, trainable=b"\x00" * (_T - 1)),
            MP,
            422,
            "invalid_request",
            "$.trainable",
            "length_mismatch",
            f"{_T - 1} flags for {_T} tokens",
        ),
        (
            "trainable flag not 0/1",
            "POST",
            "/v1/pack",
            _mp(prompt_lens=_DROP, trainable=b"\x00\x02" + b"\x00" * (_T - 2)),
            MP,
            422,
            "invalid_request",
            "$.trainable[1]",
            "flag",
            "must be 0 or 1, got 2",
        ),
        (
            "trainable and prompt_lens",
            "POST",
            "/v1/pack",
            _mp(trainable=b"\x00" * _T),
            MP,
            422,
            "invalid_request",
            "$.prompt_lens",
            "exclusive",
            "not both",
        ),
        (
            "prompt length out of range",
            "POST",
            "/v1/pack",
            _mp(prompt_lens=_i8([0, 9999, 0, 0, 0, 0])),
            MP,
            422,
            "invalid_request",
            "$.prompt_lens[1]",
            "range",
            "got 9999",
        ),
        (
            "sequence over capacity",
            "POST",
            "/v1/pack",
            _mp(seq_len=200),
            MP,
            422,
            "sequence_too_long",
            "$.sequences[0]",
            "max_len",
            "longer than seq_len 200",
        ),
        (
            "groups length mismatch",
            "POST",
            "/v1/pack",
            _mp(groups=["a"]),
            MP,
            422,
            "invalid_request",
            "$.groups",
            "length_mismatch",
            "1 entries for 6 sequences",
        ),
        (
            "group of wrong type",
            "POST",
            "/v1/pack",
            _mp(groups=["a", 1.5, "a", "b", "b", "b"]),
            MP,
            422,
            "invalid_type",
            "$.groups[1]",
            "type",
            "got float",
        ),
        (
            "tags length mismatch",
            "POST",
            "/v1/pack",
            _mp(tags=["x"]),
            MP,
            422,
            "invalid_request",
            "$.tags",
            "length_mismatch",
            "1 entries for 6 sequences",
        ),
        (
            "unknown placement",
            "POST",
            "/v1/pack",
            _mp(placement="best"),
            MP,
            422,
            "invalid_request",
            "$.placement",
            "enum",
            "unknown placement 'best'; expected one of ('auto', 'bfd', 'in_order', 'no_share')",
        ),
        (
            "min_shared_len zero",
            "POST",
            "/v1/pack",
            _mp(min_shared_len=0),
            MP,
            422,
            "invalid_request",
            "$.min_shared_len",
            "minimum",
            "min_shared_len must be >= 1, got 0",
        ),
        (
            "keys length mismatch",
            "POST",
            "/v1/pack",
            _mp(keys=np.zeros(3, "<u8").tobytes()),
            MP,
            422,
            "invalid_request",
            "$.keys",
            "length_mismatch",
            f"3 entries for {_T} tokens",
        ),
        (
            "prefix_src without prefix_len",
            "POST",
            "/v1/pack",
            _dd(prefix_len=None),
            MP,
            422,
            "invalid_request",
            "$.prefix_len",
            "together",
            "go together",
        ),
        (
            "prefix from a later sequence",
            "POST",
            "/v1/pack",
            _dd(prefix_src=_i8([-1, 0, 0, -1, 5, 3])),
            MP,
            422,
            "invalid_request",
            "$.prefix_src[4]",
            "earlier",
            "must be -1 or an earlier sequence, got 5",
        ),
        (
            "prefix longer than its source",
            "POST",
            "/v1/pack",
            _dd(prefix_len=_i8([0, 180, 180, 0, 180, 9999])),
            MP,
            422,
            "invalid_request",
            "$.prefix_len[5]",
            "range",
            "got 9999",
        ),
        (
            "prefix length without a source",
            "POST",
            "/v1/pack",
            _dd(prefix_len=_i8([5, 180, 180, 0, 180, 180])),
            MP,
            422,
            "invalid_request",
            "$.prefix_len[0]",
            "range",
            "must be 0 without a prefix_src",
        ),
        (
            "too many tokens",
            "POST",
            "/v1/pack",
            _mp(tokens=_u4(np.zeros(30_000)), offsets=_i8([0, 30_000]), prompt_lens=_DROP, groups=_DROP, tags=_DROP),
            MP,
            413,
            "too_large",
            "$.tokens",
            "max_tokens",
            "over the limit of 20000",
        ),
        (
            "too many sequences",
            "POST",
            "/v1/pack",
            _mp(tokens=_u4(np.zeros(100)), offsets=_i8(range(101)), prompt_lens=_DROP, groups=_DROP, tags=_DROP),
            MP,
            413,
            "too_large",
            "$.offsets",
            "max_sequences",
            "100 sequences, over the limit of 64",
        ),
        (
            "huge body",
            "POST",
            "/v1/pack",
            b"\x00" * 300_000,
            MP,
            413,
            "too_large",
            "$",
            "max_body_bytes",
            "over the limit of 200000",
        ),
        (
            "wrong content type",
            "POST",
            "/v1/pack",
            _GOOD,
            {"content-type": "text/plain", **AUTH},
            415,
            "unsupported_media_type",
            "Content-Type",
            "media_type",
            "'text/plain' is not spoken here",
        ),
        (
            "unacceptable Accept",
            "POST",
            "/v1/pack",
            _GOOD,
            {**MP, "accept": "text/html"},
            415,
            "unsupported_media_type",
            "Accept",
            "media_type",
            "names no format spoken here",
        ),
        (
            "no token",
            "POST",
            "/v1/pack",
            _GOOD,
            {"content-type": "application/msgpack"},
            401,
            "unauthorized",
            "Authorization",
            "bearer",
            "Bearer <token>",
        ),
        (
            "wrong token",
            "POST",
            "/v1/pack",
            _GOOD,
            {"content-type": "application/msgpack", "authorization": "Bearer nope"},
            401,
            "unauthorized",
            "Authorization",
            "token",
            "wrong bearer token",
        ),
        (
            "wrong scheme",
            "GET",
            "/v1/history",
            None,
            {"authorization": f"Basic {base64.b64encode(b'a:b').decode()}"},
            401,
            "unauthorized",
            "Authorization",
            "bearer",
            "Bearer <token>",
        ),
        (
            "whatif: groups and by_tag",
            "POST",
            "/v1/whatif",
            encode_body({"version": 1, "seq_len": 512, "compositions": [{"groups": 1, "by_tag": {"a": 1}}]}, "msgpack"),
            MP,
            422,
            "invalid_request",
            "$.compositions[0]",
            "one_of",
            "exactly one of",
        ),
        (
            "whatif: too many trials",
            "POST",
            "/v1/whatif",
            encode_body(
                {"version": 1, "seq_len": 512, "trials": 30, "compositions": [{"groups": 1}, {"groups": 2}]}, "msgpack"
            ),
            MP,
            413,
            "too_large",
            "$.trials",
            "max_trials",
            "60 planner runs, over the limit of 50",
        ),
        (
            "pack: more distinct tags than max_tags",
            "POST",
            "/v1/pack",
            _mp(tags=["a", "b", "c", "d", "e", "a"]),
            MP,
            413,
            "too_large",
            "$.tags",
            "max_tags",
            "5 distinct tags, over the limit of 4 (max_tags)",
        ),
        (
            "whatif: by_tag names more tags than max_tags",
            "POST",
            "/v1/whatif",
            encode_body(
                {"version": 1, "seq_len": 512, "compositions": [{"by_tag": {t: 1 for t in "abcde"}}]}, "msgpack"
            ),
            MP,
            413,
            "too_large",
            "$.compositions[0].by_tag",
            "max_tags",
            "5 distinct tags",
        ),
        (
            "pack: an allgather CP split over max_cp_tiles",
            "POST",
            "/v1/pack",
            _mp(seq_len=100_000, cp_size=2, cp_attention="allgather"),
            MP,
            413,
            "too_large",
            "$.seq_len",
            "max_cp_tiles",
            "6250 tiles of 16 tokens, over the limit of 1250 (max_cp_tiles)",
        ),
        (
            "pack: a group id that is no Unicode text (lone surrogate)",
            "POST",
            "/v1/pack",
            _js(groups=["\udfff"] * 6),
            JS,
            422,
            "invalid_request",
            "$.groups[0]",
            "unicode",
            "lone surrogate",
        ),
        (
            "whatif: pool too small",
            "POST",
            "/v1/whatif",
            encode_body(
                {"version": 1, "seq_len": 512, "compositions": [{"by_tag": {"math": 2, "code": 9}}], "shapes": []},
                "msgpack",
            ),
            MP,
            422,
            "invalid_request",
            "$.shapes",
            "no_history",
            "no recorded batches",
        ),
        (
            "whatif: malformed msgpack",
            "POST",
            "/v1/whatif",
            _WHATIF[:-3],
            MP,
            400,
            "malformed_body",
            "$",
            "msgpack",
            "malformed msgpack",
        ),
        (
            "whatif: wrong content type",
            "POST",
            "/v1/whatif",
            _WHATIF,
            {"content-type": "text/csv", **AUTH},
            415,
            "unsupported_media_type",
            "Content-Type",
            "media_type",
            "'text/csv' is not spoken here",
        ),
        (
            "whatif: no token",
            "POST",
            "/v1/whatif",
            _WHATIF,
            {"content-type": "application/msgpack"},
            401,
            "unauthorized",
            "Authorization",
            "bearer",
            "Bearer <token>",
        ),
        (
            "whatif: run lengths wrap int64",
            "POST",
            "/v1/whatif",
            _WRAP,
            MP,
            422,
            "invalid_request",
            "$.shapes[0].run_len",
            "max_tokens",
            "over the limit of 281474976710656",
        ),
        (
            "whatif: work over the budget",
            "POST",
            "/v1/whatif",
            _HEAVY,
            MP,
            413,
            "too_large",
            "$.trials",
            "max_work",
            "may plan 25000 tokens, over the work limit of 20000",
        ),
        (
            "duplicate key (msgpack)",
            "POST",
            "/v1/pack",
            b"\x82\xa7version\x01\xa7version\x01",
            MP,
            400,
            "malformed_body",
            "$",
            "duplicate_key",
            "'version' appears twice",
        ),
        (
            "duplicate key (JSON)",
            "POST",
            "/v1/pack",
            b'{"version": 1, "seq_len": 5, "seq_len": 6}',
            JS,
            400,
            "malformed_body",
            "$",
            "duplicate_key",
            "'seq_len' appears twice",
        ),
        (
            "gzip body",
            "POST",
            "/v1/pack",
            _GOOD,
            {**MP, "content-encoding": "gzip"},
            415,
            "unsupported_media_type",
            "Content-Encoding",
            "content_encoding",
            "'gzip' is not supported",
        ),
        (
            "Accept with q=nan",
            "POST",
            "/v1/pack",
            _GOOD,
            {**MP, "accept": "application/json;q=nan"},
            415,
            "unsupported_media_type",
            "Accept",
            "media_type",
            "names no format",
        ),
        (
            "bad Idempotency-Key",
            "POST",
            "/v1/pack",
            _GOOD,
            {**MP, "idempotency-key": "k" * 200},
            422,
            "invalid_request",
            "Idempotency-Key",
            "header",
            "1 to 128 printable ASCII",
        ),
        (
            "Content-Length not an integer",
            "POST",
            "/v1/pack",
            _GOOD,
            {**MP, "content-length": "12x"},
            400,
            "malformed_body",
            "Content-Length",
            "header",
            "'12x' is not an integer",
        ),
        (
            "history: unacceptable Accept",
            "GET",
            "/v1/history",
            None,
            {**AUTH, "accept": "text/html"},
            415,
            "unsupported_media_type",
            "Accept",
            "media_type",
            "names no format spoken here",
        ),
        (
            "metrics: wrong token",
            "GET",
            "/metrics",
            None,
            {"authorization": "Bearer nope"},
            401,
            "unauthorized",
            "Authorization",
            "token",
            "wrong bearer token",
        ),
        (
            "wrong method",
            "GET",
            "/v1/pack",
            None,
            AUTH,
            405,
            "method_not_allowed",
            "$",
            "method_not_allowed",
            "Method Not Allowed",
        ),
        ("unknown route", "GET", "/v2/pack", None, AUTH, 404, "not_found", "$", "not_found", "Not Found"),
    ]
]

# Rules the table need not hold, and where they are tested instead.
_TESTED_ELSEWHERE = {
    "queue_full": "503, test_service_app.py (overload)",
    "bug": "500, no request can provoke it",
    "intake_budget": "503, test_hardening.py (bodies in flight)",
    "body_timeout": "408, test_hardening.py (a stalled body)",
    "body_first_byte": "408, test_hardening_intake.py (an announced body that never starts)",
    "idempotency": "409, test_hardening.py (a key reused)",
    "deadline": "504, test_hardening.py (a what-if past its deadline)",
    "cancelled": "no answer (the client left), test_hardening.py",
    "history_damaged": "503, test_history_integrity.py",
}
# Statuses documented on routes whose cases need more than one request (see above).
_STATUS_ELSEWHERE = {
    ("POST", "/v1/pack", 408),
    ("POST", "/v1/whatif", 408),
    ("POST", "/v1/pack", 409),
    ("POST", "/v1/whatif", 409),
}
# The modules that refuse a request before or while the service decodes it.
_REFUSING_MODULES = (dependencies, planning, pool, replay, app_module, batch_wire, codec)


def _rules_raised_in(module) -> set[str]:
    """Every ``rule="..."`` literal passed in ``module``'s source."""
    tree = ast.parse(inspect.getsource(module))
    return {
        kw.value.value
        for node in ast.walk(tree)
        if isinstance(node, ast.Call)
        for kw in node.keywords
        if kw.arg == "rule" and isinstance(kw.value, ast.Constant) and isinstance(kw.value.value, str)
    }


def test_the_table_covers_every_documented_client_error(app):
    documented = {
        (method.upper(), path, int(status))
        for path, ops in app.openapi()["paths"].items()
        for method, op in ops.items()
        for status in op["responses"]
        if 400 <= int(status) < 500
    }
    tested = {(c.method, c.path, c.status) for c in CASES}
    assert len(documented) >= 10  # the document lists them (guard against an empty walk)
    assert documented - tested - _STATUS_ELSEWHERE == set(), "documented statuses without a case"


def test_the_table_covers_every_client_error_kind():
    # unsupported_model is raised by the trainer's model check and cost_model_error by a cost
    # file read at startup (tests/service/test_cost_sidecar.py), never by a service route.
    never_routed = (errors.UnsupportedModelError, errors.CostModelError)
    kinds = {cls.kind for cls, status in HTTP_STATUS.items() if 400 <= status < 500 and cls not in never_routed} | {
        "not_found",
        "method_not_allowed",
    }
    kinds -= {"body_timeout", "conflict"}  # test_hardening.py
    assert len(kinds) >= 9
    assert kinds - {c.kind for c in CASES} == set(), "error kinds without a case"


def test_the_table_covers_every_rule_the_service_refuses_with():
    rules = set().union(*(_rules_raised_in(m) for m in _REFUSING_MODULES))
    assert {"bearer", "max_body_bytes", "max_trials", "msgpack", "buffer_end"} <= rules  # the walk finds them
    assert set(_TESTED_ELSEWHERE) <= rules  # and the exemptions are still real rules
    assert rules - set(_TESTED_ELSEWHERE) - {c.rule for c in CASES} == set(), "rules without a case"


@pytest.mark.parametrize("case", [pytest.param(c, id=c.name) for c in CASES])
async def test_bad_request(app, case):
    name, method, path, body, headers, status, kind, where, rule, text = case
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://t") as c:
        r = await c.request(method, path, content=body, headers=headers)
        assert r.status_code == status, r.text
        assert r.headers["content-type"].startswith("application/json")
        err = r.json()
        assert (err["error"], err["path"], err["rule"]) == (kind, where, rule), err
        assert text in err["message"], err["message"]
        assert err["version"] == WIRE_VERSION
        if status == 401:
            assert r.headers["www-authenticate"].startswith("Bearer")
        # The service keeps serving.
        ok = await c.post("/v1/pack", content=_GOOD, headers={**MP, "accept": "application/json"})
        assert ok.status_code == 200, ok.text
        assert ok.json()["plan"]["num_rows"] >= 1


async def test_echoed_values_are_truncated(app):
    body = encode_body({**pack_message(small_batch()), _HUGE_KEY: 1}, "msgpack")
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://t") as c:
        r = await c.post("/v1/pack", content=body, headers=MP)
    assert r.status_code == 422 and r.json()["rule"] == "unknown_field"
    assert len(r.content) < 1000, len(r.content)  # a long unknown key was echoed twice before


async def test_errors_are_counted_by_kind(app):
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://t") as c:
        await c.post("/v1/pack", content=b"\xc1", headers=MP)
        text = (await c.get("/metrics", headers=AUTH)).text
    assert 'treepack_errors_total{kind="malformed_body"}' in text
    assert 'treepack_requests_total{method="POST",route="/v1/pack",status="400"}' in text


def _error_classes() -> list[type[errors.TreepackError]]:
    """Every subclass of TreepackError that treepack.proto.errors defines (the base excluded)."""
    found, todo = [], [errors.TreepackError]
    while todo:
        for sub in todo.pop().__subclasses__():
            if sub.__module__ == errors.__name__ and sub not in found:
                found.append(sub)
                todo.append(sub)
    return found


# Raised by the client only: it never crosses the wire, so the service has no status for it.
_CLIENT_SIDE = {errors.TransportError}

# What a client may rely on (SPEC section 6: malformed 400, schema 422, too large 413, wrong
# content type 415, overloaded 503 ...), written out here rather than read from the app's
# own HTTP_STATUS table, so a wrong entry there fails.
EXPECTED_STATUS = {
    "DecodeError": 400,
    "AuthError": 401,
    "BodyTimeoutError": 408,
    "ConflictError": 409,
    "PayloadTooLargeError": 413,
    "UnsupportedMediaTypeError": 415,
    "RequestError": 422,
    "InputTypeError": 422,
    "CapacityError": 422,
    "UnsupportedVersionError": 422,
    "UnsupportedModelError": 422,
    "CostModelError": 422,
    "ServerError": 500,
    "OverloadedError": 503,
    "UnavailableError": 503,
    "DeadlineError": 504,
}


def test_the_status_table_covers_every_error_class():
    classes = set(_error_classes())
    assert len(classes) >= 11 and errors.CapacityError in classes  # the walk reaches the grandchildren
    assert classes - _CLIENT_SIDE == set(HTTP_STATUS), "error classes without an HTTP status (or stale entries)"
    assert {c.__name__ for c in classes - _CLIENT_SIDE} == set(EXPECTED_STATUS), (
        "a new error class needs its expected status written here"
    )


@pytest.mark.parametrize("cls", [pytest.param(c, id=c.__name__) for c in _error_classes() if c not in _CLIENT_SIDE])
async def test_the_app_answers_each_error_class_with_its_status(cls):
    app = create_app(Settings(history_enabled=False))

    async def fail() -> None:
        raise cls("raised on purpose", path="$.here", rule="on_purpose")

    app.add_api_route("/fail", fail, methods=["GET"])
    try:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://t") as c:
            r = await c.get("/fail")
            metrics = (await c.get("/metrics")).text
    finally:
        app.state.service.close()
    assert r.status_code == EXPECTED_STATUS[cls.__name__]
    assert r.json()["error"] == cls.kind and (r.json()["path"], r.json()["rule"]) == ("$.here", "on_purpose")
    assert f'treepack_errors_total{{kind="{cls.kind}"}} 1.0' in metrics
    back = errors.error_from_payload(r.json(), r.status_code)  # the client maps it back to the same class
    assert type(back) is cls and back.message == "raised on purpose"
