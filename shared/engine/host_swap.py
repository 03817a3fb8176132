"""Host memory that preempted requests' KV blocks are swapped to (see shared.engine.swap).

Host blocks are the size of the pool's slots, one copy per slot: a whole block
for a model without sliding-window layers, and for one with them a block's slot
and each of its window part's slots, only for the blocks whose parts the request
holds (what it actually occupies). On a CPU engine the space is an anonymous
mapping like the pool's (it costs nothing until a block is first written);
beside a GPU pool it is pinned host memory, so the copies run at DMA speed.
Ownership: the engine's, which calls :meth:`HostSwapSpace.run` on the engine
thread only.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from shared.config import EngineConfig
from shared.engine.swap import SwapCostModel, Swapper, SwapPlan
from shared.kv.kv_cache import KVCache, anonymous_zeros


@dataclass(frozen=True)
class CopyTiming:
    nbytes: int
    seconds: float


class HostSwapSpace:
    def __init__(self, pool: KVCache, num_blocks: int):
        if num_blocks < 1:
            raise ValueError("a swap space needs at least one block")
        self.pool = pool
        self.num_blocks = num_blocks
        shape = (num_blocks, *pool.pool.shape[1:])
        dtype = pool.layout.torch_dtype
        if pool.pool.device.type == "cpu":
            self.blocks = anonymous_zeros(shape, dtype, "cpu", "off")
        else:
            self.blocks = torch.empty(shape, dtype=dtype, pin_memory=True)

    def run(self, plan: SwapPlan) -> CopyTiming:
        """Run a step's copies (before its forward); returns what they moved and took."""
        t0 = time.perf_counter()
        for c in plan.copy_out:
            self.blocks[c.host].copy_(self.pool.pool[c.slot], non_blocking=True)
        for c in plan.copy_in:
            self.pool.pool[c.slot].copy_(self.blocks[c.host], non_blocking=True)
        if self.pool.pool.device.type == "cuda":
            torch.cuda.synchronize(self.pool.pool.device)
        n = len(plan.copy_out) + len(plan.copy_in)
        return CopyTiming(
            n * self.pool.slot_bytes(self.pool.layout, self.pool.groups), time.perf_counter() - t0
        )


def build_swap(config: EngineConfig, pool: KVCache) -> tuple[HostSwapSpace | None, Swapper | None]:
    """The host swap space and the scheduler's swapper an engine's config asks for: none
    for recompute-preemption; without host space the swapper still spills preempted
    requests to the connector (the KV store)."""
    if config.scheduler.preemption_mode == "recompute":
        return None, None
    slot_bytes = pool.slot_bytes(pool.layout, pool.groups)
    blocks = config.cache.swap_space_bytes // slot_bytes
    space = HostSwapSpace(pool, blocks) if blocks >= 1 else None
    always = config.scheduler.preemption_mode == "swap"
    return space, Swapper(blocks, slot_bytes, SwapCostModel(), always=always)
