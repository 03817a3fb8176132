"""docker-compose.yml and the Dockerfile run what the local launcher runs.

There is no Docker engine here, so the compose file is checked by reading it:
each role's command and environment must equal :func:`shared.launcher.compose_plan`
(the launcher's plan with container addresses), and scaling must be possible."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from shared.launcher import ROLE_MODULES, Topology, compose_plan, plan

ROOT = Path(__file__).resolve().parents[1]


def compose() -> dict[str, Any]:
    data: dict[str, Any] = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    return data


def test_compose_runs_exactly_the_launcher_plan() -> None:
    services = compose()["services"]
    specs = {s.role: s for s in compose_plan()}
    assert set(services) == {"redis", *ROLE_MODULES}
    for role, spec in specs.items():
        svc = services[role]
        assert svc["command"] == spec.command("python"), role
        assert {k: str(v) for k, v in svc["environment"].items()} == spec.env, role


def test_compose_scales_and_checks_health() -> None:
    services = compose()["services"]
    assert services["redis"]["image"].startswith("redis:")
    images = {services[r]["image"] for r in ROLE_MODULES}
    assert images == {"baton:latest"}  # one image for every role
    for name, svc in services.items():
        assert "healthcheck" in svc, name
        assert "container_name" not in svc, name
        if name != "gateway":
            assert "ports" not in svc, name  # scaled replicas cannot share host ports
    assert services["gateway"]["ports"] == ["8000:8000"]
    for role in ("prefill", "decode"):
        env = services[role]["environment"]
        # no fixed address: each replica advertises its own container IP
        assert not any(k.endswith("ADVERTISE_HOST") for k in env)


def test_local_plan_differs_only_in_addresses() -> None:
    """The local launcher's plan for the same topology: same keys plus local addresses."""
    local = {s.role: s for s in plan(Topology(redis_url="redis://127.0.0.1:1/0"))}
    for spec in compose_plan():
        mine = local[spec.role]
        extra = set(mine.env) - set(spec.env)
        assert extra <= {
            f"BATON_{spec.role.upper()}_ADVERTISE_HOST",
            "BATON_NUM_THREADS",
        }, spec.role
        assert mine.module == spec.module


def test_dockerfile_builds_one_image_with_the_model() -> None:
    text = (ROOT / "Dockerfile").read_text()
    assert "torch==2.13.0" in text
    assert "pip install ." in text
    assert "RUN baton model pull" in text  # pulled at build: containers start offline
