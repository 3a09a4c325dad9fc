"""Sidecar under cheap attacks: decoding memory, a tiny what-if, stalled uploads, a connection flood, body digests.

Loopback only: each case starts ``python -m treepack.service`` on 127.0.0.1 (a free port,
no history) and stops it. Bounded: every request has a timeout, reported as ``> N s``
when it runs out. ``--pythonpath DIR`` runs the server from another build (put first on
``PYTHONPATH``) to compare before and after in one run.

1. **Decoding memory**: peak resident memory (``VmHWM``) the server gains answering one
   adversarial body: a msgpack pack whose unknown field holds N MiB of empty maps, and a
   JSON one of empty objects (``--mib``, default 16 and 64).
2. **A tiny what-if**: ~250 bytes asking 16 trials of one inline shape of one 64 Mi-token
   run (default settings): its answer time and status.
3. **Stalled uploads**: two connections announce 256 MiB bodies and send nothing; the
   latency and status of a small pack sent beside them (``--repeats``).
4. **Connection flood**: 300 idle connections (over the default ``max_connections`` of
   256), then ``GET /healthz`` and ``GET /readyz``: status and latency.
5. **Body digest** (in-process): SHA-256 of a pack body at about 100k and 1M tokens
   against planning that batch (the cost of exact idempotency).
6. **Seven attacks** (``--only attacks``, not in the default run: several minutes):
   all-gather CP tiles, distinct tags, ``by_tag`` keys, a disconnect hidden behind a
   pipelined request, a SIGKILL during the history migration, a lone-surrogate group id, a
   cost file that overflows; each with its status, seconds, server RSS growth and answer
   bytes (:mod:`hardening_attacks`, which says what each sends).

Usage::

    python benchmarks/service_hardening.py                      # everything, this build
    python benchmarks/service_hardening.py --only memory --mib 16 --pythonpath /path/to/old/build
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import signal
import socket
import statistics
import subprocess
import sys
import time
from typing import Any

import httpx
import msgpack

MP = {"content-type": "application/msgpack"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _status_kb(pid: int, key: str) -> int:
    for line in open(f"/proc/{pid}/status"):
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    return -1


class Server:
    def __init__(self, pythonpath: str | None, *flags: str) -> None:
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = {k: v for k, v in os.environ.items() if not k.startswith("TREEPACK_")}
        if pythonpath:
            env["PYTHONPATH"] = pythonpath + os.pathsep + env.get("PYTHONPATH", "")
        cmd = [
            sys.executable,
            "-m",
            "treepack.service",
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--log-level",
            "error",
            "--no-history",
            *flags,
        ]
        self.proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(self.url + "/healthz", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("the server did not start")
            time.sleep(0.1)

    def hwm(self) -> int:
        return _status_kb(self.proc.pid, "VmHWM")

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=30)


def _small_pack() -> bytes:
    from treepack.proto.batch import PackInput
    from treepack.proto.batch_wire import encode_pack_body
    from treepack.service.cli.workloads import curriculum

    w = curriculum(8, seed=0)
    return encode_pack_body(PackInput.of(**w.plan_kwargs(), tags=w.tags))


def _post(url: str, body: bytes, headers: dict[str, str], timeout: float) -> tuple[str, float]:
    t0 = time.perf_counter()
    try:
        r = httpx.post(url, content=body, headers=headers, timeout=timeout)
        return str(r.status_code), time.perf_counter() - t0
    except httpx.TimeoutException:
        return f"> {timeout:g} s (no answer)", time.perf_counter() - t0
    except httpx.HTTPError as exc:
        return type(exc).__name__, time.perf_counter() - t0


def empty_maps_msgpack(nbytes: int) -> bytes:
    head = msgpack.packb({"version": 1, "seq_len": 64, "tokens": b"", "offsets": b""})
    return bytes([head[0] + 1]) + head[1:] + b"\xa1x\xdd" + nbytes.to_bytes(4, "big") + b"\x80" * nbytes


def empty_objects_json(nbytes: int) -> bytes:
    return b'{"version":1,"seq_len":64,"tokens":"","offsets":"","x":[' + b"{}," * (nbytes // 3 - 1) + b"{}]}"


def bench_memory(pythonpath: str | None, mib: list[int], timeout: float) -> list[dict[str, Any]]:
    out = []
    for fmt, make in (("msgpack", empty_maps_msgpack), ("json", empty_objects_json)):
        for m in mib:
            body = make(m << 20)
            server = Server(
                pythonpath,
                "--max-body-bytes",
                str(max(m, 1) * 2 << 20),
                "--intake-budget-bytes",
                str(4 * m << 20),
                "--malloc-keep-mb",
                "0",
                "--request-timeout-s",
                str(int(timeout)),
                "--body-timeout-s",
                "600",
            )
            try:
                _post(server.url + "/v1/pack", _small_pack(), MP, 60)
                base = server.hwm()
                status, took = _post(server.url + "/v1/pack", body, {"content-type": f"application/{fmt}"}, timeout)
                grew = server.hwm() - base
            finally:
                server.stop()
            row = {
                "case": f"{fmt} empty containers",
                "mib": m,
                "status": status,
                "seconds": round(took, 2),
                "peak_gain_mib": round(grew / 2**20, 1),
                "x_body": round(grew / len(body), 2),
            }
            print(json.dumps(row), flush=True)
            out.append(row)
    return out


def bench_whatif(pythonpath: str | None, timeout: float) -> dict[str, Any]:
    run = 64 << 20
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
    server = Server(pythonpath, "--request-timeout-s", str(int(timeout) + 60))
    try:
        status, took = _post(server.url + "/v1/whatif", body, MP, timeout)
    finally:
        server.stop()
    row = {"case": "tiny what-if", "body_bytes": len(body), "status": status, "seconds": round(took, 3)}
    print(json.dumps(row), flush=True)
    return row


def _stall(url: str, nbytes: int) -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    s = socket.create_connection((host, int(port)), timeout=30)
    s.sendall(
        (
            "POST /v1/pack HTTP/1.1\r\nHost: t\r\nContent-Type: application/msgpack\r\n"
            f"Content-Length: {nbytes}\r\n\r\n"
        ).encode()
    )
    return s


def bench_stalled(pythonpath: str | None, repeats: int) -> dict[str, Any]:
    server = Server(pythonpath)
    small = _small_pack()
    try:
        _post(server.url + "/v1/pack", small, MP, 60)
        stalled = [_stall(server.url, 256 << 20) for _ in range(2)]
        time.sleep(0.5)
        results = [_post(server.url + "/v1/pack", small, MP, 30) for _ in range(repeats)]
        for s in stalled:
            s.close()
    finally:
        server.stop()
    lat = [t for _, t in results]
    row = {
        "case": "small pack beside two stalled 256 MiB uploads",
        "statuses": sorted({s for s, _ in results}),
        "median_s": round(statistics.median(lat), 3),
        "min_s": round(min(lat), 3),
        "max_s": round(max(lat), 3),
        "repeats": repeats,
    }
    print(json.dumps(row), flush=True)
    return row


def bench_flood(pythonpath: str | None, idle: int, repeats: int) -> dict[str, Any]:
    server = Server(pythonpath, "--header-timeout-s", "60")
    socks = []
    try:
        host, port = server.url.removeprefix("http://").split(":")
        for _ in range(idle):
            socks.append(socket.create_connection((host, int(port)), timeout=30))
        time.sleep(0.5)
        res = {}
        for path in ("/healthz", "/readyz"):
            got = []
            for _ in range(repeats):
                t0 = time.perf_counter()
                r = httpx.get(server.url + path, timeout=30)
                got.append((r.status_code, time.perf_counter() - t0))
            res[path] = {
                "statuses": sorted({s for s, _ in got}),
                "median_s": round(statistics.median(t for _, t in got), 4),
            }
    finally:
        for s in socks:
            s.close()
        server.stop()
    row = {"case": f"probes beside {idle} idle connections", **res}
    print(json.dumps(row), flush=True)
    return row


def bench_digest(repeats: int) -> list[dict[str, Any]]:
    from treepack.proto.batch import PackInput
    from treepack.proto.batch_wire import encode_pack_body
    from treepack.service.cli.workloads import curriculum
    from treepack.service.planner import plan_batch

    out = []
    for groups, seq_len in ((3, 32768), (30, 32768)):  # about 100k and 1M tokens
        w = curriculum(groups, seed=0, seq_len=seq_len)
        body = encode_pack_body(PackInput.of(**w.plan_kwargs(), tags=w.tags))
        tokens = sum(len(s) for s in w.sequences)
        digest, plan = [], []
        for _ in range(repeats):
            t0 = time.perf_counter()
            h = hashlib.sha256()
            view = memoryview(body)
            for i in range(0, len(body), 1 << 16):  # as read_body does: chunk by chunk
                h.update(view[i : i + (1 << 16)])
            h.digest()
            digest.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            plan_batch(**w.plan_kwargs())
            plan.append(time.perf_counter() - t0)
        row = {
            "case": "sha256 of the body vs planning",
            "tokens": tokens,
            "body_mib": round(len(body) / 2**20, 2),
            "digest_ms_median": round(1e3 * statistics.median(digest), 2),
            "digest_ms_range": [round(1e3 * min(digest), 2), round(1e3 * max(digest), 2)],
            "plan_ms_median": round(1e3 * statistics.median(plan), 1),
            "plan_ms_range": [round(1e3 * min(plan), 1), round(1e3 * max(plan), 1)],
            "digest_over_plan": round(statistics.median(digest) / statistics.median(plan), 4),
        }
        print(json.dumps(row), flush=True)
        out.append(row)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", choices=["memory", "whatif", "stalled", "flood", "digest", "attacks"], action="append")
    ap.add_argument("--mib", type=int, action="append", help="adversarial body sizes in MiB (default 16 and 64)")
    ap.add_argument(
        "--timeout", type=float, default=120.0, help="cap of one request's answer time (reported as '> N s')"
    )
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--pythonpath", default=None, help="run the server from this build (prepended to PYTHONPATH)")
    ap.add_argument("--json", default=None, help="also write the results here")
    args = ap.parse_args()
    only = set(args.only or ["memory", "whatif", "stalled", "flood", "digest"])
    print(
        json.dumps(
            {
                "machine": platform.platform(),
                "cpus": os.cpu_count(),
                "python": platform.python_version(),
                "date": time.strftime("%Y-%m-%d %H:%M %Z"),
                "server_build": args.pythonpath or "this checkout",
            }
        ),
        flush=True,
    )
    results: dict[str, Any] = {}
    if "memory" in only:
        results["memory"] = bench_memory(args.pythonpath, args.mib or [16, 64], args.timeout)
    if "whatif" in only:
        results["whatif"] = bench_whatif(args.pythonpath, args.timeout)
    if "stalled" in only:
        results["stalled"] = bench_stalled(args.pythonpath, args.repeats)
    if "flood" in only:
        results["flood"] = bench_flood(args.pythonpath, 300, args.repeats)
    if "digest" in only:
        results["digest"] = bench_digest(args.repeats)
    if "attacks" in only:
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        from hardening_attacks import run_attacks

        results["attacks"] = run_attacks(args.pythonpath, args.timeout)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
