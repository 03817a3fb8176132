"""Decode admission by free KV memory: with room for only a few requests, a burst
queues (nothing crashes, nothing is refused) and every request still produces
exactly the in-process engine's tokens."""

from __future__ import annotations

import asyncio
import re
from pathlib import Path

import httpx

from shared.engine.sampling_params import SamplingParams
from tests.conftest import EngineFactory
from tests.services.conftest import MODEL, serving_reference, start_cluster

BLOCK_BYTES = 737_280  # the default model's fp32 block (16 tokens)


def test_burst_over_kv_capacity_queues_and_stays_exact(
    tmp_path: Path, make_engine: EngineFactory
) -> None:
    # 24 blocks per worker: each request below needs 6-7 blocks, so at most 3 fit
    kv_gb = 24 * BLOCK_BYTES / (1 << 30)
    local = start_cluster(tmp_path, prefill=1, decode=1, kv_cache_gb=kv_gb)
    prompts = [[100 + i + j for j in range(60 + 5 * i)] for i in range(6)]
    try:

        async def one(client: httpx.AsyncClient, prompt: list[int]) -> list[int]:
            r = await client.post(
                local.gateway_url + "/v1/completions",
                json={
                    "model": MODEL,
                    "prompt": prompt,
                    "max_tokens": 30,
                    "temperature": 0,
                    "ignore_eos": True,
                    "return_token_ids": True,
                },
            )
            assert r.status_code == 200, r.text
            return list(r.json()["choices"][0]["token_ids"])

        async def burst() -> list[list[int]]:
            async with httpx.AsyncClient(timeout=300) as client:
                return list(await asyncio.gather(*(one(client, p) for p in prompts)))

        got = asyncio.run(burst())
        decode = next(s for s in local.specs if s.role == "decode")
        metrics = httpx.get(f"http://127.0.0.1:{decode.http_port}/metrics").text
        stats = httpx.get(f"http://127.0.0.1:{decode.http_port}/stats").json()
    finally:
        local.stop()
    engine = serving_reference(make_engine)
    params = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
    for prompt, tokens in zip(prompts, got, strict=True):
        assert tokens == engine.generate([prompt], params)[0].token_ids
    assert stats["kv_blocks_total"] == 24 and stats["kv_usage"] == 0
    assert "baton_decode_join_wait_seconds_count 6.0" in metrics
    # some requests waited for memory: fewer than all six were admitted within 0.5 s
    quick = re.search(r'baton_decode_admission_seconds_bucket\{le="0.5"\} (\S+)', metrics)
    assert quick is not None and float(quick.group(1)) < 6
