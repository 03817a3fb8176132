"""Mid-stream failover through the real cluster (1 prefill, 3 decode, store, Redis,
gateway; a supervisor restarts what dies, as ``baton up`` does): a decode instance
killed (SIGKILL), hung (SIGSTOP) or drained (SIGTERM) while it streams several
requests; every stream completes with exactly the tokens of a failure-free run,
greedy and seeded, with no error and no duplicated or missing token."""

from __future__ import annotations

import asyncio
import json
import random
import signal
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import httpx
import pytest

from services.prefill.prefiller import PREFILL_CHUNK_TOKENS
from shared.engine.sampling_params import SamplingParams
from shared.launcher import LocalCluster
from shared.supervisor import RestartPolicy, Supervisor, SupervisorThread
from tests.conftest import EngineFactory
from tests.services.conftest import MODEL, start_cluster

MAX_TOKENS = 96


@dataclass(frozen=True)
class Req:
    prompt: list[int]
    seed: int | None

    def params(self) -> SamplingParams:
        if self.seed is None:
            return SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
        return SamplingParams(
            max_tokens=MAX_TOKENS, temperature=0.8, top_p=0.95, seed=self.seed, ignore_eos=True
        )


@dataclass
class Stream:
    tokens: list[int]
    error: str | None = None


@pytest.fixture(scope="module")
def failover(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    local = start_cluster(tmp_path_factory.mktemp("failover"), prefill=1, decode=3)
    supervisor = SupervisorThread(Supervisor(local, RestartPolicy(), say=lambda m: None)).start()
    try:
        yield local
    finally:
        supervisor.stop()
        local.stop()


def requests(n: int, seed: int) -> list[Req]:
    rng = random.Random(seed)
    return [
        Req(
            [rng.randrange(1000, 30000) for _ in range(rng.randrange(60, 200))],
            50 + i if i % 2 else None,
        )
        for i in range(n)
    ]


async def stream(http: httpx.AsyncClient, url: str, req: Req, progress: list[int]) -> Stream:
    body: dict[str, object] = {
        "model": MODEL,
        "prompt": req.prompt,
        "max_tokens": MAX_TOKENS,
        "ignore_eos": True,
        "stream": True,
        "return_token_ids": True,
        "temperature": 0.0 if req.seed is None else 0.8,
    }
    if req.seed is not None:
        body |= {"seed": req.seed, "top_p": 0.95}
    out = Stream([])
    async with http.stream("POST", url + "/v1/completions", json=body) as r:
        if r.status_code != 200:
            return Stream([], f"HTTP {r.status_code}: {(await r.aread())[:200]!r}")
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                out.error = str(chunk["error"])
                break
            for choice in chunk.get("choices", []):
                out.tokens += choice.get("token_ids") or []
                progress[0] += len(choice.get("token_ids") or [])
    return out


def decode_busy(local: LocalCluster) -> str:
    """The decode instance with the most requests right now."""
    best, most = "", -1.0
    for spec in local.specs:
        if spec.role != "decode" or not local.procs[spec.name].alive:
            continue
        try:
            n = httpx.get(f"http://127.0.0.1:{spec.http_port}/stats", timeout=2).json()["requests"]
        except (httpx.HTTPError, KeyError, ValueError):
            continue
        if n > most:
            best, most = spec.name, n
    return best


def run_with_fault(
    local: LocalCluster, reqs: list[Req], fault: Callable[[str], None]
) -> list[Stream]:
    """Stream ``reqs`` at once; once tokens flow, apply ``fault`` to the busiest decode."""

    async def main() -> list[Stream]:
        progress = [0]
        async with httpx.AsyncClient(timeout=300) as http:
            tasks = [
                asyncio.create_task(stream(http, local.gateway_url, r, progress)) for r in reqs
            ]
            deadline = time.monotonic() + 120
            while progress[0] < 3 * len(reqs) and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            fault(decode_busy(local))
            return list(await asyncio.gather(*tasks))

    return asyncio.run(main())


def expected(make_engine: EngineFactory, reqs: list[Req]) -> list[list[int]]:
    engine = make_engine(
        enable_prefix_caching=False, long_prefill_token_threshold=PREFILL_CHUNK_TOKENS
    )
    return [engine.generate([r.prompt], r.params())[0].token_ids for r in reqs]


def failovers(local: LocalCluster, reason: str) -> float:
    text = httpx.get(local.gateway_url + "/metrics", timeout=10).text
    key = f'baton_failovers_total{{reason="{reason}"}}'
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(key))


def wait_all_decode_ready(local: LocalCluster, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    for spec in local.specs:
        if spec.role == "decode":
            while time.monotonic() < deadline:
                try:
                    if (
                        httpx.get(f"http://127.0.0.1:{spec.http_port}/ready", timeout=1).status_code
                        == 200
                    ):
                        break
                except httpx.HTTPError:
                    pass
                time.sleep(0.2)
    time.sleep(1.0)  # the gateway's membership view catches up


@pytest.mark.parametrize(
    ("fault", "reason"),
    [("kill", "lost"), ("stop", "hung"), ("term", "migrated")],
)
def test_streams_survive_a_decode_instance_failing_mid_stream(
    failover: LocalCluster, make_engine: EngineFactory, fault: str, reason: str
) -> None:
    wait_all_decode_ready(failover)
    reqs = requests(6, seed={"kill": 1, "stop": 2, "term": 3}[fault])
    before = failovers(failover, reason)
    stopped: list[str] = []

    def apply(name: str) -> None:
        proc = failover.procs[name].proc
        assert proc is not None
        if fault == "kill":
            proc.kill()
        elif fault == "stop":
            proc.send_signal(signal.SIGSTOP)
            stopped.append(name)
        else:
            proc.send_signal(signal.SIGTERM)

    try:
        got = run_with_fault(failover, reqs, apply)
    finally:
        for name in stopped:  # the hung one wakes up (and its streams are gone)
            proc = failover.procs[name].proc
            if proc is not None:
                proc.send_signal(signal.SIGCONT)
                proc.kill()
    assert [s.error for s in got] == [None] * len(reqs)
    assert [s.tokens for s in got] == expected(make_engine, reqs)
    assert failovers(failover, reason) > before
