"""The app in-process (httpx.ASGITransport): negotiation, auth, history, metrics, probes, docs, overload."""

from __future__ import annotations

import asyncio
import threading

import httpx
import msgpack
import pytest

from treepack.client import AsyncPacker
from treepack.proto.errors import OverloadedError
from treepack.proto.plan_wire import plan_from_wire
from treepack.proto.version import WIRE_VERSION
from treepack.service import Settings, create_app
from treepack.service.planner import plan_batch

from helpers.service import assert_same_plan, pack_body, plan_kwargs, small_batch


@pytest.fixture
def app():
    app = create_app(Settings())
    yield app
    app.state.service.close()


def _client(app):
    return httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://t")


@pytest.mark.parametrize(
    "ctype,accept,want",
    [
        pytest.param("application/msgpack", None, "application/msgpack", id="msgpack, no Accept"),
        pytest.param(None, None, "application/msgpack", id="no headers: msgpack"),
        pytest.param("application/json", None, "application/json", id="json, no Accept"),
        pytest.param("application/msgpack", "application/json", "application/json", id="msgpack in, json out"),
        pytest.param("application/json", "application/x-msgpack", "application/msgpack", id="json in, x-msgpack out"),
        pytest.param("application/vnd.msgpack", "*/*", "application/msgpack", id="vnd.msgpack, any Accept"),
        pytest.param(
            "application/json; charset=utf-8",
            "text/html, application/msgpack;q=0.4",
            "application/msgpack",
            id="charset, Accept list",
        ),
    ],
)
async def test_content_negotiation(app, ctype, accept, want):
    b = small_batch()
    fmt = "json" if ctype and "json" in ctype else "msgpack"
    headers = {k: v for k, v in (("content-type", ctype), ("accept", accept)) if v}
    async with _client(app) as c:
        r = await c.post("/v1/pack", content=pack_body(b, fmt), headers=headers)
    assert r.status_code == 200, r.text
    assert r.headers["content-type"] == want
    obj = msgpack.unpackb(r.content) if "msgpack" in want else r.json()
    assert obj["version"] == 1 and obj["recorded"] is True
    assert_same_plan(plan_from_wire(obj["plan"]), plan_batch(**plan_kwargs(b)))


async def test_token_allows_and_probes_stay_open():
    app = create_app(Settings(token="tok"))
    try:
        async with _client(app) as c:
            ok = await c.post("/v1/pack", content=pack_body(small_batch()), headers={"authorization": "Bearer tok"})
            assert ok.status_code == 200
            assert (await c.get("/metrics")).status_code == 401
            assert (await c.get("/metrics", headers={"authorization": "Bearer tok"})).status_code == 200
            assert (await c.get("/healthz")).json() == {"version": WIRE_VERSION, "status": "ok"}
            assert (await c.get("/readyz")).status_code == 200
        doc = app.openapi()
        assert doc["paths"]["/v1/pack"]["post"]["security"] == [{"bearer": []}]
        assert "security" not in doc["paths"]["/healthz"]["get"]
    finally:
        app.state.service.close()


async def test_history_records_shapes_and_honours_opt_out(app):
    b = small_batch()
    async with _client(app) as c:
        r1 = await c.post("/v1/pack", content=pack_body(b), headers={"accept": "application/json"})
        r2 = await c.post("/v1/pack", content=pack_body(b, record=False), headers={"accept": "application/json"})
        assert r1.json()["recorded"] is True and r2.json()["recorded"] is False
        h = (await c.get("/v1/history")).json()
    assert h["enabled"] and h["batches"] == 1
    assert h["sequences"] == 6 and h["groups"] == 2 and h["tags"] == {"code": 1, "math": 1}
    assert h["tokens"] == sum(len(s) for s in b["sequences"])
    assert h["seq_lens"] == [512] and h["mean_rows"] == 1.0
    assert 0 < h["mean_saved_fraction"] < 1


async def test_history_disabled():
    app = create_app(Settings(history_enabled=False))
    try:
        async with _client(app) as c:
            r = await c.post("/v1/pack", content=pack_body(small_batch()), headers={"accept": "application/json"})
            assert r.json()["recorded"] is False
            h = await c.get("/v1/history", headers={"accept": "application/msgpack"})
            assert h.headers["content-type"] == "application/msgpack"
            assert msgpack.unpackb(h.content)["enabled"] is False
    finally:
        app.state.service.close()


async def test_metrics_after_packs(app):
    b = small_batch()
    plan = plan_batch(**plan_kwargs(b))
    async with _client(app) as c:
        for _ in range(3):
            assert (await c.post("/v1/pack", content=pack_body(b))).status_code == 200
        text = (await c.get("/metrics")).text
    lines = dict(line.rsplit(" ", 1) for line in text.splitlines() if line and not line.startswith("#"))
    assert float(lines["treepack_tokens_in_total"]) == 3 * plan.stats.unpacked_tokens
    assert float(lines["treepack_packed_tokens_total"]) == 3 * plan.stats.packed_tokens
    assert float(lines["treepack_rows_count"]) == 3 and float(lines["treepack_rows_sum"]) == 3 * plan.num_rows
    assert float(lines["treepack_saved_fraction_sum"]) == pytest.approx(3 * plan.stats.saved_fraction)
    assert float(lines['treepack_requests_total{method="POST",route="/v1/pack",status="200"}']) == 3
    assert float(lines['treepack_request_seconds_count{route="/v1/pack"}']) == 3
    assert float(lines["treepack_plan_seconds_count"]) == 3
    assert float(lines['treepack_pack_phase_seconds_count{phase="decode"}']) == 3
    assert float(lines['treepack_pack_phase_seconds_count{phase="encode"}']) == 3
    assert float(lines["treepack_queue_depth"]) == 0
    assert "treepack_overloaded_total" in lines and "treepack_history_recorded_total" in lines


async def test_probes_and_docs(app):
    async with _client(app) as c:
        assert (await c.get("/healthz")).json() == {"version": WIRE_VERSION, "status": "ok"}
        ready = (await c.get("/readyz")).json()
        assert ready == {"version": WIRE_VERSION, "status": "ready", "checks": {"planner": "ok", "history": "ok"}}
        docs = await c.get("/docs")
        # Offline by default: the page loads nothing but /openapi.json (no CDN).
        assert (
            docs.status_code == 200
            and "openapi.json" in docs.text
            and "cdn" not in docs.text.lower()
            and "//" not in docs.text.replace("http://www.w3.org", "")
        )
        doc = (await c.get("/openapi.json")).json()
    op = doc["paths"]["/v1/pack"]["post"]
    assert op["requestBody"]["content"]["application/json"]["schema"] == {"$ref": "#/components/schemas/PackRequest"}
    assert set(op["responses"]) >= {"200", "400", "413", "415", "422", "503"}
    assert "PlanMessage" in doc["components"]["schemas"]


async def test_readyz_reports_a_broken_history(app):
    app.state.service.store.close()  # the database goes away under the running service
    async with _client(app) as c:
        r = await c.get("/readyz")
    assert r.status_code == 503 and r.json()["status"] == "not_ready"
    assert r.json()["checks"]["history"].startswith("damaged")


async def test_overload_gives_503_then_the_client_retry_succeeds():
    app = create_app(Settings(max_concurrent_plans=1, max_queue=0, retry_after_s=0.5))
    pool = app.state.service.pool
    release = threading.Event()
    try:
        blocker = pool.submit(release.wait, 30)  # the only worker is busy
        async with _client(app) as c:
            r = await c.post("/v1/pack", content=pack_body(small_batch()))
        assert r.status_code == 503 and r.headers["retry-after"] == "1"
        assert r.json()["error"] == "overloaded" and r.json()["retry_after"] == 0.5

        async with AsyncPacker("http://t", transport=httpx.ASGITransport(app), retries=0) as p:
            with pytest.raises(OverloadedError) as e:
                await p.pack(**plan_kwargs(small_batch()))
            assert e.value.retry_after == 1.0 and "busy" in e.value.message

        threading.Timer(0.3, release.set).start()
        async with AsyncPacker("http://t", transport=httpx.ASGITransport(app), retries=3) as p:
            plan = await p.pack(**plan_kwargs(small_batch()))
        assert_same_plan(plan, plan_batch(**plan_kwargs(small_batch())))
        assert pool.rejected >= 3  # the raw request, the no-retry client, and the retried attempt
        blocker.result(timeout=5)
    finally:
        release.set()
        app.state.service.close()


async def test_pool_slots_free_when_jobs_finish_not_when_callers_leave():
    app = create_app(Settings(max_concurrent_plans=1, max_queue=0))
    pool = app.state.service.pool
    release = threading.Event()
    try:
        task = asyncio.ensure_future(pool.run(release.wait, 30))
        await asyncio.sleep(0.05)
        task.cancel()  # the caller goes away; the thread still works
        await asyncio.sleep(0.05)
        assert pool.admitted == 1
        with pytest.raises(OverloadedError):
            pool.submit(lambda: None)
        release.set()
        for _ in range(100):
            if pool.admitted == 0:
                break
            await asyncio.sleep(0.01)
        assert pool.admitted == 0
    finally:
        release.set()
        app.state.service.close()
