"""Discovery through Redis only: a new decode replica takes traffic within a heartbeat,
a stopped one is dropped at once, a dead one after its key expires, and with no decode
left the gateway answers 503 (and /ready says so)."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from shared.launcher import LocalCluster, Topology, plan
from shared.procs import PortPicker
from tests.services.conftest import FAST_HEARTBEAT, MODEL, start_cluster


@pytest.fixture
def small(tmp_path: Path) -> Iterator[LocalCluster]:
    local = start_cluster(tmp_path, prefill=1, decode=1)
    try:
        yield local
    finally:
        local.stop()


def request_burst(url: str, n: int) -> list[int]:
    async def one(client: httpx.AsyncClient) -> int:
        r = await client.post(
            url + "/v1/completions",
            json={"model": MODEL, "prompt": "Hello there", "max_tokens": 6, "ignore_eos": True},
        )
        return r.status_code

    async def run() -> list[int]:
        async with httpx.AsyncClient(timeout=120) as client:
            return list(await asyncio.gather(*(one(client) for _ in range(n))))

    return asyncio.run(run())


def decode_steps(local: LocalCluster, name: str) -> float:
    spec = next(s for s in local.specs if s.name == name)
    return float(httpx.get(f"http://127.0.0.1:{spec.http_port}/stats", timeout=5).json()["steps"])


def test_replicas_come_and_go(small: LocalCluster) -> None:
    url = small.gateway_url
    assert request_burst(url, 2) == [200, 200]

    # a new decode replica: registered in Redis by itself, no host list anywhere
    topo = Topology(
        redis_url=small.redis.url,
        decode=2,
        ports=PortPicker(),
        transport="ucx",
        kv_cache_gb=0.25,
        dtype="float32",
        extra_env={**FAST_HEARTBEAT, "BATON_LOG_LEVEL": "warning"},
        cluster_secret=small.secret.value,  # it joins this cluster
    )
    extra = next(s for s in plan(topo) if s.name == "decode-1")
    small.add(extra)
    # the gateway learns of it from Redis alone (a heartbeat and a refresh; the bound
    # here is generous: it checks liveness, not speed, on a noisy machine)
    deadline = time.monotonic() + 10.0
    while httpx.get(url + "/ready", timeout=5).json()["decode"] < 2:
        assert time.monotonic() < deadline, "the gateway did not see the new replica"
        time.sleep(0.05)
    assert request_burst(url, 6) == [200] * 6
    assert decode_steps(small, "decode-1") > 0  # least-loaded routing used the newcomer

    # a cleanly stopped replica deregisters and is dropped before the next request
    small.procs["decode-0"].stop()
    assert request_burst(url, 3) == [200] * 3

    # a crashed one: requests never fail with a 500, and once none is left it is a 503
    small.procs["decode-1"].kill()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        r = httpx.post(
            url + "/v1/completions",
            json={"model": MODEL, "prompt": "Hello", "max_tokens": 4},
            timeout=60,
        )
        assert r.status_code in (502, 503), r.text
        if r.status_code == 503 and "decode" in r.json()["error"]["message"]:
            break
    else:
        raise AssertionError("the gateway kept routing to a dead decode instance")
    assert r.json()["error"]["code"] == "no_live_instance"
    ready = httpx.get(url + "/ready", timeout=5)
    assert ready.status_code == 503 and ready.json()["decode"] == 0


def test_baton_status_lists_every_live_instance(small: LocalCluster) -> None:
    assert request_burst(small.gateway_url, 2) == [200, 200]
    status = [sys.executable, "-m", "shared.cli", "status", "--redis-url", small.redis.url]
    deadline = time.monotonic() + 10
    while True:  # the heartbeat after the requests carries the cache figures
        records = subprocess.run([*status, "--json"], capture_output=True, text=True, timeout=60)
        assert records.returncode == 0, records.stderr
        members = [json.loads(line) for line in records.stdout.splitlines()]
        if any("cache_hit_rate" in m["load"] for m in members) or time.monotonic() > deadline:
            break
    assert sorted(m["role"] for m in members) == ["decode", "kvstore", "prefill"]
    for m in members:
        assert time.time() - m["heartbeat_at"] < 5, m
        if m["role"] != "kvstore":
            assert m["dtype"] == "float32" and "kv_usage" in m["load"]
    prefill = next(m for m in members if m["role"] == "prefill")
    assert 0.0 <= prefill["load"]["cache_hit_rate"] <= 1.0
    table = subprocess.run(status, capture_output=True, text=True, timeout=60)
    assert table.returncode == 0 and len(table.stdout.splitlines()) == 4
    assert table.stdout.startswith("instance")
