"""Schemathesis against the service's own OpenAPI document: no 5xx, answers as documented.

Runs in-process (ASGI), both media types (a msgpack serializer/deserializer is registered),
positive and negative examples, a bounded number per operation.
"""

from __future__ import annotations

import base64
from typing import Any

import msgpack
import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    negative_data_rejection,
    response_schema_conformance,
    status_code_conformance,
)

from treepack.service import Settings, create_app

# Small limits so that generated bodies exercise the 413 paths too.
APP = create_app(Settings(max_body_bytes=1_000_000, max_tokens=100_000, max_sequences=1_000, whatif_max_trials=20))
schema = schemathesis.openapi.from_asgi("/openapi.json", APP)


def _packable(x: Any) -> Any:
    # msgpack has no integers beyond 64 bits; a real client could only send them as floats.
    if isinstance(x, int) and not isinstance(x, bool) and not -(2**63) <= x < 2**64:
        return float(x)
    if isinstance(x, dict):
        return {k: _packable(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_packable(v) for v in x]
    return x


@schemathesis.serializer("application/msgpack")
def _to_msgpack(ctx: Any, value: Any) -> bytes:
    return msgpack.packb(_packable(value), use_bin_type=True)


def _jsonable(x: Any) -> Any:
    # The OpenAPI schema describes msgpack bins as base64 strings (their JSON form).
    if isinstance(x, bytes):
        return base64.b64encode(x).decode()
    if isinstance(x, dict):
        return {k: _jsonable(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_jsonable(v) for v in x]
    return x


@schemathesis.deserializer("application/msgpack")
def _from_msgpack(ctx: Any, response: Any) -> Any:
    return _jsonable(msgpack.unpackb(response.content, raw=False))


CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance, negative_data_rejection]


@pytest.fixture(scope="module", autouse=True)
def _close_app():
    yield
    APP.state.service.close()


@schema.parametrize()
@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
def test_openapi_contract(case):
    case.call_and_validate(checks=CHECKS)
