"""Service benchmark: concurrent load, and the HTTP round trip against the embedded planner.

Loopback only: the script starts ``python -m treepack.service`` on 127.0.0.1 (a free port,
history in a temporary folder) and stops it at the end. Bounded in count and time.

1. **Load**: ``--clients`` threads (default 16), each sending ``--requests`` packs
   (default 200) through its own ``Packer(url)``, cycling over realistic batches (multi-task
   GRPO curriculum, agent rollouts, distillation; ``--load-groups`` sets their size).
   Reports throughput, client-observed p50/p99 latency (encode + HTTP + plan + decode),
   the server-side p50/p99 from its Prometheus histogram, errors, and the server's RSS
   before and after. Stops issuing requests after ``--max-seconds`` (reported).
2. **Round trip**: one client, ``Packer(url).pack`` (msgpack, record=False) against
   ``Packer().pack`` (embedded, the same planner in-process) at about 100k, 1M and 10M
   tokens; median of ``--repeats``, interleaved. The embedded figure is the baseline of
   the ratio. Two more columns explain the gap: the *transport floor* (the same body
   POSTed with a wrong wire version, refused right after it is read and unpacked) and
   the server's planner time. A second table splits the round trip: the client's
   encoding, HTTP request and plan decoding (timed in this process) and the server's
   request, decoding, planning and encoding (means from its Prometheus histograms).

Usage::

    python benchmarks/service_load.py                       # the full run (a few minutes on 2 cores)
    python benchmarks/service_load.py --clients 4 --requests 20 --sizes 100000   # smoke
"""

from __future__ import annotations

import argparse
import os
import platform
import re
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import msgpack
import numpy as np

from treepack.client import Packer
from treepack.proto.batch import PackInput
from treepack.proto.batch_wire import encode_pack_request
from treepack.proto.codec import encode_body
from treepack.service.cli.workloads import agentic, curriculum, distillation


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return -1


class Server:
    """``python -m treepack.service`` on 127.0.0.1, ready when /readyz answers."""

    def __init__(self, *flags: str) -> None:
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.tmp = tempfile.TemporaryDirectory()
        env = {k: v for k, v in os.environ.items() if not k.startswith("TREEPACK_")}
        cmd = [
            sys.executable,
            "-m",
            "treepack.service",
            "--port",
            str(self.port),
            "--log-level",
            "warning",
            "--history-path",
            str(Path(self.tmp.name) / "history.sqlite3"),
            *flags,
        ]
        self.proc = subprocess.Popen(cmd, env=env)
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(self.url + "/readyz", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("the server did not start")
            time.sleep(0.1)

    def rss(self) -> int:
        return _rss(self.proc.pid)

    def metrics(self) -> str:
        return httpx.get(self.url + "/metrics", timeout=30).text

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.tmp.cleanup()


def _load_batches(groups: int, seq_len: int) -> list[dict[str, Any]]:
    out = []
    for seed in range(3):
        for w in (
            curriculum(groups, seed=seed, seq_len=seq_len),
            agentic(max(1, groups // 2), seed=seed, seq_len=seq_len),
            distillation(max(1, groups // 2), seed=seed, seq_len=seq_len),
        ):
            out.append(dict(**w.plan_kwargs(), tags=w.tags))
    return out


def _histogram_quantile(metrics: str, name: str, route: str, q: float) -> float:
    """Upper bucket bound holding the q-quantile of a Prometheus histogram (seconds)."""
    pat = re.compile(rf'^{name}_bucket\{{le="([^"]+)",route="{re.escape(route)}"\}} (\S+)$', re.M)
    buckets = [(float("inf") if le == "+Inf" else float(le), float(v)) for le, v in pat.findall(metrics)]
    total = buckets[-1][1] if buckets else 0
    for le, cum in buckets:
        if cum >= q * total:
            return le
    return float("nan")


def run_load(clients: int, requests: int, groups: int, seq_len: int, max_seconds: float) -> dict[str, Any]:
    batches = _load_batches(groups, seq_len)
    tokens = [sum(len(s) for s in b["sequences"]) for b in batches]
    server = Server("--max-concurrent-plans", "2", "--max-queue", str(clients * 2))
    try:
        with Packer(server.url) as p:  # warm up: imports, first allocations
            for b in batches:
                p.pack(**b, record=False)
        rss_before = server.rss()
        lat: list[float] = []
        errors: list[str] = []
        sent_tokens = [0]
        lock = threading.Lock()
        deadline = time.monotonic() + max_seconds

        def client(ci: int) -> None:
            with Packer(server.url, timeout=120) as p:
                for i in range(requests):
                    if time.monotonic() > deadline:
                        return
                    k = (ci * 7 + i) % len(batches)
                    t0 = time.perf_counter()
                    try:
                        plan = p.pack(**batches[k])
                        ok = plan.num_rows >= 1
                    except Exception as exc:  # counted, the run goes on
                        with lock:
                            errors.append(type(exc).__name__)
                        continue
                    dt = time.perf_counter() - t0
                    with lock:
                        lat.append(dt)
                        sent_tokens[0] += tokens[k]
                        if not ok:
                            errors.append("empty plan")

        t0 = time.perf_counter()
        threads = [threading.Thread(target=client, args=(c,)) for c in range(clients)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        wall = time.perf_counter() - t0
        metrics = server.metrics()
        rss_after = server.rss()
        recorded = re.search(r"^treepack_history_recorded_total (\S+)$", metrics, re.M)
        skipped = re.search(r"^treepack_history_skipped_total (\S+)$", metrics, re.M)
        return dict(
            clients=clients,
            requests_per_client=requests,
            done=len(lat),
            planned=clients * requests,
            errors=len(errors),
            error_kinds=sorted(set(errors)),
            wall_s=wall,
            throughput=len(lat) / wall,
            tokens_per_s=sent_tokens[0] / wall,
            mean_tokens=float(np.mean(tokens)),
            p50_ms=1e3 * float(np.percentile(lat, 50)) if lat else float("nan"),
            p99_ms=1e3 * float(np.percentile(lat, 99)) if lat else float("nan"),
            server_p50_le_ms=1e3 * _histogram_quantile(metrics, "treepack_request_seconds", "/v1/pack", 0.5),
            server_p99_le_ms=1e3 * _histogram_quantile(metrics, "treepack_request_seconds", "/v1/pack", 0.99),
            rss_before_mb=rss_before / 2**20,
            rss_after_mb=rss_after / 2**20,
            recorded=float(recorded.group(1)) if recorded else 0.0,
            skipped=float(skipped.group(1)) if skipped else 0.0,
            timed_out=time.monotonic() > deadline,
        )
    finally:
        server.stop()


def _batch_of(tokens: int) -> dict[str, Any]:
    # The curriculum workload averages ~32.6k tokens per group at C = 131072.
    w = curriculum(max(1, round(tokens / 32_600)), seed=11)
    return dict(**w.plan_kwargs(), tags=w.tags)


def _floor_ms(url: str, body: bytes, repeats: int) -> float:
    """The same bytes POSTed but refused right after the body is read and unpacked
    (wrong wire version): what the transport alone costs."""
    msg = msgpack.unpackb(body, raw=False)
    msg["version"] = 0
    bad = msgpack.packb(msg, use_bin_type=True)
    times = []
    with httpx.Client(base_url=url, timeout=600) as c:
        for _ in range(repeats):
            t0 = time.perf_counter()
            r = c.post("/v1/pack", content=bad, headers={"content-type": "application/msgpack"})
            times.append(time.perf_counter() - t0)
            assert r.status_code == 422
    return 1e3 * statistics.median(times)


def _sums(metrics: str) -> dict[str, tuple[float, float]]:
    """(sum s, count) of the server's per-pack histograms, for means over a window."""
    out = {}
    for key, series in (
        ("request", 'treepack_request_seconds_{}{{route="/v1/pack"}}'),
        ("plan", "treepack_plan_seconds_{}"),
        ("decode", 'treepack_pack_phase_seconds_{}{{phase="decode"}}'),
        ("encode", 'treepack_pack_phase_seconds_{}{{phase="encode"}}'),
    ):
        vals = []
        for part in ("sum", "count"):
            m = re.search(rf"^{re.escape(series.format(part))} (\S+)$", metrics, re.M)
            vals.append(float(m.group(1)) if m else 0.0)
        out[key] = (vals[0], vals[1])
    return out


def _breakdown(server: Server, remote: Packer, b: dict[str, Any], repeats: int) -> dict[str, float]:
    """Where an HTTP round trip's time goes: the client's steps timed here (medians), the
    server's from its histograms (means over the same requests)."""
    from treepack.client.http import decode_pack, pack_body

    backend = remote._b
    enc, req, dec = [], [], []
    before = _sums(server.metrics())
    for _ in range(repeats):
        t0 = time.perf_counter()
        # As Packer(url).pack builds it (a large body as chunks, written while it is sent).
        body = pack_body(PackInput.of(**b, record=False), "msgpack", chunked=True, dedup=True)
        t1 = time.perf_counter()
        resp = backend.request("POST", "/v1/pack", body)
        t2 = time.perf_counter()
        decode_pack(resp)
        t3 = time.perf_counter()
        enc.append(t1 - t0)
        req.append(t2 - t1)
        dec.append(t3 - t2)
    after = _sums(server.metrics())
    mean = {k: 1e3 * (after[k][0] - before[k][0]) / max(after[k][1] - before[k][1], 1) for k in after}
    return dict(
        client_encode_ms=1e3 * statistics.median(enc),
        client_request_ms=1e3 * statistics.median(req),
        client_decode_ms=1e3 * statistics.median(dec),
        server_request_ms=mean["request"],
        server_decode_ms=mean["decode"],
        server_plan_ms=mean["plan"],
        server_encode_ms=mean["encode"],
    )


def run_roundtrip(sizes: list[int], repeats: int) -> list[dict[str, Any]]:
    server = Server("--max-body-bytes", str(1 << 30), "--max-tokens", str(1 << 28))
    rows = []
    try:
        with Packer(server.url, timeout=600) as remote, Packer(server.url, timeout=600, dedup=False) as plain:
            embedded = Packer()
            for size in sizes:
                b = _batch_of(size)
                n = sum(len(s) for s in b["sequences"])
                body = encode_body(encode_pack_request(PackInput.of(**b, record=False)), "msgpack")
                remote.pack(**b, record=False)  # warm up both paths
                embedded.pack(**b)
                emb, http, http_plain, planner = [], [], [], []
                for _ in range(repeats):  # interleaved, so both see the same machine load
                    t0 = time.perf_counter()
                    plan_e = embedded.pack(**b)
                    emb.append(time.perf_counter() - t0)
                    t0 = time.perf_counter()
                    plan_h = remote.pack(**b, record=False)
                    http.append(time.perf_counter() - t0)
                    planner.append(plan_h.stats.timings_ms["total"])
                    t0 = time.perf_counter()
                    plain.pack(**b, record=False)
                    http_plain.append(time.perf_counter() - t0)
                assert plan_e.num_rows == plan_h.num_rows
                e, h = statistics.median(emb), statistics.median(http)
                rows.append(
                    dict(
                        tokens=n,
                        sequences=len(b["sequences"]),
                        plain_mb=4 * n / 1e6,
                        body_mb=len(body) / 1e6,
                        embedded_ms=1e3 * e,
                        http_ms=1e3 * h,
                        ratio=h / e,
                        http_plain_ms=1e3 * statistics.median(http_plain),
                        floor_ms=_floor_ms(server.url, body, repeats),
                        server_plan_ms=statistics.median(planner),
                        breakdown=_breakdown(server, remote, b, repeats),
                    )
                )
    finally:
        server.stop()
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--requests", type=int, default=200, help="per client")
    ap.add_argument(
        "--load-groups", type=int, default=16, help="groups per curriculum load batch (agentic/distillation: half)"
    )
    ap.add_argument("--load-seq-len", type=int, default=32768)
    ap.add_argument("--max-seconds", type=float, default=600.0, help="stop issuing load requests after this")
    ap.add_argument("--sizes", default="100000,1000000,10000000", help="round-trip batch sizes in tokens")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--skip-load", action="store_true")
    args = ap.parse_args(argv)

    print(f"machine: {platform.platform()}, {os.cpu_count()} CPUs, Python {platform.python_version()}")
    if not args.skip_load:
        r = run_load(args.clients, args.requests, args.load_groups, args.load_seq_len, args.max_seconds)
        print(
            f"\nload: {r['clients']} clients x {r['requests_per_client']} packs, "
            f"batches of {r['mean_tokens']:,.0f} tokens on average"
        )
        print(
            "| requests | errors | wall s | req/s | Mtokens/s | p50 ms | p99 ms | server p50 <= ms | "
            "server p99 <= ms | RSS before MB | RSS after MB | shapes recorded / skipped |"
        )
        print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
        print(
            f"| {r['done']}/{r['planned']} | {r['errors']} {r['error_kinds'] or ''} | "
            f"{r['wall_s']:.1f} | {r['throughput']:.1f} | "
            f"{r['tokens_per_s'] / 1e6:.2f} | {r['p50_ms']:.1f} | {r['p99_ms']:.1f} | "
            f"{r['server_p50_le_ms']:g} | {r['server_p99_le_ms']:g} | "
            f"{r['rss_before_mb']:.0f} | {r['rss_after_mb']:.0f} | {r['recorded']:.0f} / {r['skipped']:.0f} |"
        )
        if r["timed_out"]:
            print(f"(stopped after --max-seconds {args.max_seconds:g})")
    sizes = [int(s) for s in args.sizes.split(",") if s]
    if sizes:
        print(f"\nround trip (msgpack over loopback vs embedded; median of {args.repeats}):")
        print(
            "| tokens | sequences | tokens MB | body sent MB | embedded ms | HTTP ms | HTTP / embedded | "
            "transport floor ms | server planner ms | HTTP ms, no dedup |"
        )
        print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
        rows = run_roundtrip(sizes, args.repeats)
        for row in rows:
            print(
                f"| {row['tokens']:,} | {row['sequences']:,} | {row['plain_mb']:.1f} | {row['body_mb']:.1f} | "
                f"{row['embedded_ms']:.1f} | {row['http_ms']:.1f} | {row['ratio']:.2f}x | {row['floor_ms']:.1f} | "
                f"{row['server_plan_ms']:.1f} | {row['http_plain_ms']:.1f} |"
            )
        print("\nwhere the HTTP time goes (client steps: medians; server: means from its histograms; same requests):")
        print(
            "| tokens | client encode ms | client request ms | server request ms | server decode ms | "
            "server planner ms | server encode ms | client decode ms |"
        )
        print("|---:|---:|---:|---:|---:|---:|---:|---:|")
        for row in rows:
            d = row["breakdown"]
            print(
                f"| {row['tokens']:,} | {d['client_encode_ms']:.2f} | {d['client_request_ms']:.2f} | "
                f"{d['server_request_ms']:.2f} | {d['server_decode_ms']:.2f} | {d['server_plan_ms']:.2f} | "
                f"{d['server_encode_ms']:.2f} | {d['client_decode_ms']:.2f} |"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
