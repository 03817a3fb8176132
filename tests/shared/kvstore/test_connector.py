"""The KV-store connector between real engines and a fake store: prefill streams its
layers into a put, decode loads them and continues, later prompts load cached
prefixes and answers, and every failure of the store ends in a recompute with the
same tokens as one engine alone."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import numpy as np
import pytest
import torch
from prometheus_client import CollectorRegistry

from shared.engine.engine import Engine
from shared.engine.engine_loop import EngineLoop, next_output
from shared.engine.outputs import RequestOutput
from shared.engine.request import CacheHit, Request, RequestId, SampledToken
from shared.engine.sampling_params import SamplingParams
from shared.errors import KVUnavailableError
from shared.kvstore.connector import KVStoreConnector, StorePlan
from shared.kvstore.connector_metrics import ConnectorMetrics
from shared.kvstore.pull_cost import PullPolicy
from shared.kvstore.transfers import PutJob
from tests.conftest import EngineFactory
from tests.shared.kvstore.fake_store import FakeKVStoreClient

GREEDY = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
SEEDED = SamplingParams(max_tokens=20, temperature=0.9, top_p=0.95, seed=11, ignore_eos=True)
TEXT = "The harbour lights came on one by one as the fishing boats returned. " * 6
OTHER_TEXT = "Snow fell all night on the quiet village below the mountain pass. " * 6


class Node:
    """An engine with a KV-store connector over the shared fake store, on its loop."""

    def __init__(
        self,
        engine: Engine,
        connector: KVStoreConnector,
        loop: EngineLoop,
        registry: CollectorRegistry,
    ):
        self.engine = engine
        self.connector = connector
        self.loop = loop
        self.registry = registry
        self.last_plan = StorePlan()

    def stale(self) -> float:
        return self.registry.get_sample_value("baton_prefix_cache_stale_total") or 0.0

    async def prefill(self, prompt: list[int], params: SamplingParams, rid: str) -> RequestOutput:
        engine = self.engine
        req = engine.new_request(prompt, _first_only(params), request_id=rid)
        plan = await self.connector.plan_prefill(req)
        outputs = self.loop.subscribe(rid)
        await self.loop.call(lambda e: e.add(req, kv_transfer=plan, detokenize=False))
        out = await asyncio.wait_for(next_output(outputs), 120)
        assert plan.put_job is not None
        await asyncio.wait_for(asyncio.shield(plan.put_job.committed), 60)
        self.last_plan = plan
        return out

    async def decode(
        self, prompt: list[int], params: SamplingParams, rid: str, store_ids: list[str], first: int
    ) -> list[int]:
        req = self.engine.new_request(prompt, params, request_id=rid)
        plan = self.connector.plan_decode(store_ids, len(prompt), wait_s=60)
        outputs = self.loop.subscribe(rid)
        await self.loop.call(
            lambda e: e.add(req, kv_transfer=plan, awaiting_first_token=True, detokenize=False)
        )
        await self.loop.call(lambda e: e.supply_first_token(rid, SampledToken(first)))
        tokens = [first]
        while True:
            out = await asyncio.wait_for(next_output(outputs), 120)
            tokens += out.new_token_ids
            if out.finished:
                return tokens


async def two_turns(
    p: Node, d: Node, turn1: list[int], params: SamplingParams, follow_up: list[int]
) -> tuple[list[int], list[int]]:
    """Turn 1 through prefill ``p`` and decode ``d``; returns (its answer, turn 2's
    prompt: turn 1, the answer and ``follow_up``)."""
    first = await p.prefill(turn1, params, "t1-p")
    answer = await d.decode(turn1, params, "t1-d", p.last_plan.put_ids, first.new_token_ids[0])
    return answer, turn1 + answer + follow_up


def _first_only(params: SamplingParams) -> SamplingParams:
    return SamplingParams(
        max_tokens=1, temperature=params.temperature, top_p=params.top_p, seed=params.seed
    )


@contextlib.asynccontextmanager
async def node(
    make_engine: EngineFactory,
    store: FakeKVStoreClient,
    *,
    policy: PullPolicy = "always",
    caching: bool = True,
    layerwise: Callable[[], bool] | None = None,
    staging_blocks: int = 64,
    **kw: int,
) -> AsyncIterator[Node]:
    registry = CollectorRegistry()
    connector = KVStoreConnector(
        store,  # type: ignore[arg-type]
        ConnectorMetrics(registry),
        caching=caching,
        pull_policy=policy,
        load_timeout_s=60,
        layerwise=layerwise,
        staging_blocks=staging_blocks,
    )
    engine = make_engine(connector=connector, enable_prefix_caching=caching, **kw)
    loop = EngineLoop(engine)
    loop.start()
    connector.start(asyncio.get_running_loop(), loop.wake)
    try:
        yield Node(engine, connector, loop, registry)
    finally:
        await loop.stop()
        await connector.close()


class FakeWatermarks:
    """Stands in for the Redis watermarks: a replicating request keeps its own."""

    def __init__(self) -> None:
        self.tokens: dict[str, int] = {}

    async def advance(self, request_id: str, instance_id: str, tokens: int, ids: object) -> None:
        self.tokens[request_id] = tokens

    async def drop(self, request_id: str) -> None:
        self.tokens.pop(request_id, None)


async def first_token_held(
    p: Node, prompt: list[int], rid: str = "p1"
) -> tuple[StorePlan, PutJob, RequestOutput]:
    """Prefill ``prompt`` as the prefill role does (staged whole blocks wait for the first
    token: ``send_staged`` is left to the caller) up to its first token."""
    req = p.engine.new_request(prompt, _first_only(GREEDY), request_id=rid)
    plan = await p.connector.plan_prefill(req, hold_staged=True)
    job = plan.put_job
    assert job is not None
    outputs = p.loop.subscribe(rid)
    await p.loop.call(lambda e: e.add(req, kv_transfer=plan, detokenize=False))
    return plan, job, await asyncio.wait_for(next_output(outputs), 120)


def fake_store(make_engine: EngineFactory) -> FakeKVStoreClient:
    layout = make_engine(kv_cache_bytes=1 << 20).layout
    return FakeKVStoreClient(layout.block_bytes, layout.num_layers)


def reference(make_engine: EngineFactory, prompt: list[int], params: SamplingParams) -> list[int]:
    return make_engine().generate([prompt], params)[0].token_ids


@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
async def test_prefill_to_decode_through_the_store_is_token_exact(
    make_engine: EngineFactory, params: SamplingParams
) -> None:
    store = fake_store(make_engine)
    prompt = make_engine().tokenizer.encode(TEXT)
    expected = reference(make_engine, prompt, params)
    async with (
        node(make_engine, store, max_num_batched_tokens=48) as p,  # chunked over steps
        node(make_engine, store) as d,
    ):
        first = await p.prefill(prompt, params, "p1")
        ids = p.last_plan.put_ids
        tokens = await d.decode(prompt, params, "d1", ids, first.new_token_ids[0])
        assert tokens == expected
        # every layer of every block went out, layer by layer, and the put committed
        assert set(ids) <= store.committed()
        layered = [w for w in store.node.writes if w[1] is not None]
        assert len(layered) == len(ids) * p.engine.layout.num_layers
        # decode's prompt+answer blocks were cached under their content keys (off the
        # token path: everything but the last token was computed); the request's slots
        # came back once that was written
        await asyncio.sleep(0.2)
        computed = prompt + tokens[:-1]
        full = len(computed) // p.engine.layout.block_size
        assert full > len(prompt) // p.engine.layout.block_size
        keys = {k.hex() for k in p.engine.hasher.keys(computed)}
        assert keys <= store.committed()
        assert await d.loop.call(lambda e: e.kv.num_free == e.kv.num_slots)


@pytest.mark.parametrize("staging_blocks", [64, 0], ids=["staged", "in-place"])
async def test_steps_on_every_core_send_whole_blocks_once_the_prompt_is_done(
    make_engine: EngineFactory, staging_blocks: int
) -> None:
    """With no core left for transfers, a chunked prompt's blocks go in one whole-block
    write after its last chunk (none while a later chunk computes), from staging buffers
    where enough are free; decode continues token-exact from them."""
    store = fake_store(make_engine)
    prompt = make_engine().tokenizer.encode(TEXT)
    expected = reference(make_engine, prompt, GREEDY)
    async with (
        node(
            make_engine, store, max_num_batched_tokens=48, layerwise=lambda: False,
            staging_blocks=staging_blocks,
        ) as p,
        node(make_engine, store) as d,
    ):  # fmt: skip
        first = await p.prefill(prompt, GREEDY, "p1")
        ids = p.last_plan.put_ids
        assert all(w[1] is None for w in store.node.writes)  # no layer ranges
        assert len(store.node.write_calls) == 1  # all blocks at once, at the end
        tokens = await d.decode(prompt, GREEDY, "d1", ids, first.new_token_ids[0])
        assert tokens == expected
        staging = p.connector.tasks.staging
        if staging is not None:  # every staging buffer came back
            assert staging.take_many(staging_blocks) is not None


@pytest.mark.parametrize("staging_blocks", [64, 0], ids=["staged", "in-place"])
async def test_held_staged_blocks_leave_after_the_first_token(
    make_engine: EngineFactory, staging_blocks: int
) -> None:
    """The prefill role holds a step's staged whole blocks until its first token has left
    (their sends would slow that token), though the engine ended the request with that
    token; blocks read from the pool in place are never held (the step waits for
    them), and decode continues token-exact either way."""
    store = fake_store(make_engine)
    prompt = make_engine().tokenizer.encode(TEXT)
    expected = reference(make_engine, prompt, GREEDY)
    async with (
        node(make_engine, store, layerwise=lambda: False, staging_blocks=staging_blocks) as p,
        node(make_engine, store) as d,
    ):
        plan, job, first = await first_token_held(p, prompt)
        await asyncio.sleep(0.1)  # time enough for any write to be sent
        if staging_blocks:
            assert store.node.writes == [] and not job.committed.done()
        job.send_staged.set()
        await asyncio.wait_for(asyncio.shield(job.committed), 60)
        assert store.node.writes
        tokens = await d.decode(prompt, GREEDY, "d1", plan.put_ids, first.new_token_ids[0])
        assert tokens == expected


async def test_whole_blocks_held_for_the_first_token_are_copied_once_it_is_out(
    make_engine: EngineFactory,
) -> None:
    """A step that holds its staged whole blocks for its first token hands that token out
    before it copies them: with ``defer_copies`` the copies wait for ``flush_copies`` (or
    the engine's next step, which makes them first), so nothing can be written before,
    even with ``send_staged`` set; then the store gets exactly the engine's own KV."""
    store = fake_store(make_engine)
    tokenizer = make_engine().tokenizer
    connector = KVStoreConnector(
        store,  # type: ignore[arg-type]
        ConnectorMetrics(CollectorRegistry()),
        caching=True,
        load_timeout_s=60,
        layerwise=lambda: False,
    )
    engine = make_engine(connector=connector, enable_prefix_caching=True)
    connector.start(asyncio.get_running_loop(), lambda: None)
    try:
        for flush, text in (("flush_copies", TEXT), ("next step", OTHER_TEXT)):
            prompt, rid = tokenizer.encode(text), f"p-{flush}"
            req = engine.new_request(prompt, _first_only(GREEDY), request_id=rid)
            plan = await connector.plan_prefill(req, hold_staged=True)
            job = plan.put_job
            assert job is not None
            engine.add(req, kv_transfer=plan, detokenize=False)
            outputs: list[RequestOutput] = []
            while not outputs:
                outputs = await asyncio.to_thread(engine.step, defer_copies=True)
            assert outputs[0].new_token_ids and outputs[0].finished
            job.send_staged.set()  # the token is out: only the deferred copies hold them
            await asyncio.sleep(0.2)  # time enough for a write to be sent
            assert not job.committed.done()
            writes = len(store.node.writes)
            if flush == "flush_copies":
                await asyncio.to_thread(engine.flush_copies)
            else:
                assert await asyncio.to_thread(engine.step) == []
            await asyncio.wait_for(asyncio.shield(job.committed), 60)
            assert len(store.node.writes) > writes
    finally:
        await connector.close()
    solo = make_engine()
    solo.generate([prompt], SamplingParams(max_tokens=1, temperature=0))
    keys = solo.hasher.keys(prompt)
    hits = solo.kv.local_hit(solo.new_request([*prompt, 1], GREEDY), len(keys))
    for slot, block_id in zip(hits, plan.put_ids, strict=False):
        expected = solo.kv_cache.block(slot).contiguous().view(torch.uint8).numpy().reshape(-1)
        assert np.array_equal(store.node.blocks[block_id].data, expected)


async def test_store_bytes_equal_the_engines_own_kv(make_engine: EngineFactory) -> None:
    store = fake_store(make_engine)
    prompt = make_engine().tokenizer.encode(TEXT)
    async with node(make_engine, store, max_num_batched_tokens=40) as p:
        await p.prefill(prompt, GREEDY, "p1")
        ids = p.last_plan.put_ids
    solo = make_engine()
    solo.generate([prompt], SamplingParams(max_tokens=1, temperature=0))
    keys = solo.hasher.keys(prompt)
    hits = solo.kv.local_hit(solo.new_request([*prompt, 1], GREEDY), len(keys))
    assert len(hits) == len(keys)
    for slot, block_id in zip(hits, ids, strict=False):
        expected = solo.kv_cache.block(slot).contiguous().view(torch.uint8).numpy().reshape(-1)
        assert np.array_equal(store.node.blocks[block_id].data, expected)


async def test_a_cached_prefix_is_loaded_layer_by_layer_and_only_new_blocks_written(
    make_engine: EngineFactory,
) -> None:
    store = fake_store(make_engine)
    tok = make_engine().tokenizer
    base = tok.encode(TEXT)
    longer = base + tok.encode(" Then the wind turned and the rain began to fall.")
    expected = reference(make_engine, longer, GREEDY)[0]
    async with node(make_engine, store) as first:
        await first.prefill(base, GREEDY, "warm")
    writes_before = len(store.node.writes)
    async with node(make_engine, store) as fresh:  # an empty local pool: all from the store
        out = await fresh.prefill(longer, GREEDY, "hit")
    bs = fresh.engine.layout.block_size
    cached = (len(base) // bs) * bs
    assert out.cache_hit == CacheHit(local_tokens=0, external_tokens=cached)
    assert out.new_token_ids[0] == expected
    new_blocks = -(-len(longer) // bs) - len(base) // bs
    assert len(store.node.writes) - writes_before == new_blocks * fresh.engine.layout.num_layers
    assert store.streams == 1


async def test_an_index_that_said_none_is_held_spares_the_lookup(
    make_engine: EngineFactory,
) -> None:
    """The gateway's lookup as it routed the prompt found none of it in the store:
    prefill does not ask again (a block indexed since is recomputed, token-exact); a
    prompt it found held is looked up and loaded as before."""
    store = fake_store(make_engine)
    tok = make_engine().tokenizer
    base = tok.encode(TEXT)
    longer = base + tok.encode(" Then the wind turned and the rain began to fall.")
    expected = reference(make_engine, longer, GREEDY)[0]
    async with node(make_engine, store) as first:
        await first.prefill(base, GREEDY, "warm")
    async with node(make_engine, store) as fresh:  # an empty local pool
        req = fresh.engine.new_request(longer, _first_only(GREEDY), request_id="said-none")
        plan = await fresh.connector.plan_prefill(req, indexed_tokens=0)
        assert plan.lease is None and not plan.load_ids
        outputs = fresh.loop.subscribe("said-none")
        await fresh.loop.call(lambda e: e.add(req, kv_transfer=plan, detokenize=False))
        out = await asyncio.wait_for(next_output(outputs), 120)
        assert out.new_token_ids == [expected] and out.cache_hit.tokens == 0
        assert plan.put_job is not None
        await asyncio.wait_for(asyncio.shield(plan.put_job.committed), 60)
    async with node(make_engine, store) as fresh:
        req = fresh.engine.new_request(longer, _first_only(GREEDY), request_id="said-some")
        plan = await fresh.connector.plan_prefill(req, indexed_tokens=len(base))
        assert plan.load_ids
        await fresh.connector.abandon(plan)
    assert store.streams == 0


async def test_local_blocks_are_not_loaded_again(make_engine: EngineFactory) -> None:
    store = fake_store(make_engine)
    prompt = make_engine().tokenizer.encode(TEXT)
    async with node(make_engine, store) as p:
        await p.prefill(prompt, GREEDY, "a")
        out = await p.prefill([*prompt, 42, 43], GREEDY, "b")
    assert out.cache_hit.external_tokens == 0 and out.cache_hit.local_tokens > 0
    assert store.streams == 0


async def test_a_refused_put_fails_the_put_not_the_prompt(make_engine: EngineFactory) -> None:
    """The put's reservation is not on the way to the first token: a store that refuses
    it fails the put (its ``committed``), the prompt still computes its token, and the
    cached prefix's lease taken beside the put ends with the request."""
    store = fake_store(make_engine)
    prompt = make_engine().tokenizer.encode(TEXT)
    longer = [*prompt, 7, 8]
    expected = reference(make_engine, longer, GREEDY)[0]
    async with node(make_engine, store) as p:
        await p.prefill(prompt, GREEDY, "warm")
        assert not store.node.leases  # the warm prefill's lease ended with it
        store.refuse_puts = True
        req = p.engine.new_request(longer, _first_only(GREEDY), request_id="b")
        plan = await p.connector.plan_prefill(req)
        assert plan.put_job is not None and plan.lease is not None
        outputs = p.loop.subscribe("b")
        await p.loop.call(lambda e: e.add(req, kv_transfer=plan, detokenize=False))
        out = await asyncio.wait_for(next_output(outputs), 120)
        assert out.new_token_ids == [expected]
        with pytest.raises(KVUnavailableError):
            await asyncio.wait_for(asyncio.shield(plan.put_job.committed), 60)
    assert not store.node.leases


@pytest.mark.parametrize("layerwise", [True, False], ids=["layerwise", "whole"])
async def test_the_first_token_does_not_wait_for_the_puts_reservation(
    make_engine: EngineFactory, layerwise: bool
) -> None:
    """The prompt computes while its put's reservation is still on its way (the engine
    stages every block meanwhile); once the reservation comes back the blocks the store
    lacks are written and committed, and a decode that pulls them is token-exact. Blocks
    the store held already (the warm prompt's) are not written again."""
    store = fake_store(make_engine)
    prompt = make_engine().tokenizer.encode(TEXT)
    longer = prompt + make_engine().tokenizer.encode(" And then the harbour went dark.")
    expected = reference(make_engine, longer, GREEDY)
    async with (
        node(make_engine, store, layerwise=lambda: layerwise) as p,
        node(make_engine, store) as d,
    ):
        await p.prefill(prompt, GREEDY, "warm")
        held, warm_writes = set(store.committed()), list(store.node.writes)
        store.reserving.clear()
        req = p.engine.new_request(longer, _first_only(GREEDY), request_id="b")
        plan = await p.connector.plan_prefill(req)
        job = plan.put_job
        assert job is not None and not job.reserved.done()
        outputs = p.loop.subscribe("b")
        await p.loop.call(lambda e: e.add(req, kv_transfer=plan, detokenize=False))
        out = await asyncio.wait_for(next_output(outputs), 120)
        assert out.new_token_ids == expected[:1]
        assert not job.reserved.done()  # the token came first
        assert not store.node.writes[len(warm_writes) :]  # nothing before the reservation
        store.reserving.set()
        await asyncio.wait_for(asyncio.shield(job.committed), 60)
        assert set(job.ids) <= store.committed()
        written = {i for i, _ in store.node.writes[len(warm_writes) :]}
        assert written == set(job.ids) - held
        tokens = await d.decode(longer, GREEDY, "b-d", job.ids, out.new_token_ids[0])
    assert tokens == expected


async def test_a_stale_index_entry_is_recomputed_with_the_same_token(
    make_engine: EngineFactory,
) -> None:
    store = fake_store(make_engine)
    prompt = make_engine().tokenizer.encode(TEXT)
    expected = reference(make_engine, prompt, GREEDY)[0]
    async with node(make_engine, store) as warm:
        await warm.prefill(prompt, GREEDY, "warm")
    ids = warm.last_plan.put_ids
    store.evict_keep_index(ids[2:])  # the index still claims them
    async with node(make_engine, store) as p:
        out = await p.prefill(prompt, GREEDY, "stale")
        stale = p.stale()
    assert out.new_token_ids[0] == expected
    assert out.cache_hit.external_tokens == 2 * p.engine.layout.block_size  # what is left
    assert stale == 1
    full = ids[: len(prompt) // p.engine.layout.block_size]  # the tail id is request-scoped
    assert set(full) <= store.committed()  # the prefill rewrote what was lost


async def test_a_load_that_breaks_mid_step_is_recomputed(make_engine: EngineFactory) -> None:
    store = fake_store(make_engine)
    prompt = make_engine().tokenizer.encode(TEXT)
    expected = reference(make_engine, prompt, GREEDY)[0]
    async with node(make_engine, store) as warm:
        await warm.prefill(prompt[:-5], GREEDY, "warm")
    store.break_streams_after = 7
    async with node(make_engine, store) as p:
        out = await p.prefill(prompt, GREEDY, "broken")
        stale = p.stale()
    assert out.new_token_ids[0] == expected
    assert out.cache_hit == CacheHit()  # recomputed: nothing was reused in the end
    assert stale == 1
    # what the put wrote after the failed step is the engine's own KV, not garbage
    solo = make_engine()
    solo.generate([prompt], SamplingParams(max_tokens=1, temperature=0))
    keys = solo.hasher.keys(prompt)
    slots = solo.kv.local_hit(solo.new_request([*prompt, 1], GREEDY), len(keys))
    for slot, key in zip(slots, keys, strict=True):
        expected_bytes = solo.kv_cache.block(slot).contiguous().view(torch.uint8).numpy()
        assert np.array_equal(store.node.blocks[key.hex()].data, expected_bytes.reshape(-1))


async def prefilled(
    make_engine: EngineFactory,
) -> tuple[FakeKVStoreClient, list[int], list[int], tuple[list[str], int]]:
    """TEXT prefilled (seeded) into a fresh fake store: the store, the prompt, the
    in-process engine's tokens, and what decode is handed (store ids, first token)."""
    store = fake_store(make_engine)
    prompt = make_engine().tokenizer.encode(TEXT)
    expected = reference(make_engine, prompt, SEEDED)
    async with node(make_engine, store) as p:
        first = await p.prefill(prompt, SEEDED, "p")
    return store, prompt, expected, (p.last_plan.put_ids, first.new_token_ids[0])


async def test_decode_recomputes_when_its_prompt_cannot_be_loaded(
    make_engine: EngineFactory,
) -> None:
    store, prompt, expected, (ids, first) = await prefilled(make_engine)
    store.break_streams_after = 3
    async with node(make_engine, store) as d:
        tokens = await d.decode(prompt, SEEDED, "d", ids, first)
        stale = d.stale()
    assert tokens == expected and stale == 1


async def test_the_next_turn_reuses_the_previous_answer(make_engine: EngineFactory) -> None:
    store = fake_store(make_engine)
    tok = make_engine().tokenizer
    turn1 = tok.encode(TEXT)
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    async with node(make_engine, store) as p, node(make_engine, store) as d:
        answer, turn2 = await two_turns(p, d, turn1, params, tok.encode(" And after that?"))
        await asyncio.sleep(0.2)  # decode caches prompt+answer off the token path
    expected = reference(make_engine, turn2, params)
    async with node(make_engine, store) as p2, node(make_engine, store) as d2:
        first2 = await p2.prefill(turn2, params, "t2-p")
        bs = p2.engine.layout.block_size
        # everything decode computed (all but the answer's last token) is reused
        assert first2.cache_hit.external_tokens == (len(turn1) + len(answer) - 1) // bs * bs
        tokens = await d2.decode(
            turn2, params, "t2-d", p2.last_plan.put_ids, first2.new_token_ids[0]
        )
    assert tokens == expected


async def test_recompute_policy_never_pulls(make_engine: EngineFactory) -> None:
    store = fake_store(make_engine)
    prompt = make_engine().tokenizer.encode(TEXT)
    async with node(make_engine, store) as warm:
        await warm.prefill(prompt, GREEDY, "warm")
    async with node(make_engine, store, policy="never") as p:
        out = await p.prefill(prompt, GREEDY, "never")
    assert out.cache_hit == CacheHit() and store.streams == 0


async def test_decode_loads_only_the_blocks_its_pool_lacks(make_engine: EngineFactory) -> None:
    store = fake_store(make_engine)
    tok = make_engine().tokenizer
    turn1 = tok.encode(TEXT)
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    async with node(make_engine, store) as p, node(make_engine, store) as d:
        answer, turn2 = await two_turns(p, d, turn1, params, tok.encode(" Go on."))
        first2 = await p.prefill(turn2, params, "t2-p")
        tokens = await d.decode(turn2, params, "t2-d", p.last_plan.put_ids, first2.new_token_ids[0])
    bs = d.engine.layout.block_size
    held = (len(turn1) + len(answer) - 1) // bs  # decode computed these for turn 1
    assert len(store.streamed[-1]) == -(-len(turn2) // bs) - held
    assert tokens == reference(make_engine, turn2, params)


async def test_without_caching_nothing_is_shared_or_looked_up(make_engine: EngineFactory) -> None:
    store = fake_store(make_engine)
    prompt = make_engine().tokenizer.encode(TEXT)
    async with node(make_engine, store, caching=False) as p:
        await p.prefill(prompt, GREEDY, "a")
        first_ids = p.last_plan.put_ids
        out = await p.prefill(prompt, GREEDY, "b")
        second_ids = p.last_plan.put_ids
    keys = {k.hex() for k in p.engine.hasher.keys(prompt)}
    assert not keys & set(first_ids) and not set(first_ids) & set(second_ids)
    assert out.cache_hit == CacheHit() and store.streams == 0


async def test_a_preempted_decode_spills_to_the_store_and_resumes_from_it(
    make_engine: EngineFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No host swap space and a decode pool too small for its streams: a preempted
    request's KV stays in the store (its replicated blocks, and the ones replication had
    not staged yet, staged by the spill before its slots go), it resumes by loading
    prompt *and* answer blocks, and every stream, greedy and seeded, ends with the
    tokens of one engine alone."""
    store = fake_store(make_engine)
    tok = make_engine().tokenizer
    prompts = [tok.encode(f"Story {i}. " + TEXT[:150]) for i in range(4)]
    params = [
        SamplingParams(max_tokens=64, temperature=0.8 if i % 2 else 0.0, seed=i, ignore_eos=True)
        for i in range(4)
    ]
    expected = [reference(make_engine, p, sp) for p, sp in zip(prompts, params, strict=True)]
    async with node(make_engine, store) as p:
        firsts, ids = [], []
        for i, (prompt, sp) in enumerate(zip(prompts, params, strict=True)):
            firsts.append((await p.prefill(prompt, sp, f"p{i}")).new_token_ids[0])
            ids.append(p.last_plan.put_ids)
    block_bytes = store.block_bytes
    # 14 blocks of 16 tokens; the four streams need 4 x 6
    async with node(make_engine, store, kv_cache_bytes=14 * block_bytes, swap_space_bytes=0) as d:
        staged = spy_on_spills(d, monkeypatch)
        tokens = await asyncio.gather(
            *(
                d.decode(prompt, sp, f"d{i}", ids[i], firsts[i])
                for i, (prompt, sp) in enumerate(zip(prompts, params, strict=True))
            )
        )
        snap = d.engine.snapshot()
    bs = d.engine.layout.block_size
    assert tokens == expected
    # replication lags a step behind; a spill stages every completed block before the
    # slots go (the fake store's staging buffers never run out here). A request
    # preempted before it completed a block past its prompt has nothing to keep: it
    # recomputes (which one is preempted when depends on the streams' timing)
    kept = [s for s in staged if s.kept]
    assert len(kept) == snap.swap.spills_out > 0
    assert all(s.after == s.completed for s in staged)
    assert any(s.after > s.before for s in kept)
    assert all(s.after * bs <= s.prompt_tokens for s in staged if not s.kept)
    assert snap.swap.recomputes_no_room == len(staged) - len(kept)
    assert snap.preemptions > 0 and snap.swap.spills_in > 0
    assert snap.swap.spilled_tokens_in > 0 and snap.swap.swaps_out == 0
    # answer blocks came back: ids past every prompt's own blocks (counting blocks would
    # not do: a block a request completed early holds its prompt's tail and the answer's
    # first tokens, and a prefix still cached in the pool is not streamed again)
    prompt_ids = {block_id for put in ids for block_id in put}
    assert any(set(s) - prompt_ids for s in store.streamed)
    assert d.engine.kv.num_free == d.engine.kv.num_slots
    assert not d.connector.replicator.replications


@dataclass(frozen=True)
class Staged:
    """One spill: the request's completed blocks, how many were staged for the store
    before the spill and after it, its prompt, and whether the store keeps its KV."""

    completed: int
    before: int
    after: int
    prompt_tokens: int
    kept: bool


def spy_on_spills(d: Node, monkeypatch: pytest.MonkeyPatch) -> list[Staged]:
    replicator = d.connector.replicator
    spill = replicator.spill
    bs = d.engine.layout.block_size
    seen: list[Staged] = []

    def spying(req: Request, stored: Callable[[Request], list[str] | None]) -> bool:
        rep = replicator.replications.get(req.request_id)
        before = rep.staged if rep is not None else 0
        kept = spill(req, stored)
        rep = replicator.replications.get(req.request_id)
        after = rep.staged if rep is not None else 0
        completed = req.num_computed_tokens // bs
        seen.append(Staged(completed, before, after, req.num_prompt_tokens, kept))
        return kept

    monkeypatch.setattr(replicator, "spill", spying)
    return seen


def resuming_past_the_first_token(e: Engine) -> list[RequestId]:
    """Requests loading KV that decoded here before: spilled ones resuming (a request
    that only loaded its prompt and gave its slots up reloads with its first token)."""
    return [r.request_id for r in e.scheduler.loads.loading.values() if len(r.output_token_ids) > 1]


async def test_a_spilled_request_aborted_while_it_loads_keeps_its_watermark(
    make_engine: EngineFactory,
) -> None:
    """A client leaves while its spilled stream loads its KV back: the load is cancelled,
    the replication ends (nothing leaks) and how far its KV is stored stays readable for
    an instance that resumes it; the other streams keep their tokens."""
    store = fake_store(make_engine)
    tok = make_engine().tokenizer
    prompts = [tok.encode(f"Story {i}. " + TEXT[:150]) for i in range(4)]
    params = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
    async with node(make_engine, store) as p:
        firsts, ids = [], []
        for i, prompt in enumerate(prompts):
            firsts.append((await p.prefill(prompt, params, f"p{i}")).new_token_ids[0])
            ids.append(p.last_plan.put_ids)
    # prompt loads (and reloads) pass; spilled requests' resumes, which load more, wait
    longest_prompt = max(len(x) for x in ids)
    store.hold_streams = lambda stream_ids: len(stream_ids) > longest_prompt
    async with node(
        make_engine, store, kv_cache_bytes=14 * store.block_bytes, swap_space_bytes=0
    ) as d:
        d.connector.tasks.watermarks = FakeWatermarks()  # type: ignore[assignment]
        streams = [
            asyncio.create_task(d.decode(prompt, params, f"d{i}", ids[i], firsts[i]))
            for i, prompt in enumerate(prompts)
        ]
        async with asyncio.timeout(120):
            while not store.held:
                await asyncio.sleep(0.05)
        spilled = await d.loop.call(resuming_past_the_first_token)
        assert spilled  # one resume or more, all held
        rid = spilled[0]
        assert await d.loop.call(lambda e: e.abort(rid))
        store.gate.set()
        streams.pop(int(rid.removeprefix("d"))).cancel()
        tokens = await asyncio.gather(*streams)
        mark = await d.connector.final_watermark(rid)
    others = [x for i, x in enumerate(prompts) if f"d{i}" != rid]
    for t, prompt in zip(tokens, others, strict=True):
        assert t == reference(make_engine, prompt, params)
    assert not d.connector.replicator.replications
    bs = d.engine.layout.block_size
    aborted = prompts[int(rid.removeprefix("d"))]
    assert mark is not None and mark.tokens >= len(aborted) // bs * bs
    assert d.engine.kv.num_free == d.engine.kv.num_slots


async def test_whole_blocks_held_for_the_first_token_never_block_the_next_chunk(
    make_engine: EngineFactory,
) -> None:
    """A put of whole blocks held until the first token, for a prompt in 3-block chunks
    with 4 staging buffers: the second chunk's blocks find too few free, and are copied
    out of the pool rather than sent from it (the step would wait for a send queued
    behind the held first chunk, which waits for the token the step computes)."""
    store = fake_store(make_engine)
    prompt = make_engine().tokenizer.encode(TEXT)[:90]
    expected = reference(make_engine, prompt, GREEDY)
    async with (
        node(make_engine, store, max_num_batched_tokens=48, staging_blocks=4) as p,
        node(make_engine, store) as d,
    ):
        req = p.engine.new_request(prompt, _first_only(GREEDY), request_id="p1")
        plan = await p.connector.plan_prefill(req, whole_blocks=True, hold_staged=True)
        job = plan.put_job
        assert job is not None
        outputs = p.loop.subscribe("p1")
        await p.loop.call(lambda e: e.add(req, kv_transfer=plan, detokenize=False))
        first = await asyncio.wait_for(next_output(outputs), 60)
        assert store.node.writes == []  # all held
        job.send_staged.set()
        await asyncio.wait_for(asyncio.shield(job.committed), 60)
        tokens = await d.decode(prompt, GREEDY, "d1", plan.put_ids, first.new_token_ids[0])
        assert tokens == expected


async def test_a_decode_load_counts_as_in_flight_until_it_ends(make_engine: EngineFactory) -> None:
    """What a decode stream sends keepalives on while its engine, with nothing else
    to run, steps no more: the connector says the request's load is in flight while
    the store holds it back, and not once it landed."""
    store, prompt, expected, (ids, first) = await prefilled(make_engine)
    store.hold_streams = lambda stream_ids: True
    async with node(make_engine, store) as d:
        assert not d.connector.loading(RequestId("d"))
        decoding = asyncio.ensure_future(d.decode(prompt, SEEDED, "d", ids, first))
        while not store.held:
            await asyncio.sleep(0.01)
        steps = d.loop.stats.steps
        await asyncio.sleep(0.3)
        assert d.connector.loading(RequestId("d")) and d.loop.stats.steps == steps
        store.gate.set()
        tokens = await decoding
        assert not d.connector.loading(RequestId("d"))
    assert tokens == expected
