"""A cluster with a TPOT target (``BATON_SLO_TPOT``, as ``baton up --slo-tpot`` sets it)
under a load that would let decode step back to back: streams decode while long
prompts are computed beside them. Decode paces its steps (it holds some back and
gives the time away), every stream stays within the target, the prefill instance
computes on more than one thread meanwhile (the core decode left), and the tokens
are the in-process engine's."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Iterator

import httpx
import pytest

from shared.bench.chaos import ChaosRequest, reference, stream
from shared.engine.engine import Engine
from shared.launcher import LocalCluster
from tests.conftest import EngineFactory
from tests.services.conftest import MODEL, serving_reference, start_cluster

TPOT_S = 0.1


@pytest.fixture(scope="module")
def paced(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    local = start_cluster(
        tmp_path_factory.mktemp("paced"), prefill=1, decode=1, max_threads=2,
        BATON_SLO_TPOT=str(TPOT_S), BATON_SLO_TTFT="10",
    )  # fmt: skip
    try:
        yield local
    finally:
        local.stop()


def stats(local: LocalCluster, role: str) -> dict[str, float]:
    spec = next(s for s in local.specs if s.role == role)
    data: dict[str, float] = httpx.get(f"http://127.0.0.1:{spec.http_port}/stats").json()
    return data


def test_decode_keeps_the_target_and_gives_its_slack_to_prefill(
    paced: LocalCluster, make_engine: EngineFactory
) -> None:
    rng = random.Random(7)
    streams = [
        ChaosRequest([rng.randrange(1000, 30000) for _ in range(40)], 120, None) for _ in range(3)
    ]
    prompts = [
        ChaosRequest([rng.randrange(1000, 30000) for _ in range(1500)], 2, None) for _ in range(3)
    ]
    before = stats(paced, "decode")

    async def run() -> list[float]:
        async with httpx.AsyncClient(timeout=300) as http:
            url = paced.gateway_url
            running = [asyncio.ensure_future(stream(http, url, MODEL, r)) for r in streams]
            await asyncio.sleep(1.0)  # the streams decode; then prompts arrive beside them
            for r in prompts:
                await stream(http, url, MODEL, r)
            results = await asyncio.gather(*running)
            engine: Engine = serving_reference(make_engine, enable_prefix_caching=False)
            want = reference(engine, streams)
            tpots = []
            for res, tokens in zip(results, want, strict=True):
                assert res.error is None and res.tokens == tokens
                gaps = [b - a for a, b in zip(res.stamps, res.stamps[1:], strict=False)]
                tpots.append(sum(gaps) / len(gaps))
            return tpots

    tpots = asyncio.run(run())
    after, prefill = stats(paced, "decode"), stats(paced, "prefill")
    assert after["paced_steps"] > before["paced_steps"]  # decode held steps back
    assert after["paced_s"] > before["paced_s"]
    assert max(tpots) <= TPOT_S, tpots  # and kept the target
    assert prefill["multi_thread_s"] > 0  # prefill computed on the core decode left
