"""The deployment files' health probes, run for real against a live server (Docker and Kubernetes cannot run here)."""

from __future__ import annotations

import shlex
import subprocess
import sys

from helpers.deploy import probe_commands
from helpers.service import running_server


def test_probe_commands_work_against_a_live_server():
    with running_server() as (url, proc):
        port = url.rsplit(":", 1)[1]
        for name, cmd in probe_commands():
            assert cmd[0] == "python"
            run = [sys.executable, *[c.replace("8000", port) for c in cmd[1:]]]
            r = subprocess.run(run, capture_output=True, timeout=30, env={"TREEPACK_PORT": port})
            assert r.returncode == 0, (name, shlex.join(run), r.stderr)
    # Negative control: the same probes fail when nothing listens.
    name, cmd = probe_commands()[0]
    r = subprocess.run([sys.executable, *[c.replace("8000", port) for c in cmd[1:]]], capture_output=True, timeout=30)
    assert r.returncode != 0
