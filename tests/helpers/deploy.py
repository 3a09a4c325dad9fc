"""The deployment files parsed (Dockerfile, docker-compose, the Kubernetes pod) and the app's paths.

Not a test module; imported by tests/service/test_deploy.py (the files against the code)
and tests/e2e/test_deploy_probes.py (their probe commands against a live server).
"""

from __future__ import annotations

import re
from typing import Any

import yaml

from helpers.service import REPO


def served_paths() -> set[str]:
    """Every path the app serves: its operations (the OpenAPI document) and the docs pages."""
    from treepack.service import Settings, create_app

    app = create_app(Settings(history_enabled=False))
    try:
        return set(app.openapi()["paths"]) | {app.openapi_url, app.docs_url}
    finally:
        app.state.service.close()


def probe_url(cmd: list[str]) -> str:
    """The path a probe command requests from 127.0.0.1."""
    text = " ".join(cmd)
    m = re.search(r"http://127\.0\.0\.1:(?:'\s*\+[^+]*\+\s*')?(\d*)(/\w+)", text)
    assert m, f"no URL in {text}"
    return m.group(2)


def dockerfile() -> list[tuple[str, str]]:
    """deploy/Dockerfile as (INSTRUCTION, arguments), continuation lines joined, comments dropped."""
    text = (REPO / "deploy" / "Dockerfile").read_text()
    lines = [ln for ln in re.sub(r"\\\n", " ", text).splitlines() if ln.strip() and not ln.lstrip().startswith("#")]
    return [(ln.split(None, 1)[0].upper(), ln.split(None, 1)[1] if " " in ln.strip() else "") for ln in lines]


def compose() -> dict[str, Any]:
    return yaml.safe_load((REPO / "docker-compose.yml").read_text())


def pod() -> dict[str, Any]:
    """The pod spec of the Kubernetes Job (trainer + treepack sidecar)."""
    docs = list(yaml.safe_load_all((REPO / "deploy" / "k8s" / "trainer-with-treepack.yaml").read_text()))
    job = next(d for d in docs if d and d["kind"] == "Job")
    return job["spec"]["template"]["spec"]


def container_env(container: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value") for e in container.get("env", [])}


def probe_commands() -> list[tuple[str, list[str]]]:
    """(where, command) of every health probe: compose, the three pod probes, the Dockerfile's."""
    cmds = [("compose", compose()["services"]["treepack"]["healthcheck"]["test"][1:])]
    side = next(c for c in pod()["initContainers"] if c["name"] == "treepack")
    cmds += [(p, side[p]["exec"]["command"]) for p in ("startupProbe", "readinessProbe", "livenessProbe")]
    hc = [v for k, v in dockerfile() if k == "HEALTHCHECK"][-1]
    cmds.append(("dockerfile", yaml.safe_load(hc[hc.index("CMD") + 3 :])))
    return cmds
