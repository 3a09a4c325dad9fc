"""Bounded work and bounded intake, in-process: deadlines, cancellation, the body budget, idempotent packs, tokens.

Requests that need a stalled or vanishing client are driven through the raw ASGI
interface (a ``receive`` the test controls); the rest through ``httpx.ASGITransport``.
"""

from __future__ import annotations

import asyncio
import time

import httpx
import msgpack
import numpy as np
import pytest
from pydantic import ValidationError

from treepack.client import AsyncPacker
from treepack.proto.errors import RequestError
from treepack.service import Settings, create_app

from helpers.service import asgi_request, pack_body, small_batch

MP = {"content-type": "application/msgpack"}


def _busy_whatif(trials: int = 100_000) -> bytes:
    """A what-if of many cheap trials: 32 sequences of 600 tokens sharing 200."""
    rng = np.random.default_rng(0)
    s = 32
    run_len = np.tile([200, 400], s)
    shape = {
        "seq_len": 1024,
        "min_shared_len": 8,
        "seq_ptr": np.arange(0, 2 * s + 1, 2, dtype="<i8").tobytes(),
        "run_hash": np.stack([np.ones(s, np.uint64), rng.integers(2, 2**62, s).astype(np.uint64)], 1)
        .reshape(-1)
        .astype("<u8")
        .tobytes(),
        "run_len": run_len.astype("<i8").tobytes(),
        "first_trainable": np.full(s, 200, "<i8").tobytes(),
        "groups": [i // 4 for i in range(s)],
    }
    return msgpack.packb(
        {"version": 1, "seq_len": 1024, "trials": trials, "compositions": [{"groups": 6}], "shapes": [shape]}
    )


def _settings(**kw) -> Settings:
    return Settings(history_enabled=False, whatif_max_trials=1_000_000, whatif_max_work=2**62, **kw)


async def _wait_idle(pool, limit_s: float) -> float:
    t0 = time.monotonic()
    while pool.admitted and time.monotonic() - t0 < limit_s:
        await asyncio.sleep(0.02)
    return time.monotonic() - t0


async def test_a_whatif_past_its_deadline_is_stopped_with_504():
    app = create_app(_settings(request_timeout_s=0.5))
    try:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://t") as c:
            t0 = time.monotonic()
            r = await asyncio.wait_for(c.post("/v1/whatif", content=_busy_whatif(), headers=MP), 30)
            took = time.monotonic() - t0
            metrics = (await c.get("/metrics")).text
        assert r.status_code == 504 and r.json()["error"] == "deadline_exceeded" and r.json()["rule"] == "deadline", (
            r.text
        )
        assert took < 5.0, took  # stopped between trials, not after 100,000 of them
        assert 'treepack_work_stopped_total{reason="deadline"} 1.0' in metrics
        assert app.state.service.pool.admitted == 0
    finally:
        app.state.service.close()


async def test_work_for_a_client_that_went_away_is_cancelled():
    app = create_app(_settings(request_timeout_s=600))
    body = _busy_whatif()
    sent = False

    async def receive():
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        await asyncio.sleep(0.3)  # the client leaves while the planner works
        return {"type": "http.disconnect"}

    pool = app.state.service.pool
    try:
        task = asyncio.create_task(asgi_request(app, "/v1/whatif", {**MP, "content-length": str(len(body))}, receive))
        await asyncio.sleep(0.2)
        assert pool.admitted == 1  # it is planning
        idle_after = await _wait_idle(pool, 10.0)
        assert pool.admitted == 0 and idle_after < 5.0, idle_after
        await asyncio.wait_for(task, 5)
        assert app.state.service.metrics.work_stopped.labels("cancelled")._value.get() == 1
    finally:
        app.state.service.close()


async def test_bodies_past_the_intake_budget_get_503():
    app = create_app(
        _settings(intake_budget_bytes=100_000, intake_reserve_bytes=0, max_body_bytes=200_000, retry_after_s=2)
    )
    release = asyncio.Event()
    first_calls = 0

    async def slow_upload():
        nonlocal first_calls
        first_calls += 1
        if first_calls == 1:
            return {"type": "http.request", "body": b"\x00" * 90_000, "more_body": True}
        if first_calls == 2:
            await release.wait()
            return {"type": "http.request", "body": b"\x00" * 5_000, "more_body": False}
        await asyncio.sleep(3600)  # the client stays until the answer

    async def second():
        return {"type": "http.request", "body": b"\x00" * 50_000, "more_body": False}

    try:
        first = asyncio.create_task(asgi_request(app, "/v1/pack", {**MP, "content-length": "95000"}, slow_upload))
        await asyncio.sleep(0.1)
        assert app.state.service.intake.in_flight == 90_000  # charged as the bytes arrived
        status, headers, body = await asgi_request(app, "/v1/pack", {**MP, "content-length": "50000"}, second)
        assert status == 503 and headers["retry-after"] == "2" and b"intake_budget" in body
        release.set()
        status, _, _ = await asyncio.wait_for(first, 5)
        assert status == 400  # zeros are no msgpack map: the point is that it was read and answered
        assert app.state.service.intake.in_flight == 0
        # A body alone may use the whole budget: one over it still gets in when nothing else is read.
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://t") as c:
            assert (await c.post("/v1/pack", content=pack_body(small_batch()), headers=MP)).status_code == 200
            assert (await c.post("/v1/pack", content=b"\x00" * 150_000, headers=MP)).status_code == 400
    finally:
        app.state.service.close()


async def test_a_stalled_body_gets_408():
    app = create_app(_settings(body_timeout_s=0.3))
    calls = 0

    async def stall():
        nonlocal calls
        calls += 1
        if calls == 1:
            return {"type": "http.request", "body": b"\x81", "more_body": True}
        await asyncio.sleep(3600)

    try:
        t0 = time.monotonic()
        status, _, body = await asyncio.wait_for(
            asgi_request(app, "/v1/pack", {**MP, "content-length": "500"}, stall), 10
        )
        assert status == 408 and b"body_timeout" in body and time.monotonic() - t0 < 3
        assert app.state.service.intake.in_flight == 0
    finally:
        app.state.service.close()


async def test_an_idempotency_key_makes_a_pack_run_and_record_once():
    app = create_app(Settings())
    svc = app.state.service
    body = pack_body(small_batch())
    try:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://t") as c:
            key = {"idempotency-key": "batch-0001", **MP}
            a = await c.post("/v1/pack", content=body, headers=key)
            b = await c.post("/v1/pack", content=body, headers=key)
            assert a.status_code == b.status_code == 200 and a.content == b.content
            assert b.headers["idempotent-replay"] == "true"
            other = await c.post("/v1/pack", content=pack_body(small_batch(seed=1)), headers=key)
            assert other.status_code == 409 and other.json()["error"] == "conflict"
        svc.flush()
        assert svc.store.count() == 1  # the repeat was not recorded again
    finally:
        svc.close()


def test_tokens_are_stripped_and_bad_ones_refused_at_startup(tmp_path):
    assert Settings(token="s3cret\n").token.get_secret_value() == "s3cret"
    f = tmp_path / "token"
    f.write_text("  from-a-secret\n")
    assert Settings(token_file=str(f)).token.get_secret_value() == "from-a-secret"
    for bad, text in [("", "is empty"), (" \n", "is empty"), ("pässword", "printable ASCII")]:
        with pytest.raises(ValidationError, match=text):
            Settings(token=bad)


async def test_a_stripped_token_lets_clients_in():
    app = create_app(Settings(token="s3cret\n", history_enabled=False))
    try:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://t") as c:
            r = await c.post(
                "/v1/pack", content=pack_body(small_batch()), headers={**MP, "authorization": "Bearer s3cret"}
            )
        assert r.status_code == 200
    finally:
        app.state.service.close()


def test_a_non_ascii_client_token_is_a_clear_error():
    with pytest.raises(RequestError, match="printable ASCII"):
        AsyncPacker("http://127.0.0.1:9", token="pässword")


async def test_docs_switch():
    for mode, status in (("off", 404), ("swagger", 200)):
        app = create_app(Settings(history_enabled=False, docs=mode))
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://t") as c:
            r = await c.get("/docs")
        app.state.service.close()
        assert r.status_code == status
        if mode == "swagger":
            assert "swagger" in r.text.lower()
