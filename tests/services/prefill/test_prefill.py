"""Prefill streams each layer to the store while it still computes, and the bytes it
sends are exactly the KV the in-process engine computes for the same prompt."""

from __future__ import annotations

import asyncio
import re

import httpx
import numpy as np
import pytest
import redis.asyncio as aioredis
import torch

from services.prefill.prefiller import PREFILL_CHUNK_TOKENS, Prefiller
from services.prefill.settings import PrefillSettings
from shared.cluster.auth import SECRET_HEADER
from shared.cluster.keys import Keys
from shared.config import BatonSettings
from shared.engine.sampling_params import SamplingParams
from shared.kvstore.client import KVStoreClient
from shared.serving.protocol import Accepted, decode_event
from shared.transport import Transport
from tests.conftest import EngineFactory
from tests.services.conftest import Cluster, serving_reference


@pytest.mark.asyncio(loop_scope="session")
async def test_layers_reach_the_store_before_the_first_token(
    cluster: Cluster, transports: dict[str, Transport], make_engine: EngineFactory
) -> None:
    prefill = next(s for s in cluster.local.specs if s.role == "prefill")
    engine = serving_reference(make_engine)
    layout = engine.layout
    prompt = [200 + (i * 7) % 40000 for i in range(1000)]  # 62 full blocks + a tail
    body = {
        "request_id": "prefill-streaming-test",
        "prompt_token_ids": prompt,
        "sampling": {"max_tokens": 2, "temperature": 0.0, "top_p": 1.0, "seed": 1},
    }
    redis = aioredis.from_url(cluster.local.redis.url)
    kv = KVStoreClient(transports["ucx"], redis, Keys("baton"), secret=cluster.local.secret)
    order: list[tuple[str, object]] = []
    try:
        async with (
            httpx.AsyncClient(timeout=120, headers=cluster.local.secret.headers()) as http,
            http.stream("POST", f"http://127.0.0.1:{prefill.http_port}/v1/prefill", json=body) as r,
        ):
            assert r.status_code == 200
            lines = r.aiter_lines()
            accepted = decode_event(await anext(lines))
            assert isinstance(accepted, Accepted)
            assert len(accepted.kv_ids) == -(-len(prompt) // layout.block_size)
            into = [np.zeros(layout.block_bytes, dtype=np.uint8) for _ in accepted.kv_ids]

            async def pull() -> None:
                async for layer in kv.stream(
                    accepted.kv_ids, into, num_layers=layout.num_layers, wait_s=60
                ):
                    order.append(("layer", layer))

            async def events() -> None:
                async for line in lines:
                    order.append(("event", decode_event(line).event))

            await asyncio.gather(pull(), events())
    finally:
        await kv.close()
        await redis.aclose()
    assert order.index(("layer", 0)) < order.index(("event", "first_token"))
    assert [e for e in order if e[0] == "event"] == [
        ("event", "first_token"),
        ("event", "committed"),
    ]

    # the store now holds exactly the KV the in-process engine computes
    engine.generate([prompt], SamplingParams(max_tokens=1, temperature=0))
    keys = engine.hasher.keys(prompt)
    assert [k.hex() for k in keys] == accepted.kv_ids[: len(keys)]
    local = engine.kv.local_hit(engine.new_request([*prompt, 1], SamplingParams()), len(keys))
    assert len(local) == len(keys)
    for slot, got in zip(local, into, strict=False):
        expected = engine.kv_cache.block(slot).contiguous().view(torch.uint8).numpy()
        assert np.array_equal(expected.reshape(-1), got)


def test_prefill_caps_prompt_chunks_unless_told_otherwise(monkeypatch: pytest.MonkeyPatch) -> None:
    """A long prompt is computed in chunks so prompts queued behind it join its steps."""

    def threshold() -> int:
        worker = Prefiller(PrefillSettings(), BatonSettings(transport="tcp"))
        return worker.engine_config().scheduler.long_prefill_token_threshold

    assert threshold() == PREFILL_CHUNK_TOKENS
    monkeypatch.setenv("BATON_LONG_PREFILL_TOKEN_THRESHOLD", "0")
    assert threshold() == 0


def test_internal_routes_refuse_calls_without_the_cluster_secret(cluster: Cluster) -> None:
    body = {
        "request_id": "no-secret",
        "prompt_token_ids": [1, 2, 3],
        "sampling": {"max_tokens": 2, "temperature": 0.0, "top_p": 1.0, "seed": 1},
    }
    for spec in cluster.local.specs:
        if spec.role not in ("prefill", "decode"):
            continue
        base = f"http://127.0.0.1:{spec.http_port}"
        path = "/v1/prefill" if spec.role == "prefill" else "/v1/decode"
        for headers in ({}, {SECRET_HEADER: "wrong-secret-of-some-length"}):
            r = httpx.post(base + path, json=body, headers=headers, timeout=10)
            assert r.status_code == 401, r.text
            assert r.json()["error"]["code"] == "unauthorized"
        metrics = httpx.get(base + "/metrics", timeout=10).text
        found = re.search(
            r'^baton_internal_auth_refused_total\{surface="http"\} (\S+)$', metrics, re.M
        )
        assert found is not None and float(found.group(1)) >= 2
        assert httpx.get(base + "/ready", timeout=10).status_code == 200  # probes stay open


def test_workers_connect_to_the_store_before_they_are_ready(cluster: Cluster) -> None:
    """Each prefill and decode opened its store connections at start-up: made during a
    first request instead, they held its prefill ~1 s on a 2-core host."""
    log_dir = cluster.local.log_dir
    assert log_dir is not None
    workers = [s for s in cluster.local.specs if s.role in ("prefill", "decode")]
    assert len(workers) == 4
    for spec in workers:
        text = (log_dir / f"{spec.name}.log").read_text()
        assert f"{spec.role}: connected to 1 KV store node(s)" in text, spec.name
