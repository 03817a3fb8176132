"""KV transfer bandwidth GPU -> KV store -> GPU, against the host<->device copy bandwidth
measured in the same run (part of ``benchmarks/gpu_check.py``).

Blocks of the default model's layout (bf16) are filled on a CUDA KV pool, saved the ways
the KV connector saves them (:mod:`shared.kvstore.pool_copies`): ``staged`` (one gather
kernel and one DMA into pinned memory, then the store client's put: prefill's layer-wise
path) and ``direct`` (the slots' own device bytes handed to the client, which DMAs them
into a same-host store's pinned arena or bounces them through pinned memory to a socket);
and loaded back into other slots: ``direct`` (a decode's asynchronous load: the client's
get straight into the slots), ``staged`` (into pinned memory, one DMA and one scatter
kernel) and layer by layer (the in-step path); every load checked byte for byte. Each
figure is the best of ``repeats``; both data-plane paths the client offers (a same-host
node's shared arena, the socket) are measured.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

import redis.asyncio as aioredis
import torch

from shared.cluster.keys import Keys
from shared.engine.kv_cache_manager import Slot
from shared.kv.kv_cache import KVCache
from shared.kv.layout import KVLayout
from shared.kvstore.client import KVStoreClient
from shared.kvstore.pool_copies import Staged
from shared.launcher import LocalCluster
from shared.transport import make_transport

# the default model's KV (bf16): a 16-token block is 368,640 bytes
MODEL_KV = {"num_layers": 30, "num_kv_heads": 3, "head_dim": 64, "dtype": "bfloat16"}


def copy_bandwidth(nbytes: int, repeats: int) -> dict[str, float]:
    """GB/s of plain copies of ``nbytes`` between host and device memory."""
    device = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    pinned = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    pageable = torch.empty(nbytes, dtype=torch.uint8)
    pageable.fill_(1)

    def best(copy: Callable[[], object]) -> float:
        times = []
        for _ in range(repeats):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            copy()
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        return nbytes / min(times) / 1e9

    return {
        "h2d_pinned": best(lambda: device.copy_(pinned, non_blocking=True)),
        "d2h_pinned": best(lambda: pinned.copy_(device, non_blocking=True)),
        "h2d_pageable": best(lambda: device.copy_(pageable)),
        "d2h_pageable": best(lambda: pageable.copy_(device)),
        "host_memcpy": best(lambda: pageable.copy_(pinned)),
    }


async def best_of(repeats: int, run: Callable[[], Awaitable[float]]) -> float:
    return min([await run() for _ in range(repeats)])


async def path_bandwidth(
    local: LocalCluster, pool: KVCache, blocks: int, repeats: int, shm: bool
) -> dict[str, Any]:
    layout = pool.layout
    copies = Staged(pool)
    nbytes = blocks * layout.block_bytes
    src = [Slot(i) for i in range(blocks)]
    dst = [Slot(blocks + i) for i in range(blocks)]
    redis = aioredis.from_url(local.redis.url)
    client = KVStoreClient(
        make_transport("tcp"), redis, Keys("baton"), secret=local.secret, shm=shm
    )
    try:
        ids: list[str] = []

        async def save_staged() -> float:  # one gather + one DMA into pinned, then the put
            ids[:] = [uuid.uuid4().hex for _ in src]
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            copy = copies.from_pool(src)
            await copy.ready.wait()
            await client.put(ids, copy.buffers, num_layers=layout.num_layers)
            return time.perf_counter() - t0

        async def save_direct() -> float:  # the slots' own bytes: the client's DMA
            ids[:] = [uuid.uuid4().hex for _ in src]
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            rows = copies.blocks(src)
            await rows.ready.wait()
            await client.put(ids, rows.buffers, num_layers=layout.num_layers)
            return time.perf_counter() - t0

        async def load_direct() -> float:  # what a decode's asynchronous load does
            pool.pool[dst].zero_()
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            await client.get(ids, copies.blocks(dst).buffers)
            return time.perf_counter() - t0

        async def load_staged() -> float:  # into pinned memory, one DMA + one scatter
            pool.pool[dst].zero_()
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            landing = copies.landing(dst)
            await client.get(ids, landing.rows)
            await copies.blocks_to_pool(landing).wait()
            return time.perf_counter() - t0

        async def stream() -> float:  # the in-step path: layer by layer
            pool.pool[dst].zero_()
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            landing = copies.landing(dst)
            last = None
            async for layer in client.stream(
                ids, landing.rows, num_layers=layout.num_layers, wait_s=5.0
            ):
                last = copies.layer_to_pool(landing, layer)
            if last is not None:
                await last.wait()
            return time.perf_counter() - t0

        async def socket_only() -> float:  # the data plane alone, host to host
            host = torch.empty((blocks, layout.block_bytes), dtype=torch.uint8, pin_memory=True)
            t0 = time.perf_counter()
            await client.get(ids, list(host))
            return time.perf_counter() - t0

        out: dict[str, Any] = {"blocks": blocks, "bytes": nbytes, "shm": shm}

        def same() -> bool:
            return bool(torch.equal(pool.pool[dst], pool.pool[src]))

        out["save_staged_gbps"] = nbytes / await best_of(repeats, save_staged) / 1e9
        out["save_direct_gbps"] = nbytes / await best_of(repeats, save_direct) / 1e9
        out["load_direct_gbps"] = nbytes / await best_of(repeats, load_direct) / 1e9
        exact = same()
        out["load_staged_gbps"] = nbytes / await best_of(repeats, load_staged) / 1e9
        exact = exact and same()
        out["stream_load_gbps"] = nbytes / await best_of(repeats, stream) / 1e9
        out["exact"] = exact and same()
        out["store_get_host_gbps"] = nbytes / await best_of(repeats, socket_only) / 1e9
        out["used_shared_arena"] = any(n.local for n in await client.nodes())
        out["save_gbps"] = max(out["save_staged_gbps"], out["save_direct_gbps"])
        out["load_gbps"] = max(out["load_direct_gbps"], out["load_staged_gbps"])
        return out
    finally:
        await client.close()
        await redis.aclose()


def row_dma(pool: KVCache, blocks: int, repeats: int) -> float:
    """GB/s of one DMA per block from pinned memory into the pool: the ceiling of any
    path that copies block by block (no runs merged)."""
    rows = pool.pool.view(pool.num_blocks, -1).view(torch.uint8)
    host = torch.empty((blocks, rows.shape[1]), dtype=torch.uint8, pin_memory=True)
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for i in range(blocks):
            rows[blocks + i].copy_(host[i], non_blocking=True)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return blocks * rows.shape[1] / min(times) / 1e9


def kv_bandwidth(local: LocalCluster, repeats: int = 3) -> dict[str, Any]:
    """Per block size (16 tokens of this model: 368 KB; 64 tokens: 1.47 MB, about what 16
    tokens of a 1B model weigh), ~190 MB each way."""
    raw = copy_bandwidth(188_743_680, repeats)
    out: dict[str, Any] = {"copy_gbps": raw, "block_sizes": []}
    for block_tokens, blocks in ((16, 512), (64, 128)):
        layout = KVLayout(block_size=block_tokens, **MODEL_KV)  # type: ignore[arg-type]
        pool = KVCache(layout, 2 * blocks, device="cuda")
        gen = torch.Generator(device="cuda").manual_seed(0)
        pool.pool.copy_(
            torch.randn(pool.pool.shape, device="cuda", generator=gen).to(torch.bfloat16)
        )
        paths = [
            asyncio.run(path_bandwidth(local, pool, blocks, repeats, shm)) for shm in (True, False)
        ]
        best_save = max(p["save_gbps"] for p in paths)
        best_load = max(p["load_gbps"] for p in paths)
        out["block_sizes"].append({
            "block_tokens": block_tokens, "block_bytes": layout.block_bytes,
            "row_dma_gbps": row_dma(pool, blocks, repeats), "paths": paths,
            "save_over_d2h": best_save / raw["d2h_pinned"],
            "load_over_h2d": best_load / raw["h2d_pinned"],
            "exact": all(p["exact"] for p in paths),
        })  # fmt: skip
        del pool
        torch.cuda.empty_cache()
    sizes = out["block_sizes"]
    out["ok"] = all(b["exact"] for b in sizes)
    out["target_met_by_block_tokens"] = {
        b["block_tokens"]: b["save_over_d2h"] >= 0.5 and b["load_over_h2d"] >= 0.5 for b in sizes
    }
    out["target_met"] = out["ok"] and all(out["target_met_by_block_tokens"].values())
    return out
