"""Slot bytes out of and into an engine's KV pool: in place on the CPU, staged through
pinned memory on a CUDA device (skipped without one)."""

from __future__ import annotations

import asyncio

import pytest
import torch

from shared.engine.kv_cache_manager import Slot
from shared.kv.kv_cache import KVCache
from shared.kv.layout import KVLayout
from shared.kvstore.pool_copies import InPlace, Later, Staged, pool_copies

LAYOUT = KVLayout(num_layers=4, num_kv_heads=2, head_dim=8, block_size=16, dtype="bfloat16")


def slots(*ids: int) -> list[Slot]:
    return [Slot(i) for i in ids]


def filled_pool(device: str) -> KVCache:
    pool = KVCache(LAYOUT, 12, device=device, huge_pages="off")
    gen = torch.Generator().manual_seed(0)
    pool.pool.copy_(torch.randn(pool.pool.shape, generator=gen).to(pool.pool.dtype))
    return pool


def host_bytes(pool: KVCache, slot: int, layer: int | None = None) -> torch.Tensor:
    block = pool.pool[slot] if layer is None else pool.pool[slot, layer]
    return block.reshape(-1).view(torch.uint8).cpu()


def test_in_place_hands_out_the_slots_own_bytes() -> None:
    pool = filled_pool("cpu")
    copies = pool_copies(pool)
    assert isinstance(copies, InPlace)
    copy = copies.from_pool(slots(3, 7), layer=2)
    assert copy.reads_pool and copy.ready.done
    assert copy.buffers[1].data_ptr() == pool.pool[7, 2].data_ptr()
    assert torch.equal(copy.buffers[0], host_bytes(pool, 3, 2))
    staging = copies.staging(4, LAYOUT.block_bytes)
    staged = copies.from_pool(slots(5), out=staging[1:2])
    assert not staged.reads_pool
    assert torch.equal(staging[1], host_bytes(pool, 5))
    landing = copies.landing(slots(9))
    assert landing.rows[0].data_ptr() == pool.pool[9].data_ptr()


async def test_a_later_copy_is_ready_once_run_on_another_thread() -> None:
    """A copy deferred past a step: waiters block until the engine thread runs it, then
    see its bytes; a copy that fails fails them rather than letting garbage be sent."""
    loop = asyncio.get_running_loop()
    pool = filled_pool("cpu")
    rows = pool_copies(pool).staging(1, LAYOUT.block_bytes)
    later = Later(lambda: rows[0].copy_(host_bytes(pool, 4)), loop.call_soon_threadsafe)
    waiter = asyncio.ensure_future(later.wait())
    await asyncio.sleep(0.05)
    assert not waiter.done() and not later.done
    await asyncio.to_thread(later.run)
    await asyncio.wait_for(waiter, 5)
    assert later.done and torch.equal(rows[0], host_bytes(pool, 4))

    def broken() -> None:
        raise ValueError("no such slot")

    failed = Later(broken, loop.call_soon_threadsafe)
    await asyncio.to_thread(failed.run)
    with pytest.raises(RuntimeError, match="deferred copy"):
        await asyncio.wait_for(failed.wait(), 5)


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@cuda
def test_staged_copies_round_trip_through_pinned_memory() -> None:
    pool = filled_pool("cuda")
    copies = pool_copies(pool)
    assert isinstance(copies, Staged)
    out = copies.from_pool(slots(1, 4, 10))
    assert not out.reads_pool and out.buffers[0].is_pinned()
    asyncio.run(out.ready.wait())
    for row, slot in zip(out.buffers, [1, 4, 10], strict=True):
        assert torch.equal(row, host_bytes(pool, slot))
    layer = copies.from_pool(slots(2, 6), layer=3)
    asyncio.run(layer.ready.wait())
    assert torch.equal(layer.buffers[1], host_bytes(pool, 6, 3))

    # whole blocks back into other slots
    landing = copies.landing(slots(0, 11, 5))
    for row, src in zip(landing.rows, out.buffers, strict=True):
        row.copy_(src)
    asyncio.run(copies.blocks_to_pool(landing).wait())
    for dst, orig in zip([0, 11, 5], [1, 4, 10], strict=True):
        assert torch.equal(pool.pool[dst], pool.pool[orig])

    # layer by layer, each ordered before the engine's stream by its event
    source = [host_bytes(pool, s) for s in (2, 3)]
    landing = copies.landing(slots(7, 8))
    for row, src in zip(landing.rows, source, strict=True):
        row.copy_(src)
    for i in range(LAYOUT.num_layers):
        copies.order_before_compute(copies.layer_to_pool(landing, i))
    torch.cuda.current_stream().synchronize()
    assert torch.equal(pool.pool[7], pool.pool[2]) and torch.equal(pool.pool[8], pool.pool[3])


@cuda
def test_staged_copy_out_sees_the_compute_queued_before_it() -> None:
    pool = filled_pool("cuda")
    copies = pool_copies(pool)
    busy = torch.randn(4096, 4096, device="cuda")
    for _ in range(8):  # keep the engine's stream busy, then write the slot
        busy = busy @ busy.T / 4096
    pool.pool[3].fill_(1.5)
    out = copies.from_pool(slots(3))
    copies.order_after_saves()
    pool.pool[3].fill_(-2.0)  # queued after the copy on the engine's stream
    asyncio.run(out.ready.wait())
    want = torch.full(LAYOUT.block_shape, 1.5, dtype=torch.bfloat16)
    assert torch.equal(out.buffers[0], want.reshape(-1).view(torch.uint8))


def test_blocks_are_the_slots_own_bytes() -> None:
    pool = filled_pool("cpu")
    rows = pool_copies(pool).blocks(slots(2, 8))
    assert rows.reads_pool and rows.ready.done
    assert rows.buffers[1].data_ptr() == pool.pool[8].data_ptr()
    assert rows.buffers[0].numel() == LAYOUT.block_bytes


@cuda
def test_staged_blocks_are_device_rows_ready_after_the_queued_compute() -> None:
    pool = filled_pool("cuda")
    rows = pool_copies(pool).blocks(slots(4))
    assert rows.reads_pool and rows.buffers[0].is_cuda
    asyncio.run(rows.ready.wait())
    assert torch.equal(rows.buffers[0].cpu(), host_bytes(pool, 4))


def test_a_split_pool_is_gathered_and_one_layer_stays_in_place() -> None:
    """A pool split by layer groups (layers 0 and 2 sliding): whole blocks leave as
    layout-format copies, a layer of a block is its slot's own bytes, and a load lands
    each layer in its slot (of a block without a part it reads only the global layers)."""
    from shared.kv.layer_groups import LayerGroups
    from shared.kvstore.pool_copies import Gathered

    groups = LayerGroups.split([16, None, 16, None])
    pool = KVCache(LAYOUT, 12, huge_pages="off", groups=groups)
    gen = torch.Generator().manual_seed(1)
    pool.pool.copy_(torch.randn(pool.pool.shape, generator=gen).to(pool.pool.dtype))
    parts = {Slot(3): (Slot(8),), Slot(4): None}
    pool.bind_parts(lambda s: parts.get(Slot(s)))
    copies = pool_copies(pool)
    assert isinstance(copies, Gathered) and not copies.staged
    sliding = copies.from_pool(slots(3), layer=2)
    assert sliding.reads_pool and sliding.buffers[0].data_ptr() == pool.pool[8, 1].data_ptr()
    whole = copies.blocks(slots(3, 4))
    assert not whole.reads_pool
    typed = [b.view(pool.pool.dtype).view(LAYOUT.block_shape) for b in whole.buffers]
    assert torch.equal(typed[0][2], pool.pool[8, 1]) and torch.equal(typed[0][3], pool.pool[3, 1])
    assert not typed[1][0].any() and torch.equal(typed[1][1], pool.pool[4, 0])
    with pytest.raises(RuntimeError):
        copies.from_pool(slots(4), layer=0)  # its part is gone: a bug to read it

    source = [b.clone() for b in whole.buffers]
    pool.pool.zero_()
    landing = copies.landing(slots(3, 4))
    assert landing.rows == [] and landing.layer_into is not None
    assert landing.only == [None, (1, 3)]
    lb = LAYOUT.layer_bytes
    assert landing.nbytes(LAYOUT) == LAYOUT.block_bytes + 2 * lb
    for i, src in enumerate(source):
        for layer in landing.only[i] or range(LAYOUT.num_layers):
            landing.layer_into(i, layer).copy_(src[layer * lb : (layer + 1) * lb])
    with pytest.raises(RuntimeError):
        landing.layer_into(1, 0)  # not read: no row reads it
    again = copies.blocks(slots(3, 4))
    assert torch.equal(again.buffers[0], source[0])  # every layer in its slot
    assert torch.equal(again.buffers[1].view(4, -1)[[1, 3]], source[1].view(4, -1)[[1, 3]])
    assert not again.buffers[1].view(4, -1)[[0, 2]].any()  # no part: not kept
