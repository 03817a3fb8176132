"""The colocated baseline behind the same gateway API: one engine, both phases, the
same tokens as the in-process engine (so comparisons with disaggregation are fair)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx

from shared.engine.sampling_params import SamplingParams
from tests.conftest import EngineFactory
from tests.services.conftest import completion_token_ids, start_cluster


def test_colocated_serves_the_same_tokens(tmp_path: Path, make_engine: EngineFactory) -> None:
    local = start_cluster(tmp_path, prefill=0, decode=0, colocated=1)
    prompts = [[120 + (i * 31 + j) % 9000 for j in range(20 + 37 * i)] for i in range(4)]
    seeds = [None, 5, None, 9]
    try:
        ready = httpx.get(local.gateway_url + "/ready", timeout=10).json()
        assert ready["colocated"] == 1 and "prefill" not in ready

        got = asyncio.run(completion_token_ids(local.gateway_url, prompts, seeds, 10, 0.9))
    finally:
        local.stop()
    engine = make_engine()
    for prompt, seed, tokens in zip(prompts, seeds, got, strict=True):
        params = SamplingParams(
            max_tokens=10, temperature=0.0 if seed is None else 0.9, seed=seed, ignore_eos=True
        )
        assert tokens == engine.generate([prompt], params)[0].token_ids
