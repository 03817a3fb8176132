"""Decode under KV pressure with no host swap space: streams that outgrow the pool are
preempted, their KV stays in the KV store (replicated blocks) and they resume by loading
it back, on a real cluster (real store, UCX, Redis), with exactly the in-process
engine's tokens, greedy and seeded."""

from __future__ import annotations

import asyncio
import re
from pathlib import Path

import httpx

from shared.engine.sampling_params import SamplingParams
from tests.conftest import EngineFactory
from tests.services.conftest import completion_token_ids, serving_reference, start_cluster

BLOCK_BYTES = 737_280  # the default model's fp32 block (16 tokens)
# short prompts (2 blocks) are admitted together; at 96 tokens each needs 8 blocks
PROMPTS = [[200 + (i * 37 + j) % 9000 for j in range(20 + 3 * i)] for i in range(5)]
SEEDS = [None, 5, None, 9, 13]
MAX_TOKENS = 96


def test_preempted_streams_spill_to_the_store_and_keep_their_tokens(
    tmp_path: Path, make_engine: EngineFactory
) -> None:
    kv_gb = 24 * BLOCK_BYTES / (1 << 30)
    local = start_cluster(tmp_path, prefill=1, decode=1, kv_cache_gb=kv_gb, BATON_SWAP_SPACE_GB="0")
    try:
        got = asyncio.run(
            completion_token_ids(
                local.gateway_url, PROMPTS, SEEDS, max_tokens=MAX_TOKENS, temperature=0.8
            )
        )
        decode = next(s for s in local.specs if s.role == "decode")
        stats = httpx.get(f"http://127.0.0.1:{decode.http_port}/stats").json()
        metrics = httpx.get(f"http://127.0.0.1:{decode.http_port}/metrics").text
    finally:
        local.stop()
    engine = serving_reference(make_engine)
    for prompt, seed, tokens in zip(PROMPTS, SEEDS, got, strict=True):
        params = SamplingParams(
            max_tokens=MAX_TOKENS,
            temperature=0.0 if seed is None else 0.8,
            seed=seed,
            ignore_eos=True,
        )
        assert tokens == engine.generate([prompt], params)[0].token_ids
    assert stats["preemptions"] > 0 and stats["spills_in"] > 0
    assert stats["spilled_tokens_in"] > 0  # answer blocks came back, not just prompts
    assert stats["swaps_out"] == 0 and stats["kv_usage"] == 0
    spilled = re.search(r'baton_kv_swaps_total\{direction="in",tier="store"\} (\S+)', metrics)
    assert spilled is not None and float(spilled.group(1)) == stats["spills_in"]
