"""Schemathesis against the service's own OpenAPI document: no 5xx, answers as documented,
and what the schema calls valid is never refused for a rule the schema states.

Runs in-process (ASGI), both media types (a msgpack serializer/deserializer is registered),
positive and negative examples, a bounded number per operation (a few hundred; the whole
run stays under two minutes).
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
# A request over a limit the schema states (what-if trials from the settings, ...) is refused with 413.
schema.config.checks.negative_data_rejection.expected_statuses = [
    *schema.config.checks.negative_data_rejection.expected_statuses,
    "413",
]


def _packable(x: Any) -> Any:
    # msgpack has no integers beyond 64 bits; a real client could only send them as floats.
    if isinstance(x, int) and not isinstance(x, bool) and not -(2**63) <= x < 2**64:
        return float(x)
    # The schema's numbers are JSON's, where 2.0 is the integer 2; msgpack's form of a whole
    # number is an int (a msgpack float where an integer belongs is refused, as embedded).
    if isinstance(x, float) and x.is_integer() and -(2**63) <= x < 2**64:
        return int(x)
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


# Refusals of a rule the schema states in full (types, enums, one-of, required, unknown
# fields, the wire version): a schema-valid request must never get one. Rules the schema
# states only in part or not at all (ranges that depend on other fields, offsets that cut
# the tokens, list lengths matching the sequence count, a `by_tag` summing to >= 1) may
# still refuse a schema-valid request with 413/422.
SCHEMA_RULES = {"type", "enum", "one_of", "required", "unknown_field", "version", "positive"}


def schema_rules_hold(ctx: Any, response: Any, case: Any) -> None:
    """A positive (schema-valid) case is not refused for a rule its schema states."""
    generation = getattr(getattr(case, "meta", None), "generation", None)
    mode = getattr(getattr(generation, "mode", None), "value", None)
    if mode != "positive" or response.status_code != 422:
        return None
    err = response.json()
    if err.get("rule") in SCHEMA_RULES:
        raise AssertionError(
            f"a schema-valid request was refused: {err.get('rule')} at {err.get('path')}: {err.get('message')}"
        )
    return None


CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_schema_conformance,
    negative_data_rejection,
    schema_rules_hold,
]


@pytest.fixture(scope="module", autouse=True)
def _close_app():
    yield
    APP.state.service.close()


@schema.parametrize()
@settings(max_examples=200, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
def test_openapi_contract(case):
    case.call_and_validate(checks=CHECKS)
