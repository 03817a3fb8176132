"""A cluster with a TPOT target (``BATON_SLO_TPOT``, as ``baton up --slo-tpot`` sets it)
under a load that would let decode step back to back: streams decode while long
prompts are computed beside them. Decode paces its steps (it holds some back and
gives the time away), every stream stays within the target, the prefill instance
computes on more than one thread meanwhile (the core decode left), and the tokens
are the in-process engine's. The target is 100 ms, or 4 unloaded decode steps on a
slower host (measured first)."""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Iterator

import httpx
import pytest
import torch

from shared.bench.chaos import ChaosRequest, reference, stream
from shared.engine.engine import Engine
from shared.engine.sampling_params import SamplingParams
from shared.launcher import LocalCluster
from tests.conftest import EngineFactory
from tests.services.conftest import MODEL, serving_reference, start_cluster

STREAMS, STREAM_PROMPT, STREAM_TOKENS = 3, 40, 120
# the target: 100 ms, or 4 unloaded decode steps where a step takes longer (a slower
# host): a step slowed down by a prompt computed beside it must still fit well inside
# it, or decode never has slack to give and there is nothing to pace
TPOT_FLOOR_S, TARGET_STEPS = 0.1, 4


def decode_step_s(engine: Engine) -> float:
    """One decode step of the streams' batch on one thread (decode's own), unloaded."""
    prompts = [[1000 + 7 * i + j for j in range(STREAM_PROMPT)] for i in range(STREAMS)]
    threads = torch.get_num_threads()
    engine.set_num_threads(1)
    try:
        took = []
        for n in (1, 21):
            params = SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)
            t0 = time.perf_counter()
            engine.generate(prompts, params)
            took.append(time.perf_counter() - t0)
    finally:
        engine.set_num_threads(threads)
    return (took[1] - took[0]) / 20


@pytest.fixture(scope="module")
def target_s(make_engine: EngineFactory) -> float:
    step = decode_step_s(make_engine(enable_prefix_caching=False))
    return max(TPOT_FLOOR_S, TARGET_STEPS * step)


@pytest.fixture(scope="module")
def paced(tmp_path_factory: pytest.TempPathFactory, target_s: float) -> Iterator[LocalCluster]:
    local = start_cluster(
        tmp_path_factory.mktemp("paced"), prefill=1, decode=1, max_threads=2,
        BATON_SLO_TPOT=f"{target_s:.3f}", BATON_SLO_TTFT="10",
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
    paced: LocalCluster, target_s: float, make_engine: EngineFactory
) -> None:
    rng = random.Random(7)
    streams = [
        ChaosRequest(
            [rng.randrange(1000, 30000) for _ in range(STREAM_PROMPT)], STREAM_TOKENS, None
        )
        for _ in range(STREAMS)
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
    assert max(tpots) <= target_s, (target_s, tpots)  # and kept the target
    assert prefill["multi_thread_s"] > 0  # prefill computed on the core decode left
