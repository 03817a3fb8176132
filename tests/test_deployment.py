"""docker-compose.yml, the Kubernetes manifests and the Dockerfile run what the local
launcher runs.

The compose file is checked by reading it: each role's command and environment must
equal :func:`shared.launcher.compose_plan` (the launcher's plan with container
addresses), and scaling must be possible. The Kubernetes manifests are rendered with
``kubectl kustomize`` and validated against the Kubernetes API schemas
(``kubernetes-validate``, offline)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from services.balancer.config import compose_config
from shared.launcher import (
    COMPOSE_SECRET_FILE,
    ROLE_MODULES,
    Topology,
    compose_plan,
    kubernetes_plan,
    plan,
)
from shared.service import GRACEFUL_SHUTDOWN_S
from shared.serving.worker import WorkerSettings

ROOT = Path(__file__).resolve().parents[1]


def compose() -> dict[str, Any]:
    data: dict[str, Any] = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    return data


def test_compose_runs_exactly_the_launcher_plan() -> None:
    services = compose()["services"]
    specs = {s.role: s for s in compose_plan()}
    assert set(services) == {"secret", "redis", "balancer", *ROLE_MODULES}
    for role, spec in specs.items():
        svc = services[role]
        assert svc["command"] == spec.command("python"), role
        assert {k: str(v) for k, v in svc["environment"].items()} == spec.env, role


def test_compose_needs_no_exported_secret() -> None:
    """`docker compose up` as typed: the one-shot secret service writes the secret (the
    user's if given, else one of its own) into a volume every role reads, read-only,
    and no role starts before it is there."""
    services = compose()["services"]
    secret = services["secret"]
    folder = COMPOSE_SECRET_FILE.rsplit("/", 1)[0]
    assert secret["command"] == ["baton", "secret", COMPOSE_SECRET_FILE]
    assert secret["environment"] == {"BATON_CLUSTER_SECRET": "${BATON_CLUSTER_SECRET:-}"}
    assert secret["volumes"] == [f"secret:{folder}"]
    assert secret["restart"] == "no"
    for role in ROLE_MODULES:
        svc = services[role]
        assert "BATON_CLUSTER_SECRET" not in svc["environment"], role
        assert svc["environment"]["BATON_CLUSTER_SECRET_FILE"] == COMPOSE_SECRET_FILE, role
        assert svc["volumes"] == [f"secret:{folder}:ro"], role
    # every role waits for it, directly or through the KV store it waits for
    assert services["kvstore"]["depends_on"]["secret"]["condition"] == (
        "service_completed_successfully"
    )
    assert services["gateway"]["depends_on"]["secret"]["condition"] == (
        "service_completed_successfully"
    )
    for role in ("prefill", "decode"):
        assert services[role]["depends_on"]["kvstore"]["condition"] == "service_healthy"
    assert "secret" in compose()["volumes"]


def test_compose_balancer_finds_every_gateway_replica() -> None:
    """One published port in front of `--scale gateway=N`: HAProxy from Debian's package
    with the configuration services/balancer renders for Docker's DNS."""
    services = compose()["services"]
    balancer = services["balancer"]
    assert balancer["image"] == "baton-balancer:latest"
    assert balancer["build"]["dockerfile"] == "balancer.Dockerfile"
    assert balancer["ports"] == ["${BATON_GATEWAY_PUBLISH:-8000}:8000"]
    assert (ROOT / "docker" / "haproxy.cfg").read_text() == compose_config()
    assert "COPY haproxy.cfg" in (ROOT / "docker" / "balancer.Dockerfile").read_text()
    assert "baton-balancer:latest" in (ROOT / "scripts" / "docker-build.sh").read_text()


def test_compose_scales_and_checks_health() -> None:
    services = compose()["services"]
    assert services["redis"]["image"] == "baton-redis:latest"  # built from Debian's package
    for name, svc in services.items():
        assert svc["pull_policy"] == "never", name  # built here, never pulled
    images = {services[r]["image"] for r in (*ROLE_MODULES, "secret")}
    assert images == {"baton:latest"}  # one image for every role
    for name, svc in services.items():
        if name != "secret":  # a one-shot: its completion is what others wait for
            assert "healthcheck" in svc, name
        assert "container_name" not in svc, name
        if name != "balancer":
            assert "ports" not in svc, name  # scaled replicas cannot share host ports
    for role in ("prefill", "decode"):
        env = services[role]["environment"]
        # no fixed address: each replica advertises its own container IP
        assert not any(k.endswith("ADVERTISE_HOST") for k in env)


def test_local_plan_differs_only_in_addresses() -> None:
    """The local launcher's plan for the same topology: same keys plus local addresses
    (Kubernetes), or the secret from a file instead of the environment (compose)."""
    local = {s.role: s for s in plan(Topology(redis_url="redis://127.0.0.1:1/0"))}
    for container, secret in ((kubernetes_plan(), set()), (compose_plan(), {"SECRET"})):
        for spec in container:
            mine = local[spec.role]
            extra = set(mine.env) - set(spec.env)
            assert extra <= {
                f"BATON_{spec.role.upper()}_ADVERTISE_HOST",
                "BATON_NUM_THREADS",
                *(f"BATON_CLUSTER_{s}" for s in secret),
            }, spec.role
            assert set(spec.env) - set(mine.env) <= {
                "UCX_TLS",  # TCP only between containers
                *(f"BATON_CLUSTER_{s}_FILE" for s in secret),
            }, spec.role
            assert mine.module == spec.module


def test_dockerfile_builds_one_image_with_the_model() -> None:
    """The build itself runs in tests/test_compose.py; here, what it must keep."""
    text = (ROOT / "Dockerfile").read_text()
    assert "ARG BASE_IMAGE=python:3.11-slim" in text  # a registry base by default
    assert "ARG BATON_TORCH=torch==2.13.0" in text
    assert 'pip install --index-url "$PIP_INDEX_URL" .' in text
    assert "baton model pull --prepare" in text  # pulled at build: containers start offline
    assert "--mount=type=secret,id=ca_bundle" in text  # the CA never lands in a layer
    assert 'ENTRYPOINT ["tini", "--"]' in text  # signals reach the service


def kustomized() -> list[dict[str, Any]]:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl is not installed: the Kubernetes manifests were not rendered")
    out = subprocess.run(
        [kubectl, "kustomize", str(ROOT / "deploy" / "k8s")],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    return [d for d in yaml.safe_load_all(out.stdout) if d]


def test_kubernetes_manifests_render_and_validate() -> None:
    docs = kustomized()
    for doc in docs:  # the API schemas of a current Kubernetes, strict (no unknown fields)
        kubernetes_validate.validate(doc, desired_version="1.32", strict=True)
    kinds = {(d["kind"], d["metadata"]["name"]) for d in docs}
    assert kinds >= {
        ("Secret", "baton-cluster"),
        ("StatefulSet", "kvstore"),
        ("Deployment", "redis"),
        ("Deployment", "prefill"),
        ("Deployment", "decode"),
        ("Deployment", "gateway"),
        ("Service", "gateway"),
        ("Service", "redis"),
    }


def test_kubernetes_pods_run_the_launcher_plan_with_probes_and_drain_time() -> None:
    """Each role's container runs the plan's command with the plan's settings (the
    secret from the Secret, its own pod IP as the advertised address)."""
    workloads = {
        d["metadata"]["name"]: d["spec"]["template"]["spec"]
        for d in kustomized()
        if d["kind"] in ("Deployment", "StatefulSet")
    }
    drain = WorkerSettings.model_fields["drain_timeout_s"].default
    for spec in kubernetes_plan():
        pod = workloads[spec.role]
        (container,) = pod["containers"]
        assert container["command"] == spec.command("python"), spec.role
        env = {e["name"]: e for e in container["env"]}
        assert set(env) - set(spec.env) <= {f"BATON_{spec.role.upper()}_ADVERTISE_HOST"}
        for name, value in spec.env.items():
            if name == "BATON_CLUSTER_SECRET":
                assert env[name]["valueFrom"]["secretKeyRef"]["name"] == "baton-cluster"
            else:
                assert env[name]["value"] == value, (spec.role, name)
        assert container["readinessProbe"]["httpGet"]["path"] == "/ready"
        assert container["livenessProbe"]["httpGet"]["path"] == "/health"
        assert container["resources"]["requests"]
        if spec.role in ("prefill", "decode"):
            assert pod["terminationGracePeriodSeconds"] >= drain + GRACEFUL_SHUTDOWN_S
