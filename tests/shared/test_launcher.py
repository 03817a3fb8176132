"""``baton up`` as a user runs it: the whole local cluster from one command, its output
prefixed by instance, an OpenAI API at the printed URL, a child that dies restarted
(the cluster stays up), a clean stop on SIGTERM."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import psutil
import pytest

from shared.errors import InvalidRequestError
from shared.launcher import Topology, plan
from shared.procs import free_ports


def test_baton_up_serves_and_stops_cleanly(cache_dir: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("BATON_")}
    env |= {"BATON_CACHE_DIR": str(cache_dir), "BATON_KV_CACHE_GB": "0.25"}
    ports = free_ports(4)
    args = [
        sys.executable, "-m", "shared.cli", "up",
        "--port", str(ports[0]), "--prefill-port", str(ports[1]),
        "--decode-port", str(ports[2]), "--kvstore-port", str(ports[3]),
        "--kvstore-gb", "0.25", "--transport", "tcp",
    ]  # fmt: skip
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env)
    lines: list[str] = []
    up = threading.Event()

    def read() -> None:
        assert proc.stdout is not None
        for raw in proc.stdout:
            lines.append(raw.decode(errors="replace").rstrip())
            if "cluster up" in lines[-1]:
                up.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        assert up.wait(180), "\n".join(lines[-30:])
        url = re.search(r"(http://\S+)/v1", lines[-1])
        assert url is not None and url.group(1) == f"http://127.0.0.1:{ports[0]}"
        children = psutil.Process(proc.pid).children(recursive=True)
        assert len(children) >= 5  # redis-server, kvstore, prefill, decode, gateway
        r = httpx.post(
            url.group(1) + "/v1/completions",
            json={"model": "SmolLM2-135M-Instruct", "prompt": "Hello", "max_tokens": 3},
            timeout=120,
        )
        assert r.status_code == 200, r.text
        decode = next(c for c in children if "services.decode" in " ".join(c.cmdline()))
        decode.kill()
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            r = httpx.post(
                url.group(1) + "/v1/completions",
                json={"model": "SmolLM2-135M-Instruct", "prompt": "Hello", "max_tokens": 3},
                timeout=120,
            )
            if r.status_code == 200:
                break
            time.sleep(0.5)
        assert r.status_code == 200, r.text
        assert any("decode-0 killed by SIGKILL; restarting" in line for line in lines), lines
        assert proc.poll() is None  # the cluster stayed up
        children = psutil.Process(proc.pid).children(recursive=True)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    reader.join(10)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and any(c.is_running() for c in children):
        time.sleep(0.1)
    assert not [c for c in children if c.is_running() and c.status() != psutil.STATUS_ZOMBIE]
    prefixes = {line.split(" | ", 1)[0] for line in lines if " | " in line}
    assert {"kvstore-0", "prefill-0", "decode-0", "gateway"} <= prefixes
    assert any("stopping" in line for line in lines)


@pytest.mark.parametrize("replicas", [1, 3])
def test_plan_numbers_replicas_and_ports(replicas: int) -> None:
    specs = plan(Topology(redis_url="redis://r:1/0", prefill=replicas, decode=replicas))
    names = [s.name for s in specs]
    assert names.count("gateway") == 1 and names[-1] == "gateway"
    prefill_ports = [s.http_port for s in specs if s.role == "prefill"]
    assert prefill_ports == [8100 + i for i in range(replicas)]
    for spec in specs:
        assert spec.env["BATON_REDIS_URL"] == "redis://r:1/0"
        if spec.role in ("prefill", "decode"):
            assert spec.env[f"BATON_{spec.role.upper()}_PORT"] == str(spec.http_port)
            assert spec.env[f"BATON_{spec.role.upper()}_ADVERTISE_HOST"] == "127.0.0.1"


def test_plan_pins_the_decode_engine_thread_apart_from_its_io() -> None:
    topo = Topology(
        redis_url="redis://r:1/0",
        cpus={"prefill": "0", "decode": "0"},
        engine_cpus={"decode": "1"},
    )
    env = {s.role: s.env for s in plan(topo)}
    assert env["decode"]["BATON_CPUS"] == "0" and env["decode"]["BATON_ENGINE_CPUS"] == "1"
    assert env["prefill"]["BATON_CPUS"] == "0" and "BATON_ENGINE_CPUS" not in env["prefill"]


def test_prefill_and_decode_get_elastic_threads() -> None:
    topo = Topology(redis_url="redis://r:1/0", threads=1, max_threads=2)
    env = {s.role: s.env for s in plan(topo)}
    for role in ("prefill", "decode"):
        assert env[role]["BATON_NUM_THREADS"] == "1"
        assert env[role]["BATON_MAX_THREADS"] == "2"
    assert "BATON_MAX_THREADS" not in env["kvstore"] and "BATON_MAX_THREADS" not in env["gateway"]


def test_mixed_runs_every_worker_as_a_mixed_instance_of_its_home_role() -> None:
    specs = plan(Topology(redis_url="redis://r:1/0", prefill=1, decode=2, mixed=True))
    workers = [s for s in specs if s.role in ("prefill", "decode")]
    assert [(s.name, s.module) for s in workers] == [
        ("prefill-0", "services.mixed"),
        ("decode-0", "services.mixed"),
        ("decode-1", "services.mixed"),
    ]
    for s in workers:
        assert s.env["BATON_MIXED_HOME"] == s.role
        assert s.env["BATON_MIXED_PORT"] == str(s.http_port)
    assert {s.module for s in specs if s.role == "kvstore"} == {"services.kvstore"}


def test_no_prefix_cache_reaches_every_service() -> None:
    """``baton up --no-prefix-cache``: no worker reuses KV and the gateway routes without
    the prompt index (the baseline caching is measured against)."""
    from shared.cli import build_parser

    args = build_parser().parse_args(["up", "--no-prefix-cache"])
    assert args.no_prefix_cache
    off = plan(Topology(redis_url="redis://r:1/0", prefix_caching=False))
    assert {s.env.get("BATON_ENABLE_PREFIX_CACHING") for s in off} == {"false"}
    on = plan(Topology(redis_url="redis://r:1/0"))
    assert all("BATON_ENABLE_PREFIX_CACHING" not in s.env for s in on)


def test_slo_targets_reach_every_service() -> None:
    """``baton up --slo-ttft/--slo-tpot``: each service's environment carries the targets
    its settings read; a target that is not positive is refused."""
    from shared.cli import _service_env, build_parser
    from shared.config import BatonSettings, SloConfig

    settings = BatonSettings()
    args = build_parser().parse_args(["up", "--slo-ttft", "3", "--slo-tpot", "0.1"])
    env = _service_env(args, settings)
    assert (env["BATON_SLO_TTFT"], env["BATON_SLO_TPOT"]) == ("3.0", "0.1")
    services = plan(Topology(redis_url="redis://r:1/0", extra_env=env))
    assert {(s.env["BATON_SLO_TTFT"], s.env["BATON_SLO_TPOT"]) for s in services} == {
        ("3.0", "0.1")
    }
    assert BatonSettings(slo_ttft=3.0, slo_tpot=0.1).slo() == SloConfig(3.0, 0.1)
    assert "BATON_SLO_TTFT" not in _service_env(build_parser().parse_args(["up"]), settings)
    with pytest.raises(InvalidRequestError, match="--slo-tpot must be positive"):
        _service_env(build_parser().parse_args(["up", "--slo-tpot", "0"]), settings)
