"""The sidecar as a real process (uvicorn on 127.0.0.1): restarts, SIGKILL, overload, body limits."""

from __future__ import annotations

import re
import signal
import sqlite3
import threading
import time

import httpx
import numpy as np
import pytest

from treepack.client import Packer
from treepack.proto.codec import encode_body
from treepack.service.cli.workloads import curriculum
from treepack.service.planner import plan_batch

from helpers.service import assert_same_plan, pack_body, plan_kwargs, running_server, small_batch


def _summary(url):
    return httpx.get(url + "/v1/history", timeout=30).json()


def test_history_survives_restart_and_sigkill(tmp_path):
    db = str(tmp_path / "state" / "history.sqlite3")
    w = curriculum(6)
    with running_server("--history-path", db) as (url, proc):
        with Packer(url) as p:
            for _ in range(3):
                p.pack(**w.plan_kwargs(), tags=w.tags)
            p.pack(**w.plan_kwargs(), record=False)
        assert _summary(url)["batches"] == 3
    # A clean restart keeps everything.
    with running_server("--history-path", db) as (url, proc):
        s = _summary(url)
        assert s["batches"] == 3 and s["tags"] == _summary(url)["tags"]
        # Now kill -9 the server while packs (and history writes) are in flight.
        stop = threading.Event()
        sent = []

        def load():
            with Packer(url, retries=0, timeout=10) as p:
                while not stop.is_set():
                    try:
                        p.pack(**w.plan_kwargs(), tags=w.tags)
                        sent.append(1)
                    except Exception:
                        return

        t = threading.Thread(target=load)
        t.start()
        while len(sent) < 5:
            time.sleep(0.01)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)
        stop.set()
        t.join(timeout=30)
    conn = sqlite3.connect(db)
    assert conn.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    conn.close()
    with running_server("--history-path", db) as (url, proc):
        s = _summary(url)
        # Shapes are written after the answer (never delaying it), so the last acknowledged
        # packs may be lost with the process; what was committed is all there, none torn.
        assert 3 <= s["batches"] <= 3 + len(sent) + 1
        with Packer(url) as p:
            res = p.whatif([6], seq_len=w.seq_len, trials=2)  # every stored shape decodes
            assert res[0].rows.mean >= 1


def test_two_concurrent_requests_with_one_worker_and_no_queue():
    with running_server("--max-concurrent-plans", "1", "--max-queue", "0", "--retry-after-s", "1") as (url, proc):
        w = curriculum(24)
        with Packer(url) as p:
            p.pack(**w.plan_kwargs(), tags=w.tags)  # something to sample from
        slow = threading.Thread(
            target=lambda: httpx.post(
                url + "/v1/whatif",
                content=encode_body(
                    {"version": 1, "seq_len": w.seq_len, "compositions": [{"groups": 24}], "trials": 150}, "msgpack"
                ),
                headers={"content-type": "application/msgpack"},
                timeout=120,
            )
        )
        slow.start()
        deadline = time.monotonic() + 20
        while "treepack_plans_running 1.0" not in httpx.get(url + "/metrics").text:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        r = httpx.post(
            url + "/v1/pack", content=pack_body(small_batch()), headers={"content-type": "application/msgpack"}
        )
        assert r.status_code == 503 and r.headers["retry-after"] == "1"
        assert r.json()["error"] == "overloaded"
        with Packer(url, retries=30) as p:  # waits out the what-if, honouring Retry-After
            plan = p.pack(**plan_kwargs(small_batch()))
        assert_same_plan(plan, plan_batch(**plan_kwargs(small_batch())))
        slow.join(timeout=120)
        metrics = httpx.get(url + "/metrics").text
        refused = float(re.search(r"^treepack_overloaded_total (\S+)$", metrics, re.M).group(1))
        assert refused >= 2  # the raw request and at least one client attempt


@pytest.mark.parametrize("declared", [True, False])
def test_oversized_bodies_get_413_over_a_real_socket(declared):
    with running_server("--max-body-bytes", "1000000") as (url, proc):
        big = b"\x00" * 3_000_000
        if declared:
            r = httpx.post(url + "/v1/pack", content=big, headers={"content-type": "application/msgpack"})
        else:  # chunked: no Content-Length, the limit applies while reading
            r = httpx.post(
                url + "/v1/pack",
                content=iter([big[i : i + 65536] for i in range(0, len(big), 65536)]),
                headers={"content-type": "application/msgpack"},
            )
        assert r.status_code == 413 and r.json()["rule"] == "max_body_bytes"
        ok = httpx.post(
            url + "/v1/pack", content=pack_body(small_batch()), headers={"content-type": "application/msgpack"}
        )
        assert ok.status_code == 200


def test_bearer_token_from_the_environment():
    with running_server(env={"TREEPACK_TOKEN": "from-env"}) as (url, proc):
        assert httpx.get(url + "/v1/history").status_code == 401
        with Packer(url, token="from-env") as p:
            assert p.history()["enabled"] is True
            assert p.pack([np.arange(10)], seq_len=64).num_rows == 1
        assert httpx.get(url + "/healthz").status_code == 200
