"""Fixtures shared by the service tests: data-plane transports in the test process, and
a real local cluster (redis-server, one KV store, two prefill and two decode instances
and the gateway, as processes on free ports)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import pytest_asyncio

from services.prefill.prefiller import PREFILL_CHUNK_TOKENS
from shared.engine.engine import Engine
from shared.launcher import LocalCluster, Topology
from shared.procs import PortPicker
from shared.transport import Transport, make_transport
from tests.conftest import EngineFactory

TRANSPORTS = ["tcp", "ucx"]


class Transports(dict[str, Transport]):
    """Each transport made at its first use (a machine without UCXX runs the TCP tests)."""

    def __missing__(self, name: str) -> Transport:
        self[name] = made = make_transport(name)
        return made


@pytest_asyncio.fixture(scope="session", loop_scope="session")
async def transports() -> AsyncIterator[dict[str, Transport]]:
    """One transport of each kind per test process (UCXX keeps one context per process)."""
    made = Transports()
    yield made
    for transport in made.values():
        await transport.shutdown()


MODEL = "SmolLM2-135M-Instruct"
FAST_HEARTBEAT = {"BATON_HEARTBEAT_S": "0.3", "BATON_MEMBER_TTL_S": "1.5"}


def serving_reference(make_engine: EngineFactory, **overrides: int) -> Engine:
    """The in-process engine a cluster must match token for token: the same engine
    and scheduler config as the prefill service (which caps prompt chunks)."""
    return make_engine(long_prefill_token_threshold=PREFILL_CHUNK_TOKENS, **overrides)


@dataclass
class Cluster:
    local: LocalCluster
    url: str

    def stats(self, role: str) -> list[dict[str, float]]:
        out = []
        for spec in self.local.specs:
            proc = self.local.procs.get(spec.name)
            if spec.role == role and proc is not None and proc.alive:
                r = httpx.get(f"http://127.0.0.1:{spec.http_port}/stats", timeout=5)
                out.append(r.json())
        return out


def start_cluster(
    tmp: Path,
    *,
    prefill: int,
    decode: int,
    colocated: int = 0,
    mixed: bool = False,
    kv_cache_gb: float = 0.25,
    kvstore: int = 1,
    kvstore_gb: float = 0.25,
    gateways: int = 1,
    max_threads: int | None = None,
    **env: str,
) -> LocalCluster:
    def topology(redis_url: str) -> Topology:
        picker = PortPicker()
        return Topology(
            redis_url=redis_url,
            prefill=prefill,
            decode=decode,
            colocated=colocated,
            mixed=mixed,
            kvstore=0 if colocated else kvstore,
            gateways=gateways,
            gateway_port=picker(),
            ports=picker,
            transport="ucx",
            threads=1,
            max_threads=max_threads,  # prefill's and decode's elastic ceiling (None: fixed at 1)
            dtype="float32",  # what the in-process reference engines compute in
            kv_cache_gb=kv_cache_gb,
            kvstore_gb=kvstore_gb,
            extra_env={**FAST_HEARTBEAT, **env},
        )

    return LocalCluster(topology, log_dir=tmp).start()


@pytest.fixture(scope="session")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    local = start_cluster(tmp_path_factory.mktemp("cluster"), prefill=2, decode=2)
    try:
        yield Cluster(local, local.gateway_url)
    finally:
        local.stop()


async def completion_token_ids(
    url: str, prompts: list[list[int]], seeds: list[int | None], max_tokens: int, temperature: float
) -> list[list[int]]:
    """Each prompt through ``/v1/completions`` at once (greedy where its seed is None, else
    seeded at ``temperature``); the token ids each got back."""

    async def one(client: httpx.AsyncClient, prompt: list[int], seed: int | None) -> list[int]:
        body = {
            "model": MODEL,
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0.0 if seed is None else temperature,
            "seed": seed,
            "ignore_eos": True,
            "return_token_ids": True,
        }
        r = await client.post(url + "/v1/completions", json=body)
        assert r.status_code == 200, r.text
        return list(r.json()["choices"][0]["token_ids"])

    async with httpx.AsyncClient(timeout=300) as client:
        calls = [one(client, p, s) for p, s in zip(prompts, seeds, strict=True)]
        return list(await asyncio.gather(*calls))
