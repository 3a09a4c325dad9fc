"""Seven attacks on the sidecar, each against its own server on 127.0.0.1: status, seconds, RSS growth, answer bytes.

Run by ``python benchmarks/service_hardening.py --only attacks`` (``--pythonpath DIR`` runs
the server from another build, to compare before and after in one sitting). Every request
has a timeout (reported as ``> N s``); every server is killed at the end of its case.

1. ``cp_allgather``: a JSON pack of 2 tokens at ``seq_len`` 2**27 with ``cp_size`` 2 and
   ``cp_attention="allgather"`` (and the Ulysses control); ``cp_allgather_max``: the same
   at ``seq_len`` 2**31 - 1 under a 6 GiB address-space limit; ``cp_allgather_whatif``:
   8 trials of an inline 2-token shape at 2**27.
2. ``distinct_tags``: one pack recording 30,000 distinct tags, then a 56-byte what-if;
   within the limits: 12 packs of 1,000 distinct tags each, then the same what-if.
3. ``by_tag_keys``: a what-if whose ``by_tag`` has 7,000 keys, against a history of
   100,000 groups; within the limits: 1,000 keys.
4. ``pipelined_disconnect``: a long what-if with a second request pipelined behind it on
   the same connection, the client gone after 0.5 s; then a small pack on a new connection
   (one planner thread): its latency.
5. ``migration_sigkill``: a schema-1 history of 40 batches (60 MB) opened by a server that
   is SIGKILLed while it adds the checksums (once 8 MB of WAL are written); after a restart: batches usable, what
   ``/v1/history`` and ``/readyz`` say, a what-if's status.
6. ``surrogate_group``: a JSON pack whose group id is a lone surrogate (``"\\udfff"``),
   then ``/v1/history``: was the acknowledged batch recorded?
7. ``huge_cost``: a cost file with an ``attention_pairs`` coefficient of 1e300: does the
   server start, and what does a JSON pack at ``seq_len`` 2**20 answer?
"""

from __future__ import annotations

import json
import os
import resource
import signal
import socket
import sqlite3
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import msgpack
import numpy as np

MP = {"content-type": "application/msgpack"}
JS = {"content-type": "application/json"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _kb(pid: int, key: str) -> int:
    try:
        for line in open(f"/proc/{pid}/status"):
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return -1


class Server:
    """``python -m treepack.service`` on 127.0.0.1 with ``flags``; ``start()`` waits for ``/healthz``."""

    def __init__(self, pythonpath: str | None, *flags: str, address_space: int | None = None) -> None:
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = {k: v for k, v in os.environ.items() if not k.startswith("TREEPACK_")}
        if pythonpath:
            env["PYTHONPATH"] = pythonpath + os.pathsep + env.get("PYTHONPATH", "")
        cmd = [sys.executable, "-m", "treepack.service", "--port", str(self.port), "--log-level", "error", *flags]
        limit = (
            None if address_space is None else (lambda: resource.setrlimit(resource.RLIMIT_AS, (address_space,) * 2))
        )
        self.proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, preexec_fn=limit)

    def start(self, timeout: float = 60.0) -> bool:
        """True once the server answers; False when it exited first."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                return False
            try:
                if httpx.get(self.url + "/healthz", timeout=1).status_code == 200:
                    return True
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        raise RuntimeError("the server did not start")

    def rss(self) -> int:
        return _kb(self.proc.pid, "VmRSS")

    def hwm(self) -> int:
        return _kb(self.proc.pid, "VmHWM")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=30)


def _post(url: str, body: bytes, headers: dict[str, str], timeout: float) -> tuple[str, float, int, str]:
    """(status, seconds, answer bytes, the error's rule or '')."""
    t0 = time.perf_counter()
    try:
        r = httpx.post(url, content=body, headers=headers, timeout=timeout)
    except httpx.TimeoutException:
        return f"> {timeout:g} s", time.perf_counter() - t0, 0, ""
    except httpx.HTTPError as exc:
        return type(exc).__name__, time.perf_counter() - t0, 0, ""
    took = time.perf_counter() - t0
    rule = ""
    if r.status_code >= 400 and r.headers.get("content-type", "").startswith("application/json"):
        rule = r.json().get("rule", "")
    return str(r.status_code), took, len(r.content), rule


def _row(case: str, server: Server, rss0: int, hwm0: int, res: tuple[str, float, int, str], **more: Any) -> dict:
    status, took, nbytes, rule = res
    row = {
        "case": case,
        "status": status + (f" {rule}" if rule else ""),
        "seconds": round(took, 2),
        "rss_growth_mib": round((server.rss() - rss0) / 2**20, 1) if server.proc.poll() is None else "exited",
        "peak_gain_mib": round((server.hwm() - hwm0) / 2**20, 1) if server.proc.poll() is None else "exited",
        "answer_bytes": nbytes,
        **more,
    }
    print(json.dumps(row), flush=True)
    return row


def _cp_body(seq_len: int, attention: str) -> bytes:
    return json.dumps(
        {
            "version": 1,
            "seq_len": seq_len,
            "tokens": [1, 2],
            "offsets": [0, 2],
            "cp_size": 2,
            "cp_attention": attention,
            "record": False,
        },
        separators=(",", ":"),
    ).encode()


def attack_cp(pp: str | None, timeout: float) -> list[dict]:
    out = []
    for case, seq_len, attention, limit in (
        ("cp_allgather 2**27", 1 << 27, "allgather", None),
        ("cp_ulysses 2**27 (control)", 1 << 27, "ulysses", None),
        ("cp_allgather 2**31-1, 6 GiB limit", 2**31 - 1, "allgather", 6 << 30),
    ):
        s = Server(pp, "--no-history", "--request-timeout-s", str(int(timeout)), address_space=limit)
        try:
            s.start()
            rss0, hwm0 = s.rss(), s.hwm()
            body = _cp_body(seq_len, attention)
            out.append(_row(case, s, rss0, hwm0, _post(s.url + "/v1/pack", body, JS, timeout), body_bytes=len(body)))
        finally:
            s.stop()
    run = 1 << 27
    shape = {
        "seq_len": run,
        "min_shared_len": 8,
        "seq_ptr": np.array([0, 1], "<i8").tobytes(),
        "run_hash": np.array([7], "<u8").tobytes(),
        "run_len": np.array([2], "<i8").tobytes(),
        "first_trainable": np.array([1], "<i8").tobytes(),
        "groups": [None],
    }
    body = msgpack.packb(
        {
            "version": 1,
            "seq_len": run,
            "trials": 8,
            "cp_size": 2,
            "cp_attention": "allgather",
            "compositions": [{"groups": 1}],
            "shapes": [shape],
        }
    )
    s = Server(pp, "--no-history", "--request-timeout-s", str(int(timeout)))
    try:
        s.start()
        rss0, hwm0 = s.rss(), s.hwm()
        out.append(
            _row("cp_allgather what-if, 8 trials", s, rss0, hwm0, _post(s.url + "/v1/whatif", body, MP, timeout))
        )
    finally:
        s.stop()
    return out


def _pack_msg(seqs: list[np.ndarray], seq_len: int, **fields: Any) -> bytes:
    lens = np.array([len(x) for x in seqs], dtype=np.int64)
    off = np.concatenate([[0], np.cumsum(lens)]).astype("<i8")
    msg = {
        "version": 1,
        "seq_len": seq_len,
        "tokens": np.concatenate(seqs).astype("<u4").tobytes(),
        "offsets": off.tobytes(),
        "prompt_lens": np.full(len(seqs), 2, "<i8").tobytes(),
        **fields,
    }
    return msgpack.packb(msg)


def attack_tags(pp: str | None, timeout: float) -> list[dict]:
    rng = np.random.default_rng(0)
    n = 30_000
    seqs = [rng.integers(0, 50_000, 4, dtype=np.uint32) for _ in range(n)]
    pack = _pack_msg(seqs, 64, tags=[f"t{i}" for i in range(n)])
    whatif = b'{"version":1,"seq_len":64,"compositions":[{"groups":1}]}'
    out = []
    with tempfile.TemporaryDirectory() as tmp:
        s = Server(pp, "--history-path", f"{tmp}/h.sqlite3", "--request-timeout-s", str(int(timeout)))
        try:
            s.start()
            rss0, hwm0 = s.rss(), s.hwm()
            res = _post(s.url + "/v1/pack", pack, MP, timeout)
            out.append(_row("distinct_tags: pack of 30,000 tags", s, rss0, hwm0, res, body_bytes=len(pack)))
            rss0, hwm0 = s.rss(), s.hwm()
            res = _post(s.url + "/v1/whatif", whatif, JS, timeout)
            out.append(_row("distinct_tags: then a small what-if", s, rss0, hwm0, res, body_bytes=len(whatif)))
        finally:
            s.stop()
        s = Server(pp, "--history-path", f"{tmp}/h2.sqlite3", "--request-timeout-s", str(int(timeout)))
        try:
            s.start()
            for p in range(12):
                seqs = [rng.integers(0, 50_000, 4, dtype=np.uint32) for _ in range(1000)]
                body = _pack_msg(seqs, 64, tags=[f"p{p}-{i}" for i in range(1000)])
                assert httpx.post(s.url + "/v1/pack", content=body, headers=MP, timeout=120).status_code == 200
            rss0, hwm0 = s.rss(), s.hwm()
            res = _post(s.url + "/v1/whatif", whatif, JS, timeout)
            out.append(_row("distinct_tags: 12 packs of 1,000 tags, then a small what-if", s, rss0, hwm0, res))
        finally:
            s.stop()
    return out


def attack_by_tag(pp: str | None, timeout: float) -> list[dict]:
    rng = np.random.default_rng(1)
    with tempfile.TemporaryDirectory() as tmp:
        s = Server(
            pp, "--history-path", f"{tmp}/h.sqlite3", "--request-timeout-s", str(int(timeout)), "--max-queue", "64"
        )
        try:
            s.start()
            for _ in range(10):  # 10 x 10,000 groups (no group ids: each sequence its own)
                seqs = [rng.integers(0, 50_000, 4, dtype=np.uint32) for _ in range(10_000)]
                r = httpx.post(s.url + "/v1/pack", content=_pack_msg(seqs, 64), headers=MP, timeout=120)
                assert r.status_code == 200, r.text
            by_tag = {"": 1} | {f"k{i}": 0 for i in range(7000)}
            body = json.dumps({"version": 1, "seq_len": 64, "trials": 1, "compositions": [{"by_tag": by_tag}]}).encode()
            rss0, hwm0 = s.rss(), s.hwm()
            res = _post(s.url + "/v1/whatif", body, JS, timeout)
            rows = [_row("by_tag: 7,000 keys, 100k groups", s, rss0, hwm0, res, body_bytes=len(body))]
            by_tag = {"": 1} | {f"k{i}": 0 for i in range(1000)}
            body = json.dumps({"version": 1, "seq_len": 64, "trials": 1, "compositions": [{"by_tag": by_tag}]}).encode()
            rss0, hwm0 = s.rss(), s.hwm()
            res = _post(s.url + "/v1/whatif", body, JS, timeout)
            return rows + [_row("by_tag: 1,000 keys, 100k groups", s, rss0, hwm0, res, body_bytes=len(body))]
        finally:
            s.stop()


def attack_pipelined(pp: str | None, timeout: float) -> list[dict]:
    from treepack.proto.batch import PackInput
    from treepack.proto.batch_wire import encode_pack_body
    from treepack.service.cli.workloads import curriculum

    with tempfile.TemporaryDirectory() as tmp:
        s = Server(
            pp,
            "--history-path",
            f"{tmp}/h.sqlite3",
            "--max-concurrent-plans",
            "1",
            "--request-timeout-s",
            "40",
            "--whatif-max-work",
            str(1 << 40),
        )
        try:
            s.start()
            for seed in range(4):
                w = curriculum(16, seed=seed, seq_len=32768)
                body = encode_pack_body(PackInput.of(**w.plan_kwargs(), tags=w.tags))
                assert httpx.post(s.url + "/v1/pack", content=body, headers=MP, timeout=60).status_code == 200
            small = encode_pack_body(PackInput.of(**curriculum(2, seed=9, seq_len=32768).plan_kwargs(), record=False))
            wi = json.dumps({"version": 1, "seq_len": 32768, "trials": 2000, "compositions": [{"groups": 16}]})
            head = f"POST /v1/whatif HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\nContent-Length: {len(wi)}"
            second = b"GET /v1/history HTTP/1.1\r\nHost: t\r\n\r\n"
            rss0, hwm0 = s.rss(), s.hwm()
            sock = socket.create_connection(("127.0.0.1", s.port), timeout=10)
            sock.sendall(head.encode() + b"\r\n\r\n" + wi.encode())
            time.sleep(0.3)
            sock.sendall(second)
            time.sleep(0.5)
            sock.close()
            res = _post(s.url + "/v1/pack", small, MP, timeout)
            return [_row("pipelined: small pack after a dead pipelined what-if", s, rss0, hwm0, res)]
        finally:
            s.stop()


def _schema1_history(path: Path, batches: int) -> int:
    """A schema-1 history of ``batches`` rows of ~1.5 MB each (the checksum column dropped); returns its bytes."""
    from treepack.proto.history import HistoryStore
    from treepack.proto.shape import BatchShape

    rng = np.random.default_rng(0)
    n = 60_000
    store = HistoryStore(path, max_batches=10_000, max_bytes=None)
    for i in range(batches):
        shape = BatchShape(
            seq_len=64,
            min_shared_len=8,
            seq_ptr=np.arange(n + 1, dtype=np.int64),
            run_hash=rng.integers(1, 2**63, n, dtype=np.uint64),
            run_len=np.full(n, 4, np.int64),
            first_trainable=np.full(n, 2, np.int64),
            groups=tuple(range(n)),
        )
        store.record(shape, rows=i + 1, packed_tokens=4 * n, saved_fraction=0.0)
    store.close()
    c = sqlite3.connect(path)
    c.execute("ALTER TABLE batches DROP COLUMN checksum")
    c.execute("PRAGMA user_version=1")
    c.execute("VACUUM")
    c.close()
    return path.stat().st_size


def attack_migration(pp: str | None, timeout: float) -> list[dict]:
    out = []
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "h.sqlite3"
        size = _schema1_history(path, 40)
        wal = Path(str(path) + "-wal")
        s = Server(pp, "--history-path", str(path), "--history-max-bytes", str(1 << 30))
        t0 = time.monotonic()
        killed_at = None
        while time.monotonic() - t0 < 60 and s.proc.poll() is None:
            if wal.exists() and wal.stat().st_size > (8 << 20):  # the backfill is writing
                s.proc.send_signal(signal.SIGKILL)
                killed_at = round(time.monotonic() - t0, 2)
                break
            time.sleep(0.005)
        s.stop()
        s = Server(pp, "--history-path", str(path), "--history-max-bytes", str(1 << 30))
        try:
            s.start()
            hist = httpx.get(s.url + "/v1/history", timeout=timeout).json()
            ready = httpx.get(s.url + "/readyz", timeout=timeout).json()
            body = json.dumps({"version": 1, "seq_len": 64, "trials": 1, "compositions": [{"groups": 1}]}).encode()
            res = _post(s.url + "/v1/whatif", body, JS, timeout)
            out.append(
                _row(
                    "migration: SIGKILL mid-backfill, restart, what-if",
                    s,
                    s.rss(),
                    s.hwm(),
                    res,
                    file_mb=round(size / 1e6),
                    killed_after_s=killed_at,
                    history_batches=hist.get("batches"),
                    history_skipped=hist.get("skipped"),
                    readyz=ready["checks"].get("history"),
                )
            )
        finally:
            s.stop()
    return out


def attack_surrogate(pp: str | None, timeout: float) -> list[dict]:
    body = (
        b'{"version":1,"seq_len":64,"tokens":[1,2,3,4],"offsets":[0,2,4],"prompt_lens":[1,1],'
        b'"groups":["\\udfff","\\udfff"]}'
    )
    with tempfile.TemporaryDirectory() as tmp:
        s = Server(pp, "--history-path", f"{tmp}/h.sqlite3")
        try:
            s.start()
            rss0, hwm0 = s.rss(), s.hwm()
            res = _post(s.url + "/v1/pack", body, JS, timeout)
            recorded = None
            if res[0] == "200":
                recorded = httpx.post(s.url + "/v1/pack", content=body, headers=JS, timeout=timeout).json()["recorded"]
            batches = httpx.get(s.url + "/v1/history", timeout=timeout).json()["batches"]
            failed = sum(
                float(line.rsplit(" ", 1)[1])
                for line in httpx.get(s.url + "/metrics", timeout=timeout).text.splitlines()
                if line.startswith("treepack_history_failed_total")
            )
            return [
                _row(
                    "surrogate group id",
                    s,
                    rss0,
                    hwm0,
                    res,
                    answered_recorded=recorded,
                    history_batches=batches,
                    history_failed=failed,
                )
            ]
        finally:
            s.stop()


def attack_cost(pp: str | None, timeout: float) -> list[dict]:
    coef = {"step": 0.0, "rows": 0.0, "positions": 0.0, "loss_tokens": 0.0, "segments": 0.0, "attention_pairs": 1e300}
    with tempfile.TemporaryDirectory() as tmp:
        cost = Path(tmp) / "cost.json"
        cost.write_text(
            json.dumps(
                {"format": "treepack-cost-model", "version": 1, "backend": "sdpa", "mixers": [], "coefficients": coef}
            )
        )
        s = Server(pp, "--no-history", "--cost-model-path", str(cost))
        try:
            t0 = time.perf_counter()
            up = s.start()
            if not up:
                err = (s.proc.stderr.read() if s.proc.stderr else b"").decode(errors="replace").strip().splitlines()
                row = {
                    "case": "cost coefficient 1e300",
                    "status": f"refused at startup, exit {s.proc.returncode}",
                    "seconds": round(time.perf_counter() - t0, 2),
                    "stderr_lines": len(err),
                    "stderr": err[-1][:300] if err else "",
                }
                print(json.dumps(row), flush=True)
                return [row]
            rss0, hwm0 = s.rss(), s.hwm()
            body = (
                b'{"version":1,"seq_len":1048576,"tokens":[1,2,3,4],"offsets":[0,4],"prompt_lens":[2],"record":false}'
            )
            return [
                _row("cost coefficient 1e300: JSON pack", s, rss0, hwm0, _post(s.url + "/v1/pack", body, JS, timeout))
            ]
        finally:
            s.stop()


ATTACKS = {
    "cp": attack_cp,
    "tags": attack_tags,
    "by_tag": attack_by_tag,
    "pipelined": attack_pipelined,
    "migration": attack_migration,
    "surrogate": attack_surrogate,
    "cost": attack_cost,
}


def run_attacks(pythonpath: str | None, timeout: float, only: list[str] | None = None) -> list[dict]:
    """Run the attacks (all, or those named in ``only``); one row per case."""
    rows: list[dict] = []
    for name, fn in ATTACKS.items():
        if only and name not in only:
            continue
        rows += fn(pythonpath, timeout)
    return rows


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pythonpath", default=None)
    ap.add_argument("--timeout", type=float, default=90.0)
    ap.add_argument("--attack", action="append", choices=list(ATTACKS))
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    result = run_attacks(a.pythonpath, a.timeout, a.attack)
    if a.json:
        Path(a.json).write_text(json.dumps(result, indent=1))
