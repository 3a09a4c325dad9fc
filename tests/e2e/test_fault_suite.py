"""The bounded fault suite: a real server on 127.0.0.1 under load, slow and vanishing clients, bad bodies, SIGKILL.

Bounded: fixed request counts, every socket with a timeout, the whole suite stops after
``SUITE_S`` seconds of load at most. Loopback only. Figures are printed (``-s``) and, with
``TREEPACK_FAULT_REPORT=<file>``, written as JSON (BENCHMARKS.md quotes them).

Resident memory bound: after the faults the server's RSS may exceed its RSS after the
warm-up by at most ``RSS_BOUND`` (the allocator keeps up to ``malloc_keep_mb`` = 64 MiB
here, plus the history and caches).
"""

from __future__ import annotations

import gzip
import json
import os
import signal
import socket
import sqlite3
import subprocess
import sys
import threading
import time

import httpx
import msgpack
import numpy as np

from treepack.client import Packer
from treepack.service.cli.workloads import curriculum

from helpers.service import pack_body, rss_bytes, running_server, small_batch

SUITE_S = 120.0
RSS_BOUND = 160 << 20
FLAGS = (
    "--max-body-bytes",
    str(16 << 20),
    "--intake-budget-bytes",
    str(48 << 20),
    "--body-timeout-s",
    "2",
    "--header-timeout-s",
    "2",
    "--max-connections",
    "96",
    "--request-timeout-s",
    "5",
    "--malloc-keep-mb",
    "64",
)


def _raw(url: str) -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    s = socket.create_connection((host, int(port)), timeout=10)
    return s


def _closed_within(s: socket.socket, limit: float) -> float | None:
    """Seconds until the server closes (or answers) ``s``; None if it did neither within ``limit``."""
    s.settimeout(limit)
    t0 = time.monotonic()
    try:
        while True:
            data = s.recv(65536)
            if not data or b"\r\n\r\n" in data:
                return time.monotonic() - t0
    except TimeoutError:
        return None
    except ConnectionError:
        return time.monotonic() - t0
    finally:
        s.close()


def _half_headers(url: str) -> float | None:
    s = _raw(url)
    s.sendall(b"POST /v1/pack HTTP/1.1\r\nHost: t\r\nContent-Type: application/msgpack\r\n")
    return _closed_within(s, 10)


def _stalled_body(url: str) -> float | None:
    s = _raw(url)
    s.sendall(
        b"POST /v1/pack HTTP/1.1\r\nHost: t\r\nContent-Type: application/msgpack\r\nContent-Length: 1000000\r\n\r\n"
        + b"\x80" * 1000
    )
    return _closed_within(s, 10)


def _vanish_mid_body(url: str) -> None:
    s = _raw(url)
    s.sendall(
        b"POST /v1/pack HTTP/1.1\r\nHost: t\r\nContent-Type: application/msgpack\r\nContent-Length: 4000000\r\n\r\n"
        + b"\x00" * 2_000_000
    )
    s.close()


def _whatif_then_leave(url: str) -> None:
    body = msgpack.packb({"version": 1, "seq_len": 131072, "trials": 2000, "compositions": [{"groups": 4}]})
    s = _raw(url)
    s.sendall(
        b"POST /v1/whatif HTTP/1.1\r\nHost: t\r\nContent-Type: application/msgpack\r\nContent-Length: "
        + str(len(body)).encode()
        + b"\r\n\r\n"
        + body
    )
    time.sleep(0.3)
    s.close()


def _metric(url: str, name: str) -> float:
    text = httpx.get(url + "/metrics", timeout=10).text
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name):
            total += float(line.rsplit(" ", 1)[1])
    return total


def test_fault_suite(tmp_path):
    report: dict = {}
    w = curriculum(8)
    with running_server("--history-path", str(tmp_path / "h.sqlite3"), *FLAGS) as (url, proc):
        with Packer(url) as p:
            for _ in range(5):
                p.pack(**w.plan_kwargs(), tags=w.tags)
        rss_before = rss_bytes(proc.pid)
        t_start = time.monotonic()
        done, errors = [], []

        def load(n: int) -> None:
            with Packer(url, timeout=30, total_timeout=60) as p:
                for _ in range(n):
                    if time.monotonic() - t_start > SUITE_S:
                        return
                    try:
                        p.pack(**w.plan_kwargs(), tags=w.tags)
                        done.append(1)
                    except Exception as exc:  # counted: the suite requires none
                        errors.append(repr(exc))

        loaders = [threading.Thread(target=load, args=(25,)) for _ in range(6)]
        for t in loaders:
            t.start()
        slow = {"half_headers_s": [], "stalled_body_s": []}
        for _ in range(4):
            slow["half_headers_s"].append(_half_headers(url))
            slow["stalled_body_s"].append(_stalled_body(url))
            _vanish_mid_body(url)
        _whatif_then_leave(url)
        oversized = httpx.post(
            url + "/v1/pack", content=b"\x00" * (17 << 20), headers={"content-type": "application/msgpack"}, timeout=30
        )
        gz = httpx.post(
            url + "/v1/pack",
            content=gzip.compress(pack_body(small_batch())),
            headers={"content-type": "application/msgpack", "content-encoding": "gzip"},
            timeout=30,
        )
        burst_status: list[int] = []

        def big_upload() -> None:
            r = httpx.post(
                url + "/v1/pack",
                content=b"\x00" * (12 << 20),
                headers={"content-type": "application/msgpack"},
                timeout=30,
            )
            burst_status.append(r.status_code)

        burst = [threading.Thread(target=big_upload) for _ in range(16)]
        for t in burst:
            t.start()
        for t in burst + loaders:
            t.join(SUITE_S)
        elapsed = time.monotonic() - t_start
        time.sleep(1.0)
        rss_after = rss_bytes(proc.pid)
        stopped = _metric(url, "treepack_work_stopped_total")
        ready = httpx.get(url + "/readyz", timeout=10).status_code
        report.update(
            packs=len(done),
            pack_errors=len(errors),
            load_s=round(elapsed, 1),
            packs_per_s=round(len(done) / elapsed, 1),
            half_headers_closed_s=max(slow["half_headers_s"], key=lambda x: x or 1e9),
            stalled_body_closed_s=max(slow["stalled_body_s"], key=lambda x: x or 1e9),
            oversized=oversized.status_code,
            gzip=gz.status_code,
            burst={str(k): burst_status.count(k) for k in sorted(set(burst_status))},
            work_stopped=stopped,
            rss_before_mb=round(rss_before / 2**20, 1),
            rss_after_mb=round(rss_after / 2**20, 1),
        )
        assert errors == [], errors[:3]
        assert all(x is not None and x < 4.5 for x in slow["half_headers_s"]), slow  # header_timeout_s 2 (+ slack)
        assert all(x is not None and x < 4.5 for x in slow["stalled_body_s"]), slow  # body_timeout_s 2 -> 408
        assert oversized.status_code == 413 and gz.status_code == 415
        # Read and refused as garbage (400), refused once their bytes pass the intake budget
        # (503, charged as they arrive), or cut at body_timeout_s (408) while the others are read.
        assert set(burst_status) <= {400, 408, 503} and len(burst_status) == 16
        assert stopped >= 1  # the what-if whose client left was stopped (or hit its 5 s deadline)
        assert ready == 200
        assert rss_after - rss_before < RSS_BOUND, report
    report["sigkill_rounds"] = _sigkill_rounds(tmp_path / "k.sqlite3", rounds=3)
    print("fault suite:", json.dumps(report))
    if os.environ.get("TREEPACK_FAULT_REPORT"):
        with open(os.environ["TREEPACK_FAULT_REPORT"], "w") as f:
            json.dump(report, f, indent=1)


def _sigkill_rounds(db, rounds: int) -> list[int]:
    """Pack, SIGKILL mid-load, restart: each round the history opens healthy and keeps every batch it had."""
    w = curriculum(6)
    counts = []
    for _ in range(rounds):
        with running_server("--history-path", str(db), *FLAGS) as (url, proc):
            assert httpx.get(url + "/readyz", timeout=10).status_code == 200
            with Packer(url) as p:
                for _ in range(3):
                    p.pack(**w.plan_kwargs(), tags=w.tags)
            counts.append(httpx.get(url + "/v1/history", timeout=10).json()["batches"])
            proc.send_signal(signal.SIGKILL)
            proc.wait(timeout=10)
        conn = sqlite3.connect(db)
        assert conn.execute("PRAGMA quick_check").fetchone()[0] == "ok"
        conn.close()
    assert counts == sorted(counts) and counts[-1] >= 3 * rounds - 3, counts
    return counts


# Round two: one test per hardening item, each against a real server on 127.0.0.1.


def _hwm(pid: int) -> int:
    """Peak resident set size of a process (Linux /proc VmHWM)."""
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM")


def _empty_maps_body(nbytes: int) -> bytes:
    """A msgpack pack body whose unknown field ``x`` holds ``nbytes`` of empty maps."""
    head = msgpack.packb({"version": 1, "seq_len": 64, "tokens": b"", "offsets": b""})
    return bytes([head[0] + 1]) + head[1:] + b"\xa1x\xdd" + nbytes.to_bytes(4, "big") + b"\x80" * nbytes


def test_fault_decoding_holds_a_small_multiple_of_the_body():
    body = _empty_maps_body(8 << 20)
    js = b'{"version":1,"seq_len":64,"tokens":"","offsets":"","x":[' + b"{}," * ((8 << 20) // 3) + b"{}]}"
    with running_server("--no-history", "--max-body-bytes", str(16 << 20), "--malloc-keep-mb", "0") as (url, proc):
        httpx.post(
            url + "/v1/pack",
            content=pack_body(small_batch()),
            headers={"content-type": "application/msgpack"},
            timeout=30,
        )
        base = _hwm(proc.pid)
        r = httpx.post(url + "/v1/pack", content=body, headers={"content-type": "application/msgpack"}, timeout=120)
        j = httpx.post(url + "/v1/pack", content=js, headers={"content-type": "application/json"}, timeout=120)
        grew = _hwm(proc.pid) - base
    assert r.status_code == 422 and r.json()["rule"] == "unknown_field", r.text
    assert j.status_code == 413 and j.json()["rule"] == "decode_budget", j.text
    assert grew < 5 * len(body) + (32 << 20), grew / len(body)  # the body itself and 4x while decoding


def test_fault_a_tiny_whatif_is_refused_before_any_trial():
    run = 1 << 22
    shape = {
        "seq_len": run,
        "min_shared_len": 8,
        "seq_ptr": b"\x00" * 8 + (1).to_bytes(8, "little"),
        "run_hash": (7).to_bytes(8, "little"),
        "run_len": run.to_bytes(8, "little"),
        "first_trainable": b"\x00" * 8,
        "groups": [None],
    }
    body = msgpack.packb(
        {"version": 1, "seq_len": run, "trials": 16, "compositions": [{"groups": 1}], "shapes": [shape]}
    )
    assert len(body) < 300
    with running_server("--no-history", "--max-tokens", str(run)) as (url, _):
        r = httpx.post(url + "/v1/whatif", content=body, headers={"content-type": "application/msgpack"}, timeout=120)
        trials = _metric(url, "treepack_whatif_trials_total")
    assert r.status_code == 413 and r.json()["rule"] == "max_work" and "whatif_max_work" in r.json()["message"], r.text
    assert trials == 0


def test_fault_stalled_uploads_do_not_starve_a_small_pack():
    with running_server("--no-history", "--body-first-byte-s", "3") as (url, _):
        stalled = []
        for _ in range(2):
            s = _raw(url)
            s.sendall(
                b"POST /v1/pack HTTP/1.1\r\nHost: t\r\nContent-Type: application/msgpack\r\nContent-Length: "
                + str(256 << 20).encode()
                + b"\r\n\r\n"
            )
            stalled.append(s)
        time.sleep(0.3)
        t0 = time.monotonic()
        r = httpx.post(
            url + "/v1/pack",
            content=pack_body(small_batch()),
            headers={"content-type": "application/msgpack"},
            timeout=30,
        )
        took = time.monotonic() - t0
        cut = [_closed_within(s, 10) for s in stalled]
    print("small pack beside two stalled 256 MiB uploads:", round(took, 3), "s; stalled uploads answered after", cut)
    assert r.status_code == 200, r.text
    assert all(c is not None for c in cut), cut  # answered 408 after the first-byte timeout


def test_fault_a_reused_key_never_replays_another_body():
    rng = np.random.default_rng(3)
    seqs = [rng.integers(0, 50_000, 3000, dtype=np.uint32) for _ in range(40)]
    a = pack_body(dict(sequences=seqs, trainable=[10] * 40, groups=list(range(40)), seq_len=4096))
    seqs[20] = seqs[20].copy()
    seqs[20][1500] += 1
    b = pack_body(dict(sequences=seqs, trainable=[10] * 40, groups=list(range(40)), seq_len=4096))
    assert len(a) == len(b) and a != b
    headers = {"content-type": "application/msgpack", "idempotency-key": "k-1"}
    with running_server("--no-history") as (url, _):
        first = httpx.post(url + "/v1/pack", content=a, headers=headers, timeout=30)
        other = httpx.post(url + "/v1/pack", content=b, headers=headers, timeout=30)
    assert first.status_code == 200 and other.status_code == 409, other.text


def test_fault_probes_are_answered_under_a_connection_flood():
    with running_server("--no-history", "--max-connections", "16", "--header-timeout-s", "30") as (url, _):
        idle = [_raw(url) for _ in range(40)]
        try:
            time.sleep(0.3)
            health = httpx.get(url + "/healthz", timeout=10)
            ready = httpx.get(url + "/readyz", timeout=10)
            other = httpx.get(url + "/v1/history", timeout=10)
        finally:
            for s in idle:
                s.close()
    assert health.status_code == 200 and ready.status_code == 200, (health.text, ready.text)
    assert other.status_code == 503  # everything else still meets the limit


def test_fault_history_problems_are_reported_in_one_short_line(tmp_path):
    foreign = tmp_path / "foreign.sqlite3"
    conn = sqlite3.connect(foreign)
    conn.execute("CREATE TABLE invoices (id INTEGER PRIMARY KEY)")
    conn.commit()
    conn.close()
    empty = tmp_path / "empty.sqlite3"
    empty.write_bytes(b"")
    for path in (foreign, empty):
        with running_server("--history-path", str(path), ready_status=503) as (url, _):
            r = httpx.get(url + "/readyz", timeout=10)
        assert r.status_code == 503 and str(path) not in r.text and len(r.text) < 400, r.text
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("x")
    out = subprocess.run(
        [sys.executable, "-m", "treepack.service", "--history-path", str(blocker / "h.sqlite3"), "--port", "1"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 2 and len(lines) == 1 and "--no-history" in lines[0], out.stderr


def test_fault_the_served_schema_states_the_running_limits():
    with running_server("--no-history", "--whatif-max-trials", "50") as (url, _):
        doc = httpx.get(url + "/openapi.json", timeout=10).json()
    schemas = doc["components"]["schemas"]
    assert schemas["WhatIfRequest"]["properties"]["trials"]["maximum"] == 50
    assert len(schemas["Composition"]["oneOf"]) == 2  # exactly one of groups / by_tag
    tokens = schemas["PackRequest"]["properties"]["tokens"]["anyOf"]
    assert {"type": "integer", "minimum": 0, "maximum": 2**32 - 1} in [o.get("items") for o in tokens]
