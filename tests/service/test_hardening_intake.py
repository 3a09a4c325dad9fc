"""Round two of the sidecar's hardening, in-process: exact idempotency, fair intake, priced what-ifs.

Stalled and slow clients are driven through the raw ASGI interface (a ``receive`` the
test controls); the rest through ``httpx.ASGITransport``.
"""

from __future__ import annotations

import asyncio
import time
import tracemalloc

import httpx
import msgpack
import numpy as np
import pytest

from treepack.proto.codec import encode_body
from treepack.proto.errors import DeadlineError, TreepackError, http_status
from treepack.service import Settings, create_app

from helpers.service import asgi_request, pack_message, small_batch

MP = {"content-type": "application/msgpack"}


def _silent(first: bytes = b""):
    """A client that sends ``first`` (maybe nothing) of its body and then nothing more."""
    calls = 0

    async def receive():
        nonlocal calls
        calls += 1
        if calls == 1 and first:
            return {"type": "http.request", "body": first, "more_body": True}
        await asyncio.sleep(3600)

    return receive


def _large_batch(tokens: int = 120_000, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    seqs = [rng.integers(0, 50_000, tokens // 40, dtype=np.uint32) for _ in range(40)]
    return dict(sequences=seqs, trainable=[10] * 40, groups=list(range(40)), seq_len=4096)


async def test_a_reused_key_with_a_body_changed_in_the_middle_is_a_conflict():
    """Two bodies of equal length, equal first and last 64 KiB: a replay would serve the wrong plan."""
    app = create_app(Settings(history_enabled=False))
    msg = pack_message(_large_batch())
    tokens = bytearray(msg["tokens"])
    assert len(tokens) > 300_000
    a = encode_body(msg, "msgpack")
    mid = len(tokens) // 2
    tokens[mid : mid + 4] = (12345).to_bytes(4, "little")  # one token id of one sequence in the middle
    b = encode_body({**msg, "tokens": bytes(tokens)}, "msgpack")
    assert len(a) == len(b) and a[: 64 << 10] == b[: 64 << 10] and a[-(64 << 10) :] == b[-(64 << 10) :] and a != b
    try:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://t") as c:
            key = {"idempotency-key": "step-7", **MP}
            first = await c.post("/v1/pack", content=a, headers=key)
            again = await c.post("/v1/pack", content=a, headers=key)
            other = await c.post("/v1/pack", content=b, headers=key)
        assert first.status_code == again.status_code == 200 and again.headers["idempotent-replay"] == "true"
        assert other.status_code == 409 and other.json()["rule"] == "idempotency", (other.status_code, other.headers)
    finally:
        app.state.service.close()


async def test_announced_bytes_that_never_arrive_are_not_charged_and_small_packs_pass():
    """Two uploads announcing the whole budget and sending nothing hold none of it."""
    app = create_app(Settings(history_enabled=False, max_body_bytes=256 << 20, intake_budget_bytes=512 << 20))
    svc = app.state.service
    try:
        stalled = [
            asyncio.create_task(asgi_request(app, "/v1/pack", {**MP, "content-length": str(256 << 20)}, _silent()))
            for _ in range(2)
        ]
        await asyncio.sleep(0.1)
        assert svc.intake.in_flight == 0
        body = encode_body(pack_message(small_batch()), "msgpack")
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://t") as c:
            t0 = time.monotonic()
            r = await c.post("/v1/pack", content=body, headers=MP)
            took = time.monotonic() - t0
        assert r.status_code == 200, r.text
        assert took < 5.0, took
        for t in stalled:
            t.cancel()
    finally:
        svc.close()


async def test_a_body_that_announces_itself_and_stays_silent_is_cut_after_the_first_byte_timeout():
    app = create_app(Settings(history_enabled=False, body_timeout_s=60, body_first_byte_s=0.3))
    try:
        t0 = time.monotonic()
        status, _, body = await asyncio.wait_for(
            asgi_request(app, "/v1/pack", {**MP, "content-length": str(64 << 20)}, _silent()), 10
        )
        assert status == 408 and b"first_byte" in body, body
        assert time.monotonic() - t0 < 5
        # A body whose first bytes came is held to body_timeout_s, not to the first-byte timeout.
        task = asyncio.create_task(asgi_request(app, "/v1/pack", {**MP, "content-length": "5000"}, _silent(b"\x81")))
        await asyncio.sleep(0.8)
        assert not task.done()
        task.cancel()
    finally:
        app.state.service.close()


async def test_bytes_are_charged_as_they_arrive_and_small_bodies_keep_room():
    app = create_app(
        Settings(
            history_enabled=False, max_body_bytes=400_000, intake_budget_bytes=300_000, intake_reserve_bytes=100_000
        )
    )
    svc = app.state.service
    try:
        half = [
            asyncio.create_task(
                asgi_request(app, "/v1/pack", {**MP, "content-length": "400000"}, _silent(b"\x00" * 150_000))
            )
            for _ in range(2)
        ]
        await asyncio.sleep(0.1)
        assert svc.intake.in_flight == 300_000  # what arrived, not what was announced
        # A third large body has no room: refused (503) once its bytes would pass the budget.
        status, headers, body = await asgi_request(
            app, "/v1/pack", {**MP, "content-length": "200000"}, _silent(b"\x00" * 1000)
        )
        assert status == 503 and b"intake_budget" in body
        # A small pack always has room.
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://t") as c:
            r = await c.post("/v1/pack", content=encode_body(pack_message(small_batch()), "msgpack"), headers=MP)
        assert r.status_code == 200, r.text
        for t in half:
            t.cancel()
        await asyncio.gather(*half, return_exceptions=True)
        assert svc.intake.in_flight == 0
    finally:
        svc.close()


def _one_run_whatif(run: int, trials: int) -> bytes:
    """A tiny what-if whose one inline shape is one sequence of one ``run``-token run."""
    shape = {
        "seq_len": run,
        "min_shared_len": 8,
        "seq_ptr": np.array([0, 1], "<i8").tobytes(),
        "run_hash": np.array([7], "<u8").tobytes(),
        "run_len": np.array([run], "<i8").tobytes(),
        "first_trainable": np.array([0], "<i8").tobytes(),
        "groups": [None],
    }
    return msgpack.packb(
        {"version": 1, "seq_len": run, "trials": trials, "compositions": [{"groups": 1}], "shapes": [shape]}
    )


async def test_a_whatif_is_priced_against_the_largest_pack_and_refused_before_any_trial():
    run = 1 << 20
    app = create_app(Settings(history_enabled=False, max_tokens=run))
    body = _one_run_whatif(run, trials=16)
    assert len(body) < 300
    try:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://t") as c:
            t0 = time.monotonic()
            r = await c.post("/v1/whatif", content=body, headers=MP)
            took = time.monotonic() - t0
            ok = await c.post("/v1/whatif", content=_one_run_whatif(4096, trials=16), headers=MP)
        assert r.status_code == 413, (r.status_code, took)
        err = r.json()
        assert err["rule"] == "max_work" and "whatif_max_work" in err["message"] and str(16 * run) in err["message"], (
            err
        )
        assert app.state.service.metrics.whatif_trials._value.get() == 16  # only the small one ran
        assert ok.status_code == 200
    finally:
        app.state.service.close()


def _adversarial(fmt: str, shape: str, nbytes: int) -> bytes:
    """A body of ``nbytes`` made almost entirely of the cheapest containers or items."""
    if fmt == "json":
        unit = {"maps": b"{},", "lists": b"[],", "numbers": b"7,"}[shape]
        items = unit * (nbytes // len(unit))
        return b'{"version":1,"seq_len":64,"tokens":"","offsets":"","x":[' + items[:-1] + b"]}"
    n = nbytes
    empty = {"maps": b"\x80", "lists": b"\x90", "numbers": b"\xcd\x01\x2c"}[shape]  # {}, [], 300
    count = n // len(empty)
    head = msgpack.packb({"version": 1, "seq_len": 64, "tokens": b"", "offsets": b""})[1:]  # the map's entries
    array = b"\xdd" + count.to_bytes(4, "big") + empty * count
    where = {"maps": b"\xa1x", "lists": b"\xa6groups", "numbers": b"\xa6tokens"}[
        shape
    ]  # an unknown field, groups, a buffer
    if shape == "numbers":
        head = msgpack.packb({"version": 1, "seq_len": 64, "offsets": b""})[1:]
        return b"\x84" + head + where + array
    return b"\x85" + head + where + array


@pytest.mark.parametrize("fmt", ["msgpack", "json"])
@pytest.mark.parametrize("shape", ["maps", "lists", "numbers"])
def test_decoding_holds_at_most_four_times_the_body(fmt, shape):
    """Whatever a body holds, decoding it builds at most 4x its size (+1 MiB) before it is refused."""
    svc = create_app(Settings(history_enabled=False)).state.service
    body = _adversarial(fmt, shape, 2 << 20)
    try:
        tracemalloc.start()
        try:
            svc.pack(body, fmt, fmt)
        except TreepackError as exc:
            outcome = (http_status(exc), exc.rule)
        else:
            outcome = (200, "")
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        assert outcome[0] in (413, 422), outcome
        assert peak <= 4 * len(body) + (1 << 20), (peak / len(body), outcome)
    finally:
        svc.close()


def test_decoding_counts_against_the_request_deadline():
    """The walk over a large list calls the deadline check as it goes: it stops there, not after."""
    svc = create_app(Settings(history_enabled=False)).state.service
    groups = msgpack.packb(list(range(200_000)))
    body = msgpack.packb({"version": 1, "seq_len": 64, "tokens": b"", "offsets": b""})
    body = bytes([body[0] + 1]) + body[1:] + b"\xa6groups" + groups
    calls = 0

    def check():
        nonlocal calls
        calls += 1
        if calls > 3:
            raise DeadlineError("stopped", path="$", rule="deadline")

    try:
        with pytest.raises(DeadlineError):
            svc.pack(body, "msgpack", "msgpack", check)
        assert calls == 4
    finally:
        svc.close()
