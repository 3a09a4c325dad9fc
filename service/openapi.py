"""The OpenAPI document: routes read raw bodies (msgpack or JSON), so their schemas are added here.

Each operation's request body and 200 response name the message models of
:mod:`treepack.proto.messages` under both media types; every documented error status
names :class:`~treepack.proto.messages.ErrorBody`. The model schemas go into
``components/schemas`` as pydantic writes them, so the OpenAPI document, the JSON Schema
files under ``proto/`` and the validators are one schema; the running settings' limits
(what-if trials, sequences per list) are written into them too.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic.json_schema import models_json_schema

from treepack.proto import messages as m
from treepack.proto.codec import JSON, MSGPACK
from treepack.proto.version import WIRE_VERSION

__all__ = ["body_spec", "install_openapi", "OFFLINE_DOCS", "MODELS", "ERRORS", "PACK_EXAMPLE", "WHATIF_EXAMPLE"]

MODELS = (
    m.PackRequest,
    m.PackResponse,
    m.WhatIfRequest,
    m.WhatIfResponse,
    m.HistorySummary,
    m.HealthResponse,
    m.ReadyResponse,
    m.ErrorBody,
)

ERRORS = {
    400: "malformed msgpack/JSON body (duplicate keys included)",
    401: "missing or wrong bearer token (when the service has one)",
    408: "the body did not arrive within body_timeout_s",
    409: "an Idempotency-Key reused for a different request",
    413: "body, sequences, tokens or what-if work over the configured limits",
    415: "Content-Type or Accept names a format other than msgpack/JSON, or the body has a Content-Encoding",
    422: "the request breaks a rule; the body names the field path and the rule",
    503: (
        "the planner queue or the body intake budget is full (retry after Retry-After seconds), "
        "or the history is damaged"
    ),
    504: "the work ran past request_timeout_s and was stopped",
}


def _ref(model: type) -> dict[str, str]:
    return {"$ref": f"#/components/schemas/{model.__name__}"}


def _error_responses(statuses: tuple[int, ...]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for s in statuses:
        spec: dict[str, Any] = {"description": ERRORS[s], "content": {JSON: {"schema": _ref(m.ErrorBody)}}}
        if s == 503:
            spec["headers"] = {"Retry-After": {"description": "seconds to wait", "schema": {"type": "integer"}}}
        if s == 401:
            spec["headers"] = {"WWW-Authenticate": {"schema": {"type": "string"}}}
        out[str(s)] = spec
    return out


# Worked JSON examples (shown in /docs; schemathesis sends them too): two sequences
# sharing a 3-token prefix (token 4 is the first trainable one, so position 3 is scored
# and not shared).
PACK_EXAMPLE = {
    "version": WIRE_VERSION,
    "seq_len": 16,
    "tokens": [1, 2, 3, 4, 5, 6, 1, 2, 3, 4, 7, 8],
    "offsets": [0, 6, 12],
    "prompt_lens": [4, 4],
    "groups": ["q1", "q1"],
    "tags": ["demo", "demo"],
    "min_shared_len": 2,
}
WHATIF_EXAMPLE = {
    "version": WIRE_VERSION,
    "seq_len": 16,
    "min_shared_len": 2,
    "compositions": [{"name": "one group", "groups": 1}],
    "trials": 2,
    "max_rows": 1,
    "shapes": [
        {
            "seq_len": 16,
            "min_shared_len": 2,
            "seq_ptr": [0, 2, 4],
            "run_hash": [11, 0, 11, 0],
            "run_len": [3, 3, 3, 3],
            "first_trainable": [4, 4],
            "groups": ["q1", "q1"],
            "tags": ["demo", "demo"],
        }
    ],
}
EXAMPLES: dict[str, dict[str, Any]] = {"PackRequest": PACK_EXAMPLE, "WhatIfRequest": WHATIF_EXAMPLE}


def body_spec(
    request: type | None,
    response: type,
    statuses: tuple[int, ...],
    *,
    both: bool = True,
    description: str = "the answer",
) -> dict[str, Any]:
    """``openapi_extra`` for one operation: request body, 200 and error responses.

    Args:
        request: the request body model, or None for body-less operations.
        response: the 200 body model.
        statuses: documented error statuses.
        both: the 200 comes as JSON and msgpack (by Accept) rather than JSON only.
    """
    media = (JSON, MSGPACK) if both else (JSON,)
    spec: dict[str, Any] = {
        "responses": {
            "200": {"description": description, "content": {t: {"schema": _ref(response)} for t in media}},
            **_error_responses(statuses),
        }
    }
    if request is not None:
        content: dict[str, Any] = {t: {"schema": _ref(request)} for t in (JSON, MSGPACK)}
        if request.__name__ in EXAMPLES:
            content[JSON]["example"] = EXAMPLES[request.__name__]
        spec["requestBody"] = {"required": True, "content": content}
    return spec


def _apply_limits(schemas: dict[str, Any], settings: Any) -> None:
    """State the running service's limits in the message schemas (a schema-valid request
    then passes them): what-if trials, sequences per list, compositions per request, tags
    named by a composition or ``history_tags``."""
    whatif = schemas.get("WhatIfRequest", {}).get("properties", {})
    if "trials" in whatif:
        whatif["trials"]["maximum"] = min(
            whatif["trials"].get("maximum", settings.whatif_max_trials), settings.whatif_max_trials
        )
    if "compositions" in whatif:
        whatif["compositions"]["maxItems"] = min(whatif["compositions"].get("maxItems", 64), settings.whatif_max_trials)
    for option in whatif.get("history_tags", {}).get("anyOf", []):
        if option.get("type") == "array":
            option["maxItems"] = settings.max_tags
    for option in schemas.get("Composition", {}).get("properties", {}).get("by_tag", {}).get("anyOf", []):
        if option.get("type") == "object":
            option["maxProperties"] = settings.max_tags
    pack = schemas.get("PackRequest", {}).get("properties", {})
    for name in ("groups", "tags"):
        for option in pack.get(name, {}).get("anyOf", []):
            if option.get("type") == "array":
                option["maxItems"] = settings.max_sequences


def install_openapi(app: FastAPI, *, description: str, bearer: bool, settings: Any = None) -> None:
    """Make ``app.openapi()`` return the document with the message schemas (built once).

    Args:
        settings: the running :class:`~.settings.Settings`, whose limits the schemas state.
    """

    def openapi() -> dict[str, Any]:
        if app.openapi_schema:
            return app.openapi_schema
        doc = get_openapi(title=app.title, version=app.version, description=description, routes=app.routes)
        _, defs = models_json_schema(
            [(model, "validation") for model in MODELS], ref_template="#/components/schemas/{model}"
        )
        doc.setdefault("components", {}).setdefault("schemas", {}).update(defs.get("$defs", {}))
        if settings is not None:
            _apply_limits(doc["components"]["schemas"], settings)
        if bearer:
            doc["components"]["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
            for path, ops in doc.get("paths", {}).items():
                if path.startswith("/v1/") or path == "/metrics":
                    for op in ops.values():
                        op["security"] = [{"bearer": []}]
        app.openapi_schema = doc
        return doc

    app.openapi = openapi  # type: ignore[method-assign]


# /docs without a network: a page of this file only, listing the operations of
# /openapi.json (Swagger UI's assets are not bundled: settings.docs="swagger" loads them
# from their CDN). A backslash at a line's end joins it to the next (keeps lines short;
# the page's text is unchanged).
OFFLINE_DOCS = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>treepack API</title>
<style>body{font:14px/1.4 sans-serif;margin:2em;max-width:60em}code{background:#eee;padding:0 .2em}
h2{font-size:1.1em;margin-top:1.5em}</style></head>
<body><h1>treepack API</h1><p>The full document: <a href="openapi.json"><code>/openapi.json</code></a>.</p>
<div id="ops">loading /openapi.json ...</div>
<script>
fetch("openapi.json").then(r => r.json()).then(doc => {
  const ops = document.getElementById("ops"); ops.textContent = "";
  for (const [path, item] of Object.entries(doc.paths)) for (const [method, op] of Object.entries(item)) {
    const h = document.createElement("h2"); h.textContent = method.toUpperCase() + " " + path; ops.appendChild(h);
    const p = document.createElement("p"); p.textContent = (op.summary || "") + ": " + (op.description || ""); \
ops.appendChild(p);
    const s = document.createElement("p"); s.textContent = "answers: " + Object.keys(op.responses || {}).join(", "); \
ops.appendChild(s);
  }
});
</script></body></html>
"""
