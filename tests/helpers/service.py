"""Helpers shared by the service, client and wire tests: batches, bodies, a real server.

Not a test module (no ``test_`` prefix); imported by them.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from treepack.proto.batch import PackInput
from treepack.proto.batch_wire import encode_pack_request
from treepack.proto.codec import encode_body
from treepack.proto.plan import Plan
from treepack.proto.plan_wire import plan_differences
from treepack.service.planner import validate_plan

REPO = Path(__file__).resolve().parents[2]


def small_batch(seed: int = 0) -> dict[str, Any]:
    """Six sequences in two groups sharing a 100-token system prompt; prompt lengths as trainable."""
    rng = np.random.default_rng(seed)
    system = rng.integers(0, 50_000, 100, dtype=np.uint32)
    seqs, trainable, groups, tags = [], [], [], []
    for g in range(2):
        prompt = np.concatenate([system, rng.integers(0, 50_000, 80, dtype=np.uint32)])
        for _ in range(3):
            seqs.append(np.concatenate([prompt, rng.integers(0, 50_000, int(rng.integers(10, 60)), dtype=np.uint32)]))
            trainable.append(prompt.shape[0])
            groups.append(f"g{g}")
            tags.append("math" if g == 0 else "code")
    return dict(sequences=seqs, trainable=trainable, groups=groups, seq_len=512, tags=tags)


def plan_kwargs(batch: dict[str, Any]) -> dict[str, Any]:
    """The ``plan_batch`` arguments of a :func:`small_batch` (without ``tags``)."""
    return {k: v for k, v in batch.items() if k != "tags"}


def pack_body(batch: dict[str, Any], fmt: str = "msgpack", *, dedup: bool = True, **overrides: Any) -> bytes:
    msg = encode_pack_request(PackInput.of(**batch), fmt=fmt, dedup=dedup)
    msg.update(overrides)
    return encode_body(msg, fmt)


def pack_message(batch: dict[str, Any], fmt: str = "msgpack", *, dedup: bool = False) -> dict[str, Any]:
    """The request as a dict; plain columns (no prefix references) unless ``dedup``."""
    return encode_pack_request(PackInput.of(**batch), fmt=fmt, dedup=dedup)


def assert_same_plan(a: Plan, b: Plan) -> None:
    """Equal array-for-array (dtypes too), both valid."""
    diff = plan_differences(a, b)
    assert diff == [], "\n".join(diff)
    validate_plan(a)
    validate_plan(b)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def running_server(
    *flags: str, env: dict[str, str] | None = None, startup_s: float = 60.0, ready_status: int = 200
) -> Iterator[tuple[str, subprocess.Popen]]:
    """Start ``python -m treepack.service`` on 127.0.0.1 (a free port) and wait for /readyz
    to answer ``ready_status`` (503: a server started with a damaged history).

    Yields:
        (base URL, the process). The process is terminated (SIGTERM, then SIGKILL) on exit.
    """
    port = free_port()
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("TREEPACK_")}
    full_env.update(env or {})
    cmd = [
        sys.executable,
        "-m",
        "treepack.service",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--log-level",
        "warning",
        *flags,
    ]
    proc = subprocess.Popen(cmd, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + startup_s
        while True:
            if proc.poll() is not None:
                out = proc.stdout.read().decode(errors="replace") if proc.stdout else ""
                raise RuntimeError(f"server exited with {proc.returncode}:\n{out}")
            try:
                if httpx.get(url + "/readyz", timeout=1.0).status_code == ready_status:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError("server did not become ready")
            time.sleep(0.1)
        yield url, proc
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if proc.stdout:
            proc.stdout.close()


def rss_bytes(pid: int) -> int:
    """Resident set size of a process (Linux /proc)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS")


async def asgi_request(app: Any, path: str, headers: dict[str, str], receive: Any) -> tuple[int, dict[str, str], bytes]:
    """Run one POST through the raw ASGI app with a ``receive`` the test controls; (status, headers, body)."""
    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "root_path": "",
        "headers": [(k.lower().encode(), v.encode()) for k, v in headers.items()],
        "client": ("127.0.0.1", 1),
        "server": ("127.0.0.1", 80),
    }
    out: dict = {"status": None, "headers": {}, "body": b""}

    async def send(message: dict) -> None:
        if message["type"] == "http.response.start":
            out["status"] = message["status"]
            out["headers"] = {k.decode(): v.decode() for k, v in message["headers"]}
        elif message["type"] == "http.response.body":
            out["body"] += message.get("body", b"")

    await app(scope, receive, send)
    return out["status"], out["headers"], out["body"]
