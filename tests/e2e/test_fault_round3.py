"""Round three of the fault suite: seven attacks, each against a real server on 127.0.0.1.

Each held a worker, memory or the history hostage, or acknowledged and then lost a batch:

1. a 2-token all-gather CP pack at ``seq_len`` 2**27 (a [rows, seq_len] float64 array);
2. distinct tags (a pool built by a scan per tag, twice per what-if);
3. ``by_tag`` keys priced by a scan of the pool per key;
4. a disconnect hidden behind a pipelined request;
5. (``test_history_migration_kill.py``) a SIGKILL during the schema migration;
6. a lone-surrogate group id answered ``recorded: true``, then lost;
7. a cost file whose finite coefficient makes predictions infinite.

Bounded: every request and socket has a timeout; figures are printed with ``-s``.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time

import httpx
import msgpack
import numpy as np

from treepack.proto.batch import PackInput
from treepack.proto.batch_wire import encode_pack_body
from treepack.proto.cost import CostModel, cost_terms
from treepack.service.cli.workloads import curriculum

from helpers.service import running_server

MP = {"content-type": "application/msgpack"}
JS = {"content-type": "application/json"}


def _hwm(pid: int) -> int:
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM")


def _metric(url: str, name: str) -> float:
    text = httpx.get(url + "/metrics", timeout=10).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name))


def _pack_msg(seqs: list[np.ndarray], seq_len: int, **fields) -> bytes:
    off = np.concatenate([[0], np.cumsum([len(x) for x in seqs])]).astype("<i8")
    msg = {
        "version": 1,
        "seq_len": seq_len,
        "tokens": np.concatenate(seqs).astype("<u4").tobytes(),
        "offsets": off.tobytes(),
        "prompt_lens": np.full(len(seqs), 2, "<i8").tobytes(),
        **fields,
    }
    return msgpack.packb(msg)


def _tiny(n: int, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 50_000, 4, dtype=np.uint32) for _ in range(n)]


def test_a_tiny_allgather_pack_cannot_ask_for_gigabytes():
    """134 bytes asked for a float64 per position of a 2**27-position row (1.4 GiB, 16 s, a
    16 MiB answer; 2**31 - 1 was a MemoryError 500 or the OOM killer): now 413 at once,
    naming the figure and the setting, for packs and what-ifs; a row within the limit plans."""
    big = json.dumps(
        {
            "version": 1,
            "seq_len": 1 << 27,
            "tokens": [1, 2],
            "offsets": [0, 2],
            "cp_size": 2,
            "cp_attention": "allgather",
        }
    ).encode()
    shape = {
        "seq_len": 1 << 27,
        "min_shared_len": 8,
        "seq_ptr": np.array([0, 1], "<i8").tobytes(),
        "run_hash": np.array([7], "<u8").tobytes(),
        "run_len": np.array([2], "<i8").tobytes(),
        "first_trainable": np.array([1], "<i8").tobytes(),
        "groups": [None],
    }
    whatif = msgpack.packb(
        {
            "version": 1,
            "seq_len": 1 << 27,
            "trials": 8,
            "cp_size": 2,
            "cp_attention": "allgather",
            "compositions": [{"groups": 1}],
            "shapes": [shape],
        }
    )
    with running_server("--no-history", "--malloc-keep-mb", "0") as (url, proc):
        base = _hwm(proc.pid)
        out = {}
        for name, path, body, headers in (
            ("pack 2**27", "/v1/pack", big, JS),
            ("pack 2**31-1", "/v1/pack", big.replace(b"134217728", b"2147483647"), JS),
            ("what-if 8 x 2**27", "/v1/whatif", whatif, MP),
        ):
            t0 = time.monotonic()
            r = httpx.post(url + path, content=body, headers=headers, timeout=120)
            out[name] = (r.status_code, r.json().get("rule"), round(time.monotonic() - t0, 2), len(r.content))
            assert r.status_code == 413 and r.json()["rule"] == "max_cp_tiles", r.text[:300]
            assert "max_cp_tiles" in r.json()["message"] and "tiles" in r.json()["message"]
        grew = _hwm(proc.pid) - base
        ok = httpx.post(url + "/v1/pack", content=big.replace(b"134217728", b"1048576"), headers=JS, timeout=60)
    print("all-gather attacks:", out, "peak gain MiB", round(grew / 2**20, 1))
    assert grew < 32 << 20, grew / 2**20
    assert ok.status_code == 200 and len(ok.json()["plan"]["ranks"]["cp_tiles"]["shape"]) == 2


def test_distinct_tags_are_bounded_and_cost_linear_time():
    """30,000 distinct tags in one pack poisoned the history (every later what-if 23 s and a
    504); now 413 ``max_tags`` before recording, and a history that gathered 12,000 distinct
    tags over 12 packs within the limit answers a small what-if in a second or two."""
    many = _pack_msg(_tiny(30_000), 64, tags=[f"t{i}" for i in range(30_000)])
    with running_server("--request-timeout-s", "30") as (url, _):  # max_tags 1024 by default
        r = httpx.post(url + "/v1/pack", content=many, headers=MP, timeout=60)
        assert r.status_code == 413 and r.json()["rule"] == "max_tags" and "30000 distinct tags" in r.text, r.text
        assert httpx.get(url + "/v1/history", timeout=10).json()["batches"] == 0
        for p in range(12):
            body = _pack_msg(_tiny(1000, seed=p), 64, tags=[f"p{p}-{i}" for i in range(1000)])
            assert httpx.post(url + "/v1/pack", content=body, headers=MP, timeout=60).status_code == 200
        t0 = time.monotonic()
        w = httpx.post(
            url + "/v1/whatif",
            content=b'{"version":1,"seq_len":64,"compositions":[{"groups":1}]}',
            headers=JS,
            timeout=60,
        )
        took = time.monotonic() - t0
    print("what-if over 12,000 tags:", w.status_code, round(took, 2), "s", len(w.content), "bytes")
    assert w.status_code == 200, w.text
    pool = w.json()["pool"]
    assert pool["groups"] == 12_000 and len(pool["tags"]) == 1024 and pool["tags_omitted"] == 12_000 - 1024
    assert took < 5.0


def test_by_tag_keys_are_bounded_and_priced_by_lookup():
    """7,000 by_tag keys against 100,000 groups burned 9.4 s before any check; now more keys
    than ``max_tags`` are 413 at once, and 1,000 keys against 40,000 groups price in a blink."""
    keys = {"": 1} | {f"k{i}": 0 for i in range(7000)}
    with running_server("--request-timeout-s", "30") as (url, _):
        for p in range(4):
            body = _pack_msg(_tiny(10_000, seed=p), 64)
            assert httpx.post(url + "/v1/pack", content=body, headers=MP, timeout=60).status_code == 200
        t0 = time.monotonic()
        r = httpx.post(
            url + "/v1/whatif",
            content=json.dumps({"version": 1, "seq_len": 64, "trials": 1, "compositions": [{"by_tag": keys}]}),
            headers=JS,
            timeout=60,
        )
        refused = time.monotonic() - t0
        keys = {"": 1} | {f"k{i}": 0 for i in range(1000)}
        t0 = time.monotonic()
        ok = httpx.post(
            url + "/v1/whatif",
            content=json.dumps({"version": 1, "seq_len": 64, "trials": 1, "compositions": [{"by_tag": keys}]}),
            headers=JS,
            timeout=60,
        )
        took = time.monotonic() - t0
    print(f"by_tag 7,000 keys: {r.status_code} in {refused:.2f} s; 1,000 keys: {ok.status_code} in {took:.2f} s")
    assert r.status_code == 413 and r.json()["rule"] == "max_tags" and refused < 2.0, r.text
    assert ok.status_code == 200 and ok.json()["pool"]["groups"] == 40_000 and took < 5.0, ok.text


def test_a_pipelined_request_does_not_hide_a_disconnect():
    """A client pipelines a second request behind a long what-if and leaves: uvicorn marked
    only the newest request, so the what-if ran to its deadline (38 s) while the next pack
    waited for the one planner; now the connection's loss stops it within a poll."""
    with running_server(
        "--max-concurrent-plans",
        "1",
        "--request-timeout-s",
        "40",
        "--whatif-max-work",
        str(1 << 40),
    ) as (url, _):
        for seed in range(3):
            w = curriculum(16, seed=seed, seq_len=32768)
            body = encode_pack_body(PackInput.of(**w.plan_kwargs(), tags=w.tags))
            assert httpx.post(url + "/v1/pack", content=body, headers=MP, timeout=60).status_code == 200
        small = encode_pack_body(PackInput.of(**curriculum(2, seed=9, seq_len=32768).plan_kwargs(), record=False))
        wi = json.dumps({"version": 1, "seq_len": 32768, "trials": 2000, "compositions": [{"groups": 16}]}).encode()
        host, port = url.removeprefix("http://").split(":")
        s = socket.create_connection((host, int(port)), timeout=10)
        s.sendall(
            b"POST /v1/whatif HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\nContent-Length: "
            + str(len(wi)).encode()
            + b"\r\n\r\n"
            + wi
        )
        time.sleep(0.5)  # the what-if is planning
        s.sendall(b"GET /v1/history HTTP/1.1\r\nHost: t\r\n\r\n")  # pipelined behind it
        time.sleep(0.3)
        s.close()
        t0 = time.monotonic()
        r = httpx.post(url + "/v1/pack", content=small, headers=MP, timeout=60)
        took = time.monotonic() - t0
        stopped = _metric(url, "treepack_work_stopped_total")
    print(f"next pack after a dead pipelined what-if: {r.status_code} in {took:.2f} s; stopped {stopped}")
    assert r.status_code == 200 and took < 5.0, took
    assert stopped >= 1


def test_an_acknowledged_batch_is_in_the_history():
    """A lone-surrogate group id was answered 200 ``recorded: true`` and then failed in the
    writer; now it is 422 ``unicode``, and every batch answered ``recorded: true`` (odd
    labels and tags included) is read back from the history."""
    surrogate = (
        b'{"version":1,"seq_len":64,"tokens":[1,2,3,4],"offsets":[0,2,4],"prompt_lens":[1,1],'
        b'"groups":["\\udfff","\\udfff"]}'
    )
    odd = [
        dict(groups=["\u00e9t\u00e9", "\U0001f600"], tags=["\u4e2d\u6587", "a" * 256]),
        dict(groups=[2**63 - 1, -(2**63)], tags=[None, ""]),
        dict(groups=["x" * 256, None], tags=["\u0000nul", "tab\t"]),
    ]
    with running_server() as (url, _):
        r = httpx.post(url + "/v1/pack", content=surrogate, headers=JS, timeout=30)
        assert r.status_code == 422 and r.json()["rule"] == "unicode" and r.json()["path"] == "$.groups[0]", r.text
        recorded = 0
        for fields in odd:
            body = json.dumps(
                {"version": 1, "seq_len": 64, "tokens": [1, 2, 3, 5], "offsets": [0, 2, 4], "prompt_lens": [1, 1]}
                | fields
            )
            a = httpx.post(url + "/v1/pack", content=body, headers=JS, timeout=30)
            assert a.status_code == 200, a.text
            recorded += a.json()["recorded"]
        history = httpx.get(url + "/v1/history", timeout=10).json()
        failed = _metric(url, "treepack_history_failed_total")
    assert recorded == 3 and history["batches"] == 3 and failed == 0, (history, failed)
    assert {"\u4e2d\u6587", "a" * 256, "\u0000nul", "tab\t", ""} <= set(history["tags"])


def test_a_cost_file_whose_predictions_overflow_stops_startup(tmp_path):
    """A finite coefficient of 1e300 on ``attention_pairs`` made JSON packs 500 and msgpack
    answers carry an infinity; now ``treepack serve`` stops at startup with one line naming
    the coefficient and the largest usable value, and a file at that value serves finite
    predictions at ``seq_len`` 2**20 (the control)."""
    coef = {t: 0.0 for t in cost_terms("sdpa")}
    bad = tmp_path / "bad.json"
    CostModel(backend="sdpa", coefficients=coef | {"attention_pairs": 1e300}).save(bad)
    out = subprocess.run(
        [sys.executable, "-m", "treepack.service", "--no-history", "--port", "1", "--cost-model-path", str(bad)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 2 and len(lines) == 1, out.stderr
    assert "$.coefficients.attention_pairs" in lines[0] and str(bad) in lines[0] and "at most" in lines[0]
    usable = float(lines[0].split("at most ")[1].split()[0])
    edge = tmp_path / "edge.json"
    CostModel(backend="sdpa", coefficients=coef | {"attention_pairs": usable * 0.99}).save(edge)
    body = b'{"version":1,"seq_len":1048576,"tokens":[1,2,3,4],"offsets":[0,4],"prompt_lens":[2]}'
    with running_server("--no-history", "--cost-model-path", str(edge)) as (url, _):
        r = httpx.post(url + "/v1/pack", content=body, headers=JS, timeout=60)
    assert r.status_code == 200, r.text
    assert 0 < r.json()["plan"]["stats"]["predicted_ms"] < 1.8e308
