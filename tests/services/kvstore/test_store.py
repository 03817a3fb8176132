"""BlockStore semantics without any transport (the index sink is a named fake)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence

import numpy as np
import pytest

from services.kvstore.metrics import StoreMetrics
from services.kvstore.store import BlockStore, StoreConfig
from shared.errors import KVBadRequestError, KVMissError, KVNoSpaceError, KVWaitTimeoutError
from shared.kvstore.protocol import BlockSpec

BLOCK = 3000
LAYERS = 3


class FakeIndex:
    """Records what the store reports instead of writing Redis."""

    def __init__(self) -> None:
        self.held: set[str] = set()

    def added(self, ids: Sequence[str]) -> None:
        self.held.update(ids)

    def removed(self, ids: Sequence[str]) -> None:
        self.held.difference_update(ids)


def bid(i: int) -> str:
    return f"{i:032x}"


def make(
    capacity: int = 1 << 20, slab: int = 1 << 18, watermarks: tuple[float, float] = (0.95, 0.85)
) -> tuple[BlockStore, FakeIndex]:
    index = FakeIndex()
    config = StoreConfig(capacity, slab, *watermarks)
    return BlockStore(config, StoreMetrics(), index), index


def put(store: BlockStore, ids: list[str], fill: int = 1, owner: str = "c") -> None:
    store.reserve(owner, [BlockSpec(id=i, size=BLOCK) for i in ids], LAYERS, 30)
    transfer = store.begin_write(ids, None)
    for view in transfer.views:
        view[:] = fill
    store.end_write(transfer, ok=True)
    store.commit(ids)


def read(store: BlockStore, ids: list[str]) -> list[np.ndarray]:
    entries = store.open_read(ids)
    try:
        return [v.copy() for v in store.views(entries, None)]
    finally:
        store.close_read(entries)


async def test_two_phase_put_is_invisible_until_commit() -> None:
    store, index = make()
    ids = [bid(1), bid(2)]
    assert store.reserve("w", [BlockSpec(id=i, size=BLOCK) for i in ids], LAYERS, 30) == [
        "reserved",
        "reserved",
    ]
    assert store.lookup(ids) == 0
    for layer in range(LAYERS):
        transfer = store.begin_write(ids, (layer, layer + 1))
        assert [v.nbytes for v in transfer.views] == [BLOCK // LAYERS] * 2
        for view in transfer.views:
            view[:] = layer + 1
        store.end_write(transfer, ok=True)
        if layer < LAYERS - 1:
            with pytest.raises(KVBadRequestError):
                store.commit(ids)  # not every layer written yet
    assert index.held == set()
    store.commit(ids)
    assert store.lookup([*ids, bid(3)]) == 2
    assert index.held == set(ids)
    data = read(store, ids)[0]
    assert list(np.unique(data[:1000])) == [1] and list(np.unique(data[2000:])) == [3]
    assert store.reserve("w", [BlockSpec(id=bid(1), size=BLOCK)], LAYERS, 30) == ["exists"]


async def test_revoke_expiry_and_owner_exit_free_reservations() -> None:
    store, index = make()
    store.reserve("a", [BlockSpec(id=bid(1), size=BLOCK)], LAYERS, 30)
    store.reserve("b", [BlockSpec(id=bid(2), size=BLOCK)], LAYERS, 0.01)
    store.reserve("c", [BlockSpec(id=bid(3), size=BLOCK)], LAYERS, 30)
    assert store.reserve("z", [BlockSpec(id=bid(3), size=BLOCK)], LAYERS, 30) == ["pending"]
    assert store.revoke([bid(1)]) == 1
    store.expire(time.monotonic() + 1)
    assert store.client_gone("c") == 1
    assert store.stats()["blocks_reserved"] == 0
    assert store.arena.used_bytes == 0
    with pytest.raises(KVMissError):
        store.open_read([bid(1)])
    assert index.held == set()


async def test_failed_write_leaves_layers_unwritten() -> None:
    store, _ = make()
    store.reserve("w", [BlockSpec(id=bid(1), size=BLOCK)], LAYERS, 30)
    transfer = store.begin_write([bid(1)], None)
    store.end_write(transfer, ok=False)
    with pytest.raises(KVBadRequestError):
        store.commit([bid(1)])


async def test_high_watermark_evicts_down_to_low() -> None:
    store, index = make(capacity=1 << 16, slab=1 << 16)
    n = (1 << 16) // BLOCK
    put(store, [bid(i) for i in range(n)])
    assert store.arena.used_bytes <= 0.85 * store.arena.capacity
    assert store.held_ids() == [bid(i) for i in range(n - len(store.held_ids()), n)]  # oldest went
    assert store.metrics.evictions._value.get() == n - len(store.held_ids())
    assert set(store.held_ids()) == index.held


async def test_eviction_is_lru_and_spares_leased_and_busy_blocks() -> None:
    store, index = make(capacity=1 << 18, slab=1 << 16)  # 4 slabs x 21 blocks of 3000 B
    capacity_blocks = 4 * ((1 << 16) // BLOCK)
    ids = [bid(i) for i in range(capacity_blocks)]
    put(store, ids[:10])
    lease = store.lease(ids[:2], 30)
    busy = store.open_read([ids[2]])
    store.lookup(ids[3:4])  # lookups do not refresh recency; reads do
    read(store, [ids[4]])
    put(store, [bid(1000 + i) for i in range(capacity_blocks - 5)])  # forces evictions
    assert store.metrics.evictions._value.get() > 0
    held = set(store.held_ids())
    assert set(ids[:3]) <= held  # leased and in-transfer blocks survived
    assert held == index.held  # the index saw every eviction
    store.close_read(busy)
    store.release(lease)
    with pytest.raises(KVMissError):
        store.release(lease)


async def test_no_space_when_everything_is_pinned() -> None:
    store, _ = make(capacity=1 << 16, slab=1 << 16, watermarks=(1.0, 1.0))
    n = (1 << 16) // BLOCK
    put(store, [bid(i) for i in range(n)])
    store.lease([bid(i) for i in range(n)], 30)
    with pytest.raises(KVNoSpaceError):
        store.reserve("w", [BlockSpec(id=bid(999), size=BLOCK)], LAYERS, 30)
    with pytest.raises(KVBadRequestError):
        store.reserve("w", [BlockSpec(id=bid(998), size=(1 << 16) + 3)], LAYERS, 30)


async def test_reader_waits_for_layers_and_learns_about_revoke() -> None:
    store, _ = make()
    store.reserve("w", [BlockSpec(id=bid(1), size=BLOCK)], LAYERS, 30)
    entries = store.open_read([bid(1)])
    waiter = asyncio.create_task(store.wait_for(entries, 1, time.monotonic() + 5))
    await asyncio.sleep(0.01)
    assert not waiter.done()
    transfer = store.begin_write([bid(1)], (0, 2))
    store.end_write(transfer, ok=True)
    await asyncio.wait_for(waiter, 1)
    with pytest.raises(KVWaitTimeoutError):
        await store.wait_for(entries, None, time.monotonic() + 0.05)
    committed = asyncio.create_task(store.wait_for(entries, None, time.monotonic() + 5))
    await asyncio.sleep(0.01)
    store.revoke([bid(1)])
    with pytest.raises(KVMissError):
        await asyncio.wait_for(committed, 1)
    used = store.arena.used_bytes
    store.close_read(entries)  # the slot is freed only when the reader lets go
    assert store.arena.used_bytes == used - BLOCK
