"""Gemma 3 (sliding-window layers) through the real cluster: prompts past the 512-token
window give exactly the in-process engine's tokens, greedy and seeded, when served
disaggregated, when the next turn of a chat reuses cached KV, when a decode instance
is killed mid-stream, and when decode runs out of KV and swaps."""

from __future__ import annotations

import asyncio
import random
import re
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import httpx
import pytest
import redis.asyncio as aioredis

from services.prefill.prefiller import PREFILL_CHUNK_TOKENS
from shared.bench.chaos import (
    Supervised,
    broken,
    make_requests,
    reference,
    settle,
    with_fault,
)
from shared.cluster.block_index import BlockIndex, window_entry
from shared.cluster.keys import Keys
from shared.cluster.membership import Member, live_members
from shared.config import CacheConfig, EngineConfig, SchedulerConfig, default_cache_dir
from shared.engine.engine import Engine
from shared.engine.sampling_params import SamplingParams
from shared.kv.block_hash import BlockHasher
from shared.launcher import LocalCluster
from shared.model.loader import LoadedModel, load_model
from shared.model.registry import GEMMA3_270M
from tests.services.conftest import start_cluster

pytestmark = pytest.mark.slow

MODEL = GEMMA3_270M.name
BLOCK_BYTES = 589_824  # Gemma 3 270M's fp32 block: 18 layers x K,V x 16 tokens x 256
MAX_TOKENS = 48
LONG = 250  # tokens the swapping test's streams grow by


@pytest.fixture(scope="module")
def gemma(cache_dir: Path) -> LoadedModel:
    return load_model(MODEL, cache_dir=cache_dir, dtype="float32", progress=False)


def engine(gemma: LoadedModel, **cache: object) -> Engine:
    """The in-process engine the cluster must match (the prefill service's chunking)."""
    config = EngineConfig(
        dtype="float32",
        cache=replace(CacheConfig(kv_cache_bytes=256 << 20), **cache),  # type: ignore[arg-type]
        scheduler=SchedulerConfig(long_prefill_token_threshold=PREFILL_CHUNK_TOKENS),
    )
    return Engine(gemma, config)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory, gemma: LoadedModel) -> Iterator[Supervised]:
    local = start_cluster(
        tmp_path_factory.mktemp("gemma3"), prefill=1, decode=2, kv_cache_gb=0.25,
        BATON_MODEL=MODEL, BATON_CACHE_DIR=str(default_cache_dir()),
    )  # fmt: skip
    supervised = Supervised(local)
    try:
        yield supervised
    finally:
        supervised.close()
        local.stop()


async def complete(
    url: str, prompt: list[int], seed: int | None, max_tokens: int = MAX_TOKENS
) -> dict[str, object]:
    body = {
        "model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True,
        "temperature": 0.0 if seed is None else 0.8, "seed": seed, "return_token_ids": True,
    }  # fmt: skip
    async with httpx.AsyncClient(timeout=300) as client:
        r = await client.post(url + "/v1/completions", json=body)
    assert r.status_code == 200, r.text
    out: dict[str, object] = r.json()
    return out


def params(seed: int | None, max_tokens: int = MAX_TOKENS) -> SamplingParams:
    return SamplingParams(
        max_tokens=max_tokens, temperature=0.0 if seed is None else 0.8, seed=seed,
        ignore_eos=True,
    )  # fmt: skip


def test_prompts_past_the_window_and_their_next_turns_are_token_exact(
    cluster: Supervised, gemma: LoadedModel
) -> None:
    """Three prompts (100, 700 and 1,300 tokens), greedy and seeded; then each one's next
    turn (prompt + answer + 40 new tokens), whose prefix comes from the cache."""
    settle(cluster.local)
    url = cluster.local.gateway_url
    rng = random.Random(7)
    prompts = [[rng.randrange(1000, 200_000) for _ in range(n)] for n in (100, 700, 1300)]
    seeds = [None, 11, None]
    ref = engine(gemma, enable_prefix_caching=False)

    async def turns() -> list[tuple[dict[str, object], dict[str, object], list[int]]]:
        out = []
        for prompt, seed in zip(prompts, seeds, strict=True):
            first = await complete(url, prompt, seed)
            answer = first["choices"][0]["token_ids"]  # type: ignore[index]
            follow = prompt + answer + [rng.randrange(1000, 200_000) for _ in range(40)]
            out.append((first, await complete(url, follow, seed), follow))
        return out

    got = asyncio.run(turns())
    # each run's requests in one batch (a row does not depend on its batch)
    firsts = ref.generate(prompts, [params(seed) for seed in seeds])
    follows = ref.generate([follow for _, _, follow in got], [params(seed) for seed in seeds])
    for (first, second, follow), prompt, want, want_next in zip(
        got, prompts, firsts, follows, strict=True
    ):
        assert first["choices"][0]["token_ids"] == want.token_ids, len(prompt)  # type: ignore[index]
        assert second["choices"][0]["token_ids"] == want_next.token_ids, len(follow)  # type: ignore[index]
        cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]  # type: ignore[index]
        assert cached >= len(prompt) // 16 * 16, (len(prompt), cached)


def loaded_bytes(local: LocalCluster) -> float:
    """KV bytes every decode instance pulled from the store so far."""
    total = 0.0
    for spec in local.specs:
        if spec.role == "decode":
            text = httpx.get(f"http://127.0.0.1:{spec.http_port}/metrics", timeout=10).text
            m = re.search(r"^baton_kv_loaded_bytes_total (\S+)$", text, re.M)
            total += float(m.group(1)) if m else 0.0
    return total


def test_decode_loads_every_layer_of_the_window_only(cluster: Supervised) -> None:
    """A fresh 1,300-token prompt: decode pulls all 18 layers of the blocks its window
    reads (32 blocks, one row back, the partial tail) and only the 3 full-attention
    layers of the other 48 or so. The prompt index says which blocks the prefill
    instance holds and which of them with their window layers."""
    settle(cluster.local)
    prompt = [random.Random(5).randrange(1000, 200_000) for _ in range(1300)]
    before = loaded_bytes(cluster.local)
    asyncio.run(complete(cluster.local.gateway_url, prompt, None, 4))
    moved = loaded_bytes(cluster.local) - before
    layer, blocks, window = BLOCK_BYTES // 18, 1300 // 16 + 1, 512 // 16 + 3
    assert blocks * 3 * layer < moved <= (window * 18 + (blocks - window) * 3) * layer
    assert moved < 0.55 * blocks * BLOCK_BYTES
    (prefill,), ids, windowed = asyncio.run(index_entries(cluster.local, prompt))
    assert prefill.kv_window == 512
    assert all(prefill.instance_id in h for h in ids)
    # nothing evicted: every block keeps its (released, cached) window layers
    assert all(prefill.instance_id in h for h in windowed)


async def index_entries(
    local: LocalCluster, prompt: list[int]
) -> tuple[list[Member], list[set[str]], list[set[str]]]:
    """The prefill members, and who the index says holds each full block of ``prompt``
    and its window layers."""
    redis = aioredis.from_url(local.redis.url)
    try:
        members = await live_members(redis, Keys(), "prefill")
        hasher = BlockHasher(namespace=members[0].kv_namespace or "", block_size=16)
        ids = [k.hex() for k in hasher.keys(prompt)]
        index = BlockIndex(redis, Keys(), ttl_s=60)
        await asyncio.sleep(0.5)  # the publisher flushes in the background
        windowed = await index.holders([window_entry(i) for i in ids])
        return members, await index.holders(ids), windowed
    finally:
        await redis.aclose()


def test_a_decode_instance_killed_mid_stream_past_the_window(
    cluster: Supervised, gemma: LoadedModel
) -> None:
    """Four streams of 600-900-token prompts; the busiest decode instance is SIGKILLed
    once they stream: each resumes elsewhere with the failure-free tokens."""
    settle(cluster.local)
    reqs = make_requests(random.Random(3), 4, prompt_len=(600, 900), max_tokens=MAX_TOKENS)
    got = asyncio.run(with_fault(cluster.local, MODEL, reqs, "kill")).results
    assert broken(got, reference(engine(gemma, enable_prefix_caching=False), reqs)) == []


def test_swapping_under_kv_pressure_past_the_window(tmp_path: Path, gemma: LoadedModel) -> None:
    """A decode pool of 70 full-cache blocks (420 slots of 3 layers) for three
    530-token prompts that grow by 250 tokens. Past the window a stream holds every
    block's full-attention slot and the 33-34 newest blocks' window parts (5 slots
    each): about 204 slots when admitted, 220 at the end. Two are admitted together
    (408 slots) and outgrow the pool within 100 tokens, so streams are preempted,
    swapped out and back, and keep their tokens."""
    local: LocalCluster = start_cluster(
        tmp_path, prefill=1, decode=1, kv_cache_gb=70 * BLOCK_BYTES / (1 << 30),
        BATON_MODEL=MODEL, BATON_CACHE_DIR=str(default_cache_dir()),
    )  # fmt: skip
    rng = random.Random(5)
    prompts = [[rng.randrange(1000, 200_000) for _ in range(530)] for _ in range(3)]
    seeds = [None, 3, 8]
    try:

        async def all_at_once() -> list[dict[str, object]]:
            return list(
                await asyncio.gather(
                    *(
                        complete(local.gateway_url, p, s, LONG)
                        for p, s in zip(prompts, seeds, strict=True)
                    )
                )
            )

        got = asyncio.run(all_at_once())
        decode = next(s for s in local.specs if s.role == "decode")
        stats = httpx.get(f"http://127.0.0.1:{decode.http_port}/stats").json()
    finally:
        local.stop()
    ref = engine(gemma, enable_prefix_caching=False)
    want = ref.generate(prompts, [params(seed, LONG) for seed in seeds])  # one batch
    for out, expected in zip(got, want, strict=True):
        assert out["choices"][0]["token_ids"] == expected.token_ids  # type: ignore[index]
    assert stats["preemptions"] > 0, stats
    assert stats["swaps_out"] + stats["spills_in"] > 0, stats
