"""Wire version 2 (the typed strategy, per-trial figures and the estimate's spread) next to
version 1: the sidecar answers a version-1 request in version 1, without the added fields,
so a client of the previous release keeps working; any other version is refused."""

from __future__ import annotations

import httpx
import pytest

from treepack.proto.codec import encode_body
from treepack.proto.cost import CostModel, cost_terms
from treepack.proto.shape_wire import shape_to_wire
from treepack.proto.version import READ_VERSIONS, WIRE_VERSION
from treepack.proto.whatif_messages import WhatIfResponse
from treepack.service import Settings, create_app
from treepack.service.planner.fingerprint import shape_of

from helpers.service import pack_body, small_batch
from helpers.trees import plan_result

COST = CostModel(
    backend="flash",
    coefficients={t: 0.0 for t in cost_terms("flash")} | {"step": 1.0, "attention_pairs": 1e-5, "segments": 0.5},
)
JSON = {"content-type": "application/json", "accept": "application/json"}
ADDED_RESULT = {"strategies", "trial_step_ms", "max_step_ms", "p_step_over", "suggested_trials"}


@pytest.fixture
async def client(tmp_path):
    path = tmp_path / "cost.json"
    COST.save(path)
    app = create_app(Settings(cost_model_path=str(path), history_enabled=False))
    try:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://t") as c:
            yield c
    finally:
        app.state.service.close()


def _whatif(version: int, **extra):
    kw = small_batch()
    kw.pop("tags")
    res = plan_result(**kw)
    shape = shape_of(res.batch, res.tree, seq_len=kw["seq_len"])
    msg = {
        "version": version,
        "seq_len": 512,
        "compositions": [{"groups": 1}, {"groups": 2}],
        "trials": 4,
        "shapes": [shape_to_wire(shape, "json")],
        **extra,
    }
    return encode_body(msg, "json")


def test_this_build_speaks_2_and_reads_1():
    assert WIRE_VERSION == 2 and READ_VERSIONS == (1, 2)


async def test_a_version_2_whatif_answers_per_trial_strategy_ms_and_spread(client):
    r = await client.post("/v1/whatif", content=_whatif(2, max_step_ms=2.0), headers=JSON)
    assert r.status_code == 200, r.text
    body = r.json()
    WhatIfResponse.model_validate(body)
    assert body["version"] == 2
    for res in body["results"]:
        assert ADDED_RESULT <= set(res) and len(res["strategies"]) == len(res["trial_step_ms"]) == 4
        assert all(s["kind"] in ("tree", "plain") for s in res["strategies"])
        assert res["max_step_ms"] == 2.0 and 0.0 <= res["p_step_over"] <= 1.0 and res["suggested_trials"] >= 8
        assert {"std", "stderr"} <= set(res["rows"]) and {"std", "stderr"} <= set(res["step_ms"])
    assert [res["name"] for res in body["results"]] == ["1 group", "2 groups"]


async def test_a_version_1_request_gets_a_version_1_answer(client):
    r = await client.post("/v1/whatif", content=_whatif(1), headers=JSON)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["version"] == 1
    for res in body["results"]:
        assert ADDED_RESULT.isdisjoint(res), set(res) & ADDED_RESULT
        for dist in ("rows", "packed_tokens", "unpacked_tokens", "saved_fraction", "step_ms"):
            assert set(res[dist]) == {"mean", "p50", "p90", "min", "max"}


async def test_a_version_1_pack_gets_a_version_1_plan():
    app = create_app(Settings(history_enabled=False))
    try:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://t") as c:
            for version in READ_VERSIONS:
                r = await c.post("/v1/pack", content=pack_body(small_batch(), "json", version=version), headers=JSON)
                assert r.status_code == 200, r.text
                body = r.json()
                assert body["version"] == body["plan"]["version"] == version
                assert ("packing" in body["plan"]) == (version >= 2)
    finally:
        app.state.service.close()
    assert body["plan"]["packing"] == {"kind": "tree", "min_shared_len": 64}


async def test_another_version_is_refused_naming_both(client):
    r = await client.post("/v1/whatif", content=_whatif(3), headers=JSON)
    assert r.status_code == 422
    err = r.json()
    assert (err["error"], err["path"], err["rule"]) == ("unsupported_version", "$.version", "version")
    assert "wire version 3 is not supported; this build speaks 2 (and reads 1)" in err["message"]
