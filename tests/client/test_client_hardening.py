"""The HTTP client against misbehaving servers: odd Retry-After values, trickling answers, answers cut off.

The servers are real sockets on 127.0.0.1 (a few lines of asyncio in a thread), not mocks:
what is tested is what httpx and the retry loop do with the bytes a bad server sends.
"""

from __future__ import annotations

import asyncio
import math
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager

import pytest

from treepack.client import AsyncPacker, Packer
from treepack.client.http_errors import parse_retry_after
from treepack.client.retry import RetryPolicy
from treepack.proto.errors import RequestError, TransportError, TreepackError
from treepack.proto.plan_wire import check_plan_structure, plan_from_wire, plan_to_wire
from treepack.service.planner import plan_batch

from helpers.service import plan_kwargs, small_batch

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter, int], Awaitable[None]]


@contextmanager
def raw_server(handler: Handler) -> Iterator[tuple[str, list[int]]]:
    """A loopback server running ``handler(reader, writer, n)`` per connection (n counts requests)."""
    seen: list[int] = []
    loop = asyncio.new_event_loop()
    ready = threading.Event()
    box: dict = {}

    async def on_conn(reader, writer):
        head = await reader.readuntil(b"\r\n\r\n")
        length = next(
            (int(line.split(b":")[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length")), 0
        )
        await reader.readexactly(length)
        seen.append(len(seen))
        try:
            await handler(reader, writer, len(seen))
        finally:
            writer.close()

    async def start():
        box["server"] = await asyncio.start_server(on_conn, "127.0.0.1", 0)
        ready.set()

    t = threading.Thread(target=lambda: (loop.run_until_complete(start()), loop.run_forever()), daemon=True)
    t.start()
    ready.wait(10)
    port = box["server"].sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}", seen
    finally:

        async def shutdown():
            box["server"].close()
            tasks = [task for task in asyncio.all_tasks() if task is not asyncio.current_task()]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        asyncio.run_coroutine_threadsafe(shutdown(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        t.join(5)
        loop.close()


async def _trickle(reader, writer, n):
    writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 100000\r\n\r\n")
    for _ in range(200):  # a byte every 0.2 s: no single read ever times out
        writer.write(b" ")
        await writer.drain()
        await asyncio.sleep(0.2)


async def _cut_off(reader, writer, n):
    writer.write(
        b"HTTP/1.1 200 OK\r\ncontent-type: application/msgpack\r\ncontent-length: 5000\r\n\r\n" + b"\x00" * 100
    )
    await writer.drain()  # then the connection closes mid-body


def _always_503(retry_after: str) -> Handler:
    async def answer(reader, writer, n):
        body = b'{"version":1,"error":"overloaded","message":"busy","path":"$","rule":"queue_full"}'
        writer.write(
            b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\nretry-after: "
            + retry_after.encode()
            + b"\r\ncontent-length: "
            + str(len(body)).encode()
            + b"\r\n\r\n"
            + body
        )
        await writer.drain()

    return answer


@pytest.mark.parametrize(
    "value, expected",
    [
        ("2", 2.0),
        (" 0.5 ", 0.5),
        ("0", 0.0),
        ("nan", None),
        ("inf", None),
        ("-1", None),
        ("soon", None),
        ("1e309", None),
        (None, None),
    ],
)
def test_retry_after_parsing(value, expected):
    assert parse_retry_after(value) == expected


def test_retry_after_http_date_and_caps():
    assert parse_retry_after("Wed, 21 Oct 2015 07:28:00 GMT") is None  # in the past
    policy = RetryPolicy(backoff=0.1, max_backoff=5.0)
    assert policy.delay(0, 1e12) == 5.0  # huge: capped
    for bad in (math.nan, -3.0, math.inf):
        assert 0.075 <= policy.delay(0, bad) <= 0.125  # falls back to the backoff


def test_a_trickling_server_cannot_stretch_a_sync_call():
    with raw_server(_trickle) as (url, _):
        with Packer(url, timeout=1.0, retries=0) as p:
            t0 = time.monotonic()
            with pytest.raises(TransportError, match="timed out"):
                p.health()
            took = time.monotonic() - t0
    assert took < 2.5, took  # at most twice the attempt bound (checked between chunks)


async def test_a_trickling_server_cannot_stretch_an_async_call():
    with raw_server(_trickle) as (url, _):
        async with AsyncPacker(url, timeout=1.0, retries=0) as p:
            t0 = time.monotonic()
            with pytest.raises(TransportError, match="timed out"):
                await p.health()
            took = time.monotonic() - t0
    assert took < 1.6, took


def test_the_total_deadline_bounds_retries():
    with raw_server(_always_503("1")) as (url, seen):
        with Packer(url, timeout=5.0, retries=50, total_timeout=2.5) as p:
            t0 = time.monotonic()
            with pytest.raises(TreepackError):
                p.health()
            took = time.monotonic() - t0
    assert took < 3.5 and 2 <= len(seen) <= 4, (took, len(seen))


def test_nan_retry_after_falls_back_to_backoff():
    with raw_server(_always_503("nan")) as (url, seen):
        with Packer(url, timeout=5.0, retries=2, backoff=0.05) as p:
            with pytest.raises(Exception) as e:
                p.health()
    assert "ValueError" not in type(e.value).__name__ and len(seen) == 3


def test_a_pack_cut_off_mid_answer_is_not_resent_without_a_key():
    b = small_batch()
    with raw_server(_cut_off) as (url, seen):
        with Packer(url, timeout=5.0, retries=3, idempotent=False) as p:
            with pytest.raises(TransportError):
                p.pack(b["sequences"], seq_len=512)
    assert len(seen) == 1  # the server may have planned and recorded it: sent once


def test_a_pack_cut_off_mid_answer_is_resent_with_its_key():
    b = small_batch()
    with raw_server(_cut_off) as (url, seen):
        with Packer(url, timeout=5.0, retries=2, backoff=0.01) as p:
            with pytest.raises(TransportError):
                p.pack(b["sequences"], seq_len=512)
    assert len(seen) == 3  # safe to repeat: the server answers a repeated key from its cache (tests/e2e)


def test_a_tampered_plan_is_refused_before_use():
    plan = plan_batch(**plan_kwargs(small_batch()))
    check_plan_structure(plan)  # the real plan passes
    wire = plan_to_wire(plan, "json")
    wire["num_rows"] = 10**6  # position_ids() would allocate [10**6, 512] int64 (4 GB)
    with pytest.raises(RequestError, match="disagree") as e:
        plan_from_wire(wire)
    assert e.value.rule == "plan_structure"
    wire = plan_to_wire(plan, "json")
    wire["segments"]["seq"]["data"][0] = 99
    with pytest.raises(RequestError, match="outside"):
        plan_from_wire(wire)


def test_a_bad_token_is_refused_at_construction():
    for bad in ("pässword", "", "a\nb"):
        with pytest.raises(RequestError, match="printable ASCII"):
            Packer("http://127.0.0.1:9", token=bad)
    Packer("http://127.0.0.1:9", token=" fine\n").close()  # stripped
