"""Deployment files: parsed and checked against the code (routes, settings, ports, packages).

Docker and Kubernetes cannot run here; the probe and healthcheck commands are run for real
against a live server instead (tests/e2e/test_deploy_probes.py).
"""

from __future__ import annotations

import argparse
import re
from pathlib import PurePosixPath

import pytest
import tomllib
import yaml

from treepack.service.serve import add_serve_arguments
from treepack.service.settings import Settings

from helpers.deploy import compose, container_env, dockerfile, pod, probe_commands, probe_url, served_paths
from helpers.service import REPO

ROUTES = served_paths()
SETTINGS = set(Settings.model_fields)


def _env_names_are_settings(names):
    for n in names:
        if n.startswith("TREEPACK_") and n not in ("TREEPACK_URL",):
            assert n[len("TREEPACK_") :].lower() in SETTINGS, f"{n} is not a setting"


def test_dockerfile():
    instr = dockerfile()
    kinds = [k for k, _ in instr]
    assert kinds.count("FROM") == 2 and all("python:3.11" in v for k, v in instr if k == "FROM")
    user = [v for k, v in instr if k == "USER"][-1]
    assert user not in ("root", "0")
    assert [v for k, v in instr if k == "EXPOSE"] == ["8000"]
    copied = {v.split()[0] for k, v in instr if k == "COPY" and "--from" not in v}
    pkg_dirs = set(tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"].values())
    top = {str(PurePosixPath(d).parts[0]) for d in pkg_dirs}
    assert top <= copied, f"the image misses {top - copied}"
    assert any(".[service]" in v for k, v in instr if k == "RUN")
    entry = [v for k, v in instr if k == "ENTRYPOINT"][-1]
    assert entry == '["python", "-m", "treepack.service"]'
    env = " ".join(v for k, v in instr if k == "ENV")
    names = re.findall(r"(TREEPACK_\w+)=", env)
    assert {"TREEPACK_HOST", "TREEPACK_HISTORY_PATH"} <= set(names)
    _env_names_are_settings(names)
    hist = re.search(r"TREEPACK_HISTORY_PATH=(\S+)", env).group(1)
    vol = [v for k, v in instr if k == "VOLUME"][-1]
    assert str(PurePosixPath(hist).parent) in vol
    hc = [v for k, v in instr if k == "HEALTHCHECK"][-1]
    assert probe_url([hc]) in ROUTES


def test_compose():
    doc = compose()
    svc = doc["services"]["treepack"]
    assert (REPO / svc["build"]["dockerfile"]).exists() and svc["build"]["context"] == "."
    for p in svc["ports"]:
        assert p.startswith("127.0.0.1:"), f"port {p} is not bound to the loopback"
    env = svc["environment"]
    _env_names_are_settings(env)
    host_port, container_port = svc["ports"][0].split(":")[1:]
    assert container_port == env["TREEPACK_PORT"]
    vol_name, mount = svc["volumes"][0].split(":")[:2]
    assert vol_name in doc["volumes"]
    assert str(PurePosixPath(env["TREEPACK_HISTORY_PATH"]).parent) == mount
    assert probe_url(svc["healthcheck"]["test"]) in ROUTES
    prom = doc["services"]["prometheus"]
    assert all(p.startswith("127.0.0.1:") for p in prom["ports"])
    cfg_path = prom["volumes"][0].split(":")[0]
    cfg = yaml.safe_load((REPO / cfg_path).read_text())
    job = cfg["scrape_configs"][0]
    assert job["metrics_path"] in ROUTES
    assert job["static_configs"][0]["targets"] == [f"treepack:{container_port}"]
    # Monitoring starts whatever treepack's health: a damaged history must be visible in it.
    assert prom["depends_on"]["treepack"]["condition"] == "service_started"


def test_k8s_sidecar():
    spec = pod()
    (side,) = [c for c in spec["initContainers"] if c["name"] == "treepack"]
    (trainer,) = spec["containers"]
    assert side["restartPolicy"] == "Always"  # a native sidecar: up before the trainer, down after it
    env = container_env(side)
    _env_names_are_settings(env)
    assert env["TREEPACK_HOST"] == "127.0.0.1"
    port = env["TREEPACK_PORT"]
    assert container_env(trainer)["TREEPACK_URL"] == f"http://127.0.0.1:{port}"
    for probe, route in (("startupProbe", "/healthz"), ("readinessProbe", "/readyz"), ("livenessProbe", "/healthz")):
        cmd = side[probe]["exec"]["command"]
        assert "os.environ.get('TREEPACK_PORT'" in " ".join(cmd) and probe_url(cmd) == route and route in ROUTES
    for c in (side, trainer):
        assert c["resources"]["requests"] and c["resources"]["limits"]["memory"]
    mounts = {m["name"]: m["mountPath"] for m in side["volumeMounts"]}
    assert str(PurePosixPath(env["TREEPACK_HISTORY_PATH"]).parent) == mounts["treepack-history"]
    assert {v["name"] for v in spec["volumes"]} >= set(mounts)
    assert side["securityContext"]["runAsNonRoot"] is True
    # The args are serve flags the image's entrypoint understands.
    p = argparse.ArgumentParser()
    add_serve_arguments(p)
    p.parse_args(side["args"])


def test_the_probes_agree():
    """One liveness command everywhere (image, compose, pod startup and liveness); readiness
    is the same command on /readyz, and only Kubernetes asks it (a damaged history turns
    /readyz to 503 while packs are still served: no reason to restart or to hold back)."""
    probes = dict(probe_commands())
    alive = probes["dockerfile"]
    assert probe_url(alive) == "/healthz"
    for where in ("compose", "startupProbe", "livenessProbe"):
        assert probes[where] == alive, where
    assert probes["readinessProbe"] == [c.replace("/healthz", "/readyz") for c in alive]


def test_dockerignore_keeps_the_build_context_small():
    ignored = {
        ln.strip() for ln in (REPO / ".dockerignore").read_text().splitlines() if ln.strip() and not ln.startswith("#")
    }
    assert {".git", ".venv*", "tests", "**/__pycache__"} <= ignored
    copied = {v.split()[0] for k, v in dockerfile() if k == "COPY" and "--from" not in v}
    assert not any(c.rstrip("/") in ignored for c in copied)  # nothing the image copies is ignored


def test_packer_from_env(monkeypatch):
    from treepack.client import Packer

    monkeypatch.delenv("TREEPACK_URL", raising=False)
    assert Packer.from_env().health()["backend"] == "embedded"
    monkeypatch.setenv("TREEPACK_URL", "http://127.0.0.1:9")
    p = Packer.from_env(retries=0)
    assert p.url == "http://127.0.0.1:9"
    p.close()


@pytest.mark.parametrize(
    "path",
    [
        ".dockerignore",
        "deploy/Dockerfile",
        "docker-compose.yml",
        "deploy/k8s/trainer-with-treepack.yaml",
        "deploy/prometheus.yml",
    ],
)
def test_files_exist(path):
    assert (REPO / path).is_file()


def _docker_ignores(pattern: str, path: str) -> bool:
    """Docker's .dockerignore match of one pattern (Go filepath.Match per segment, ``**`` any folders)."""
    rx = "".join(
        "(?:.*/)?" if part == "**/" else "[^/]*" if part == "*" else "[^/]" if part == "?" else re.escape(part)
        for part in re.split(r"(\*\*/|\*|\?)", pattern.strip("/"))
    )
    return re.fullmatch(rx, path) is not None or path.startswith(pattern.rstrip("/") + "/")


def test_dockerignore_leaves_wheels_out_wherever_they_are():
    patterns = [
        ln.strip() for ln in (REPO / ".dockerignore").read_text().splitlines() if ln.strip() and not ln.startswith("#")
    ]
    for wheel in ("treepack-0.1.0-py3-none-any.whl", "proto/stray-1.0-py3-none-any.whl"):
        assert any(_docker_ignores(p, wheel) for p in patterns), wheel
    assert not any(_docker_ignores(p, "proto/plan.py") for p in patterns)  # negative control: sources go in
    assert _docker_ignores(".whl", ".whl") and not _docker_ignores(".whl", "x.whl")  # what the old line did


def test_the_k8s_placeholder_images_are_explained_with_how_to_build_and_push():
    manifest = (REPO / "deploy" / "k8s" / "trainer-with-treepack.yaml").read_text()
    doc = (REPO / "docs" / "service.md").read_text()
    images = re.findall(r"^\s*image:\s*(\S+)", manifest, re.M)
    assert len(images) == 2 and all(img in doc for img in images), images
    assert "docker push <registry>/treepack:0.1.0" in doc and "docker push <registry>/treepack:0.1.0" in manifest
