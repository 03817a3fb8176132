"""Context caching through the real cluster (redis-server, two KV store nodes, 2 prefill
+ 2 decode, the gateway): reused KV never changes a token, whatever the cache went
through (reuse across turns and instances, store evictions, a stale index entry, a
killed store node); different salts never share a block; instances that stop or die
leave no entries in the prompt index."""

from __future__ import annotations

import asyncio
import itertools
import random
import time
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import pytest
import redis

from services.gateway.gateway import tenant_salt
from services.prefill.prefiller import PREFILL_CHUNK_TOKENS
from shared.bench.scrape import metric_sum
from shared.cluster.keys import Keys
from shared.engine.sampling_params import SamplingParams
from shared.launcher import LocalCluster
from tests.conftest import EngineFactory
from tests.services.conftest import MODEL, start_cluster

KEYS = ("key-a", "key-b")
BLOCK = 16
STORE_GB = 60 * 737_280 / (1 << 30)  # 60 fp32 blocks per store node: 150 more evict


@dataclass(frozen=True)
class Turn:
    prompt: list[int]
    seed: int | None  # None: greedy
    key: str = KEYS[0]
    salt: str | None = None

    def params(self, max_tokens: int) -> SamplingParams:
        if self.seed is None:
            return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        return SamplingParams(
            max_tokens=max_tokens, temperature=0.9, top_p=0.9, seed=self.seed, ignore_eos=True
        )


@dataclass(frozen=True)
class Answer:
    tokens: list[int]
    cached: int


MAX_TOKENS = 24


async def ask(http: httpx.AsyncClient, url: str, turn: Turn) -> Answer:
    body: dict[str, object] = {
        "model": MODEL,
        "prompt": turn.prompt,
        "max_tokens": MAX_TOKENS,
        "ignore_eos": True,
        "return_token_ids": True,
        "temperature": 0.0 if turn.seed is None else 0.9,
    }
    if turn.seed is not None:
        body |= {"seed": turn.seed, "top_p": 0.9}
    if turn.salt is not None:
        body["cache_salt"] = turn.salt
    r = await http.post(
        url + "/v1/completions", json=body, headers={"Authorization": f"Bearer {turn.key}"}
    )
    assert r.status_code == 200, r.text
    j = r.json()
    return Answer(
        j["choices"][0]["token_ids"], j["usage"]["prompt_tokens_details"]["cached_tokens"]
    )


def conversations(n: int, turns: int, seed: int) -> list[list[Turn]]:
    """Turn prompts are filled in as answers arrive; here: first prompts and user parts."""
    rng = random.Random(seed)
    out = []
    for c in range(n):
        first = [rng.randrange(1000, 30000) for _ in range(rng.randrange(100, 200))]
        sample_seed = None if c % 2 == 0 else 100 + c
        out.append([Turn(first, sample_seed)] + [
            Turn([rng.randrange(1000, 30000) for _ in range(30)], sample_seed)
            for _ in range(turns - 1)
        ])  # fmt: skip
    return out


THINK_S = 0.3  # the answer's last blocks reach the store off the token path, in ms


def run_conversations(url: str, convs: list[list[Turn]]) -> list[list[tuple[Turn, Answer]]]:
    """Each conversation's turns in order (prompt = history + answer + new part, sent a
    short think time after the answer); conversations side by side."""

    async def one(http: httpx.AsyncClient, conv: list[Turn]) -> list[tuple[Turn, Answer]]:
        done: list[tuple[Turn, Answer]] = []
        history: list[int] = []
        for k, part in enumerate(conv):
            if k:
                await asyncio.sleep(THINK_S)
            turn = Turn(part.prompt if k == 0 else history + part.prompt, part.seed)
            answer = await ask(http, url, turn)
            done.append((turn, answer))
            history = turn.prompt + answer.tokens
        return done

    async def all_() -> list[list[tuple[Turn, Answer]]]:
        async with httpx.AsyncClient(timeout=300) as http:
            return list(await asyncio.gather(*(one(http, c) for c in convs)))

    return asyncio.run(all_())


def replay(url: str, turns: list[Turn]) -> list[Answer]:
    async def all_() -> list[Answer]:
        async with httpx.AsyncClient(timeout=300) as http:
            return [await ask(http, url, t) for t in turns]

    return asyncio.run(all_())


def expect(make_engine: EngineFactory, turns: list[Turn], batch: int = 8) -> list[list[int]]:
    """The in-process engine with prefix caching off, ``batch`` requests at a time (a
    row does not depend on its batch) in a pool that holds them."""
    engine = make_engine(
        kv_cache_bytes=256 << 20,
        enable_prefix_caching=False,
        long_prefill_token_threshold=PREFILL_CHUNK_TOKENS,
    )
    out: list[list[int]] = []
    for i in range(0, len(turns), batch):
        chunk = turns[i : i + batch]
        done = engine.generate([t.prompt for t in chunk], [t.params(MAX_TOKENS) for t in chunk])
        out += [c.token_ids for c in done]
    return out


@pytest.fixture(scope="module")
def caching(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    local = start_cluster(
        tmp_path_factory.mktemp("caching"),
        prefill=2,
        decode=2,
        kvstore=2,
        kvstore_gb=STORE_GB,
        BATON_GATEWAY_API_KEYS=",".join(KEYS),
        BATON_GATEWAY_CACHE_SALT_BY_API_KEY="true",
        BATON_GATEWAY_REAP_S="0.5",
    )
    try:
        yield local
    finally:
        local.stop()


def urls(local: LocalCluster, role: str) -> list[str]:
    return [
        f"http://127.0.0.1:{s.http_port}"
        for s in local.specs
        if s.role == role and local.procs[s.name].alive
    ]


def test_reuse_across_turns_and_instances_changes_no_token(
    caching: LocalCluster, make_engine: EngineFactory
) -> None:
    convs = conversations(3, 3, seed=1)  # ~60 blocks: the store keeps them all
    got = run_conversations(caching.gateway_url, convs)
    flat = [pair for conv in got for pair in conv]
    assert [a.tokens for _, a in flat] == expect(make_engine, [t for t, _ in flat])
    for conv in got:
        for (prev, prev_answer), (turn, answer) in itertools.pairwise(conv):
            # the previous prompt and the answer decode computed (all but its last token)
            reusable = (len(prev.prompt) + len(prev_answer.tokens) - 1) // BLOCK * BLOCK
            assert answer.cached == reusable, (len(turn.prompt), answer.cached)
    assert metric_sum(caching.gateway_url, 'baton_router_predictions_total{outcome="exact"}') > 0
    loaded = sum(metric_sum(u, "baton_kv_loaded_bytes_total") for u in urls(caching, "prefill"))
    assert loaded > 0  # some reuse crossed instances through the store


def test_store_evictions_and_a_killed_store_node_change_no_token(
    caching: LocalCluster, make_engine: EngineFactory
) -> None:
    convs = conversations(3, 2, seed=2)
    first = [pair for conv in run_conversations(caching.gateway_url, convs) for pair in conv]
    turns = [t for t, _ in first]
    expected = expect(make_engine, turns)
    assert [a.tokens for _, a in first] == expected
    # unrelated traffic pushes these blocks out of the small store nodes
    rng = random.Random(3)
    filler = [Turn([rng.randrange(1000, 30000) for _ in range(400)], None) for _ in range(7)]
    replay(caching.gateway_url, filler)
    stores = urls(caching, "kvstore")
    assert sum(metric_sum(u, "baton_kvstore_evictions_total") for u in stores) > 0
    assert [a.tokens for a in replay(caching.gateway_url, turns)] == expected
    victim = next(s.name for s in caching.specs if s.role == "kvstore")
    caching.procs[victim].kill()
    time.sleep(3.0)  # its membership expires (1.5 s): nobody routes to it or trusts its entries
    assert [a.tokens for a in replay(caching.gateway_url, turns)] == expected


def test_different_salts_and_api_keys_never_share_a_block(
    caching: LocalCluster, make_engine: EngineFactory
) -> None:
    rng = random.Random(4)
    prompt = [rng.randrange(1000, 30000) for _ in range(200)]
    variants = [
        Turn(prompt, None, key="key-a"),
        Turn(prompt, None, key="key-a"),  # the same tenant: reused
        Turn(prompt, None, key="key-b"),  # another API key: nothing shared
        Turn(prompt, None, key="key-a", salt="s1"),  # another salt under the same key
        Turn(prompt, None, key="key-a", salt="s1"),
    ]
    answers = replay(caching.gateway_url, variants)
    assert [a.cached for a in answers] == [0, 192, 0, 0, 192]
    (expected,) = expect(make_engine, variants[:1])
    assert all(a.tokens == expected for a in answers)


def test_a_stale_index_entry_costs_a_recompute_not_a_token(
    caching: LocalCluster, make_engine: EngineFactory
) -> None:
    rng = random.Random(5)
    turn = Turn([rng.randrange(1000, 30000) for _ in range(300)], seed=77)
    engine = make_engine()
    salt = tenant_salt(turn.key, None)
    keys = [k.hex() for k in engine.hasher.keys(turn.prompt, salt)]
    store = next(iter(live_store_ids(caching)))
    r = redis.Redis.from_url(caching.redis.url)
    prefix = Keys("baton")
    for key in keys:  # the index claims a live store node holds blocks nobody wrote
        r.sadd(prefix.block(key), store)
    r.close()
    stale_before = sum(
        metric_sum(u, "baton_prefix_cache_stale_total") for u in urls(caching, "prefill")
    )
    (answer,) = replay(caching.gateway_url, [turn])
    assert answer.tokens == expect(make_engine, [turn])[0]
    assert answer.cached == 0
    stale = sum(metric_sum(u, "baton_prefix_cache_stale_total") for u in urls(caching, "prefill"))
    assert stale > stale_before


def test_stopped_and_killed_instances_leave_no_index_entries(caching: LocalCluster) -> None:
    r = redis.Redis.from_url(caching.redis.url, decode_responses=True)
    prefix = Keys("baton")

    def holders() -> set[str]:
        return {str(m) for m in r.smembers(prefix.holders()) if r.scard(prefix.holds(str(m)))}

    ids = {
        s.name: instance_id(caching, s.name)
        for s in caching.specs
        if s.role in ("prefill", "decode")
    }
    assert set(ids.values()) <= holders()  # every worker published its local pool
    stopped, killed = "prefill-0", "decode-0"
    caching.procs[stopped].stop()  # a clean stop withdraws its entries
    assert ids[stopped] not in holders()
    caching.procs[killed].kill()  # a crash: the gateway clears them once it is gone
    deadline = time.monotonic() + 15
    while ids[killed] in holders() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert ids[killed] not in holders()
    for key in r.scan_iter(match=prefix.block("*")):
        assert not {ids[stopped], ids[killed]} & {str(m) for m in r.smembers(key)}
    r.close()


def live_store_ids(local: LocalCluster) -> set[str]:
    r = redis.Redis.from_url(local.redis.url, decode_responses=True)
    try:
        return {str(m) for m in r.smembers(Keys("baton").members("kvstore"))}
    finally:
        r.close()


def instance_id(local: LocalCluster, name: str) -> str:
    spec = next(s for s in local.specs if s.name == name)
    stats = httpx.get(f"http://127.0.0.1:{spec.http_port}/ready", timeout=10).json()
    return str(stats["instance_id"])
