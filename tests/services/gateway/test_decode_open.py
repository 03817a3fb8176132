"""When the gateway opens a prefilled request's decode. A lone prompt on a prefill
instance whose elastic threads take every core sends its KV whole after its first
token (``Accepted.kv_after_first_token``): the decode is opened only then, while the
client gets that token, so its setup takes no CPU from the prompt's compute. With a
core left (a prefill fixed at one thread), decode opens alongside and pulls while
prefill computes. Either way the tokens are the in-process engine's."""

from __future__ import annotations

import asyncio
import os
import random
import re
import signal
from collections.abc import Iterator

import httpx
import pytest

from shared.bench.chaos import ChaosRequest, reference, stream
from shared.bench.scrape import metric_sum
from shared.launcher import LocalCluster
from tests.conftest import EngineFactory
from tests.services.conftest import MODEL, Cluster, serving_reference, start_cluster

CPUS = len(os.sched_getaffinity(0))
pytestmark = pytest.mark.skipif(CPUS < 2, reason="a prefill with a core left needs 2 CPUs")


@pytest.fixture(scope="module")
def elastic(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    """Prefill's elastic ceiling is every CPU (as ``baton up`` sets it)."""
    local = start_cluster(tmp_path_factory.mktemp("elastic"), prefill=1, decode=1, max_threads=CPUS)
    try:
        yield local
    finally:
        local.stop()


def opens(url: str) -> dict[str, float]:
    text = httpx.get(url + "/metrics", timeout=10).text
    return {
        m.group(1): float(m.group(2))
        for m in re.finditer(r'^baton_decode_opens_total\{when="(\w+)"\} (\S+)$', text, re.M)
    }


def run_one_at_a_time(url: str, requests: list[ChaosRequest]) -> list[list[int]]:
    async def run() -> list[list[int]]:
        out = []
        async with httpx.AsyncClient(timeout=300) as http:
            for r in requests:
                res = await stream(http, url, MODEL, r)
                assert res.error is None, res.error
                out.append(res.tokens)
        return out

    return asyncio.run(run())


def requests(seed: int) -> list[ChaosRequest]:
    rng = random.Random(seed)
    return [
        ChaosRequest([rng.randrange(1000, 30000) for _ in range(n)], 24, s)
        for n, s in ((600, None), (300, 5), (900, None), (40, 9))
    ]


def opened_while_served(url: str, seed: int, make_engine: EngineFactory) -> dict[str, float]:
    """Serve a few requests one at a time (token-exact, checked) and count the decode
    opens they caused, by when."""
    reqs = requests(seed)
    before = opens(url)
    got = run_one_at_a_time(url, reqs)
    after = opens(url)
    assert got == reference(serving_reference(make_engine, enable_prefix_caching=False), reqs)
    return {k: after.get(k, 0) - before.get(k, 0) for k in ("alongside", "after_first_token")}


def test_a_lone_prompt_on_every_core_opens_decode_after_its_first_token(
    elastic: LocalCluster, make_engine: EngineFactory
) -> None:
    opened = opened_while_served(elastic.gateway_url, 1, make_engine)
    assert opened["after_first_token"] >= 3  # of 4: the first may follow a 1-thread step


def test_a_prefill_with_a_core_left_opens_decode_alongside(
    cluster: Cluster, make_engine: EngineFactory
) -> None:
    opened = opened_while_served(cluster.url, 2, make_engine)
    assert opened == {"alongside": 4, "after_first_token": 0}


def test_a_decode_waiting_on_its_kv_load_is_not_taken_for_hung(
    elastic: LocalCluster, make_engine: EngineFactory
) -> None:
    """A load in flight is progress. A lone long prompt's KV (hundreds of MB, sent
    after its first token) took longer to reach decode than the gateway's silence
    bound, and decode sent no keepalive while its engine, with only that load,
    stepped no more: the gateway took the stream for hung and resumed it once the
    instance's bench ended. Here the store is stopped (SIGSTOP) from before the
    prompt until 2 s after its first token: decode's keepalives go on while its load
    waits, the stream continues there, and its tokens are the engine's."""
    (store,) = elastic.pids(["kvstore"])
    req, url = requests(3)[0], elastic.gateway_url
    prefill = next(s for s in elastic.specs if s.role == "prefill")
    prefill_url = f"http://127.0.0.1:{prefill.http_port}"
    # the case needs a prompt on every core, which the last step's threads foretell; a
    # fresh prefill's first step, or one beside this process's reference work, may run
    # on one thread (the governor held a core): warm up until a step took every core
    for seed in range(10, 20):
        run_one_at_a_time(url, [requests(seed)[3]])
        if metric_sum(prefill_url, "baton_engine_threads") == CPUS:
            break
    else:
        pytest.fail("the prefill's steps never took every core: the machine is busy")
    before, opened = metric_sum(url, "baton_failovers_total"), opens(url)

    async def run() -> list[int]:
        loop = asyncio.get_running_loop()
        woken: list[asyncio.TimerHandle] = []

        def on_tokens(n: int) -> None:
            if not woken:
                woken.append(loop.call_later(2.0, os.kill, store, signal.SIGCONT))

        async with httpx.AsyncClient(timeout=120) as http:
            res = await asyncio.wait_for(stream(http, url, MODEL, req, on_tokens), 120)
        assert res.error is None, res.error
        assert woken, "no token came"
        return res.tokens

    os.kill(store, signal.SIGSTOP)
    try:
        got = asyncio.run(run())
    finally:
        os.kill(store, signal.SIGCONT)
    assert got == reference(serving_reference(make_engine, enable_prefix_caching=False), [req])[0]
    # decode loaded the KV whole after the first token (the case that was taken for hung)
    assert opens(url)["after_first_token"] == opened.get("after_first_token", 0) + 1
    assert metric_sum(url, "baton_failovers_total") == before
