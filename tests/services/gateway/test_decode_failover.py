"""Failures under load through the real cluster (2 prefill, 3 decode, 2 KV store nodes
with every block on both, Redis, the gateway; a supervisor restarts what dies, as
``baton up`` does). Every stream completes with exactly the tokens of a failure-free
run in one process, greedy and seeded, with no error and no duplicated or missing
token, when:

- a decode instance is killed (SIGKILL), hung (SIGSTOP) or drained (SIGTERM) while
  it streams several requests;
- every prefill and decode instance is drained and restarted in turn (a rolling
  restart);
- one of the two KV store nodes is killed;
- (the one exception) every decode instance is gone: the stream ends with a clear
  error once none came back within the failover timeout;
- Redis is down for 10 s (and comes back empty: the services re-register and
  republish, and caching and failover work again).
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Awaitable, Callable, Iterator

import httpx
import pytest

from services.prefill.prefiller import PREFILL_CHUNK_TOKENS
from shared.bench.chaos import (
    ChaosRequest,
    Fault,
    StreamResult,
    Supervised,
    apply_fault,
    broken,
    failovers,
    kill_instance,
    make_requests,
    redis_outage,
    reference,
    rolling_restart,
    settle,
    stream,
    under_load,
    with_fault,
)
from shared.bench.scrape import metric_sum
from shared.engine.engine import Engine
from shared.launcher import LocalCluster
from tests.conftest import EngineFactory
from tests.services.conftest import MODEL, start_cluster

MAX_TOKENS = 96
FAILOVER_TIMEOUT_S = 5.0


@pytest.fixture(scope="module")
def chaos(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Supervised]:
    local = start_cluster(
        tmp_path_factory.mktemp("failover"), prefill=2, decode=3, kvstore=2,
        BATON_REPLICATION="2", BATON_GATEWAY_FAILOVER_TIMEOUT_S=str(FAILOVER_TIMEOUT_S),
    )  # fmt: skip
    supervised = Supervised(local)
    try:
        yield supervised
    finally:
        supervised.close()
        local.stop()


# the failure-free runs: 8 requests a batch (at most 200 + 96 tokens each) in a pool
# that holds them, so a reference is one batch's decode steps, not two or more
REFERENCE_BATCH = 8


@pytest.fixture(scope="module")
def engine(make_engine: EngineFactory) -> Engine:
    return make_engine(
        kv_cache_bytes=256 << 20,
        enable_prefix_caching=False,
        long_prefill_token_threshold=PREFILL_CHUNK_TOKENS,
    )


def failure_free(engine: Engine, reqs: list[ChaosRequest]) -> list[list[int]]:
    return reference(engine, reqs, batch=REFERENCE_BATCH)


def requests(n: int, seed: int) -> list[ChaosRequest]:
    return make_requests(random.Random(seed), n, prompt_len=(60, 200), max_tokens=MAX_TOKENS)


def run_with_fault(
    local: LocalCluster, reqs: list[ChaosRequest], fault: Fault
) -> list[StreamResult]:
    return asyncio.run(with_fault(local, MODEL, reqs, fault)).results


@pytest.mark.parametrize("fault", ["kill", "stop", "term"])
def test_streams_survive_a_decode_instance_failing_mid_stream(
    chaos: Supervised, engine: Engine, fault: Fault
) -> None:
    settle(chaos.local)
    reqs = requests(6, seed={"kill": 1, "stop": 2, "term": 3}[fault])
    url = chaos.local.gateway_url
    before = failovers(url, fault)
    got = run_with_fault(chaos.local, reqs, fault)
    assert broken(got, failure_free(engine, reqs)) == []
    assert failovers(url, fault) > before


def load(
    chaos: Supervised, seed: int, concurrency: int, during: Callable[[], Awaitable[None]]
) -> tuple[list[StreamResult], list[ChaosRequest]]:
    """Run ``during`` while ``concurrency`` streams keep going."""
    reqs = iter(requests(400, seed))
    results = asyncio.run(under_load(chaos.local, MODEL, reqs, concurrency, during))
    return results, [r.request for r in results]


def test_rolling_restart_of_every_instance_breaks_no_stream(
    chaos: Supervised, engine: Engine
) -> None:
    settle(chaos.local)
    local = chaos.local
    before = metric_sum(local.gateway_url, "baton_failovers_total", 'reason="migrated"')

    got, reqs = load(
        chaos, seed=11, concurrency=4, during=lambda: rolling_restart(local, ("prefill", "decode"))
    )
    assert len(got) >= 4
    assert broken(got, failure_free(engine, reqs)) == []
    assert metric_sum(local.gateway_url, "baton_failovers_total", 'reason="migrated"') > before


def test_killing_one_of_two_store_nodes_fails_no_request(chaos: Supervised, engine: Engine) -> None:
    settle(chaos.local)
    local = chaos.local

    got, reqs = load(
        chaos, seed=12, concurrency=4, during=lambda: kill_instance(local, "kvstore-0", 3.0)
    )
    assert broken(got, failure_free(engine, reqs)) == []


def test_redis_down_for_ten_seconds_fails_no_request_and_state_comes_back(
    chaos: Supervised, engine: Engine
) -> None:
    settle(chaos.local)
    local = chaos.local
    back: dict[str, float] = {}
    members = len([s for s in local.specs if s.role != "gateway"])

    async def outage() -> None:
        back.update(await redis_outage(chaos, 10.0, members))

    got, reqs = load(chaos, seed=13, concurrency=3, during=outage)
    assert broken(got, failure_free(engine, reqs)) == []
    assert set(back) == {"members", "index", "watermarks"}, back
    assert max(back.values()) < 10.0, back
    # and failover works again: a decode instance killed now is survived too
    settle(local)
    reqs = requests(4, seed=14)
    assert broken(run_with_fault(local, reqs, "kill"), failure_free(engine, reqs)) == []


def test_a_stream_ends_with_a_clear_error_only_once_no_decode_instance_is_left(
    chaos: Supervised, engine: Engine
) -> None:
    settle(chaos.local)
    local = chaos.local
    req = requests(1, seed=21)[0]

    async def main() -> tuple[StreamResult, float]:
        flowing = [0]

        def count(n: int) -> None:
            flowing[0] += n

        async with httpx.AsyncClient(timeout=120) as http:
            task = asyncio.create_task(stream(http, local.gateway_url, MODEL, req, count))
            while flowing[0] < 3 and not task.done():
                await asyncio.sleep(0.02)
            for spec in [s for s in local.specs if s.role == "decode"]:
                apply_fault(local, spec.name, "kill")
            killed = time.perf_counter()
            return await task, killed

    chaos.pause()  # nothing comes back
    try:
        got, killed = asyncio.run(main())
    finally:
        chaos.resume()
    assert got.error is not None and "no_live_instance" in got.error, got.error
    assert FAILOVER_TIMEOUT_S <= got.ended - killed < FAILOVER_TIMEOUT_S + 10
    assert got.tokens == failure_free(engine, [req])[0][: len(got.tokens)]
