"""A mixed pool on real services: two mixed instances (one prefill-home, one decode-home)
serve the same tokens as the in-process engine, constrained outputs (a JSON schema)
included; with its decode-home instance gone, the prefill-home one serves whole
requests itself (prefill and decode of one request on one engine) and says so in its
load report and metrics."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import httpx
import jsonschema

from shared.bench.scrape import metric_sum
from shared.engine.constraint import Constraint
from shared.engine.sampling_params import SamplingParams
from tests.conftest import EngineFactory
from tests.services.conftest import (
    MODEL,
    completion_token_ids,
    serving_reference,
    start_cluster,
)

PROMPTS = [[150 + (i * 53 + j) % 9000 for j in range(30 + 61 * i)] for i in range(4)]
SEEDS = [None, 7, None, 11]


ITEM = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "pattern": "^[a-z]{1,12}$"},
        "n": {"type": "integer", "minimum": 0, "maximum": 999},
    },
    "required": ["name", "n"],
    "additionalProperties": False,
}


async def complete(url: str, prompts: list[list[int]], seeds: list[int | None]) -> list[list[int]]:
    return await completion_token_ids(url, prompts, seeds, max_tokens=12, temperature=0.8)


def constrained(url: str, prompt: list[int], seed: int | None) -> list[int]:
    """A JSON-schema output's token ids (it must also parse and validate)."""
    body = {
        "model": MODEL, "prompt": prompt, "max_tokens": 40, "seed": seed,
        "temperature": 0.0 if seed is None else 0.8, "return_token_ids": True,
        "structured_outputs": {"json": ITEM},
    }  # fmt: skip
    r = httpx.post(url + "/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    jsonschema.validate(json.loads(choice["text"]), ITEM)
    return list(choice["token_ids"])


def test_a_mixed_pool_serves_the_same_tokens_and_covers_a_missing_role(
    tmp_path: Path, make_engine: EngineFactory
) -> None:
    local = start_cluster(tmp_path, prefill=1, decode=1, mixed=True)
    try:
        url = local.gateway_url
        both = asyncio.run(complete(url, PROMPTS, SEEDS))
        json_both = [constrained(url, p, seed) for p, seed in zip(PROMPTS, SEEDS, strict=True)]
        local.procs["decode-0"].stop()  # drains and leaves membership
        deadline = time.monotonic() + 20
        while httpx.get(url + "/ready", timeout=5).json().get("decode") != 0:
            assert time.monotonic() < deadline, "the gateway still lists decode-0"
            time.sleep(0.2)
        assert httpx.get(url + "/ready", timeout=5).status_code == 200  # prefill-0 stands in
        prefill = next(s for s in local.specs if s.name == "prefill-0")
        base = f"http://127.0.0.1:{prefill.http_port}"
        decoded_before = metric_sum(base, "baton_decode_join_wait_seconds_count")
        alone = asyncio.run(complete(url, PROMPTS[:3], SEEDS[:3]))
        assert metric_sum(base, "baton_decode_join_wait_seconds_count") == decoded_before + 3
        json_alone = [constrained(url, p, seed) for p, seed in zip(PROMPTS, SEEDS, strict=True)]
        stats = httpx.get(base + "/stats", timeout=5).json()
        assert stats["mixed"] == 1.0 and stats["serving_decode"] == 0.0  # all finished
    finally:
        local.stop()
    engine = serving_reference(make_engine)
    for prompt, seed, tokens in zip(
        PROMPTS + PROMPTS[:3], SEEDS + SEEDS[:3], both + alone, strict=True
    ):
        params = SamplingParams(
            max_tokens=12, temperature=0.0 if seed is None else 0.8, seed=seed, ignore_eos=True
        )
        assert tokens == engine.generate([prompt], params)[0].token_ids
    for prompt, seed, a, b in zip(PROMPTS, SEEDS, json_both, json_alone, strict=True):
        params = SamplingParams(
            max_tokens=40, temperature=0.0 if seed is None else 0.8, seed=seed,
            constraint=Constraint.json_schema(ITEM),
        )  # fmt: skip
        expected = engine.generate([prompt], params)[0].token_ids
        assert a == expected and b == expected
