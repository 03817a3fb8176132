"""The KV pool's memory: zero, aligned, and not touched until used."""

from __future__ import annotations

import torch

from shared.kv.kv_cache import KVCache
from shared.kv.layout import KVLayout


def test_pool_is_zero_and_page_aligned() -> None:
    layout = KVLayout(num_layers=2, num_kv_heads=3, head_dim=64, block_size=16, dtype="bfloat16")
    cache = KVCache(layout, num_blocks=5)
    # kernels read 64-byte rows: an unaligned pool splits each across cache lines
    assert cache.pool.data_ptr() % 4096 == 0
    assert cache.pool.dtype == torch.bfloat16 and not cache.pool.any()
    k, v = cache.layer(1)
    k[3, 2] = 1.0
    assert cache.pool.float().sum() == 3 * 64 and not v.any()
