"""The KV pool's memory: zero, aligned, not touched until used, and on huge pages
where the host reserved them."""

from __future__ import annotations

import pytest
import torch

from shared.config import HugePages
from shared.errors import ConfigError
from shared.kv.kv_cache import HUGE_PAGE_BYTES, KVCache
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


def _free_huge_pages() -> int:
    """Free reserved 2 MB huge pages on this host (0 where there are none)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("HugePages_Free:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


LAYOUT = KVLayout(num_layers=2, num_kv_heads=3, head_dim=64, block_size=16, dtype="float32")


@pytest.mark.parametrize("huge_pages", ["auto", "off"])
def test_every_huge_page_setting_gives_a_usable_pool(huge_pages: HugePages) -> None:
    cache = KVCache(LAYOUT, num_blocks=7, huge_pages=huge_pages)
    assert cache.pool.shape == (7, *LAYOUT.block_shape)
    assert cache.pool.data_ptr() % 4096 == 0 and not cache.pool.any()
    cache.layer(1)[0][6, 15] = 2.0
    assert cache.pool.sum() == 2.0 * 3 * 64


def test_required_huge_pages_come_from_the_reserve_or_fail_clearly() -> None:
    """``on`` takes 2 MB pages the host reserved (visible in /proc/meminfo once
    touched) and is a clear error where there are not enough."""
    blocks = (4 * HUGE_PAGE_BYTES) // LAYOUT.block_bytes  # about 8 MB
    free = _free_huge_pages()
    if free < 8:
        with pytest.raises(ConfigError, match="nr_hugepages"):
            KVCache(LAYOUT, num_blocks=blocks, huge_pages="on")
        return
    cache = KVCache(LAYOUT, num_blocks=blocks, huge_pages="on")
    assert cache.pool.data_ptr() % HUGE_PAGE_BYTES == 0
    cache.prefault()
    assert _free_huge_pages() <= free - 4


def test_a_split_pool_gathers_and_scatters_blocks_in_the_layout() -> None:
    """Layers 1 and 3 full-attention (group 0), 0 and 2 sliding (group 1): a block is
    its slot plus its part's slot; without a part its sliding layers are not kept."""
    from shared.kv.layer_groups import LayerGroups

    layout = KVLayout(num_layers=4, num_kv_heads=1, head_dim=8, block_size=4, dtype="float32")
    groups = LayerGroups.split([8, None, 8, None])
    cache = KVCache(layout, num_blocks=6, huge_pages="off", groups=groups)
    assert cache.pool.shape[1] == 2 and cache.nbytes == 6 * 2 * layout.layer_bytes
    assert [cache.group_of(i) for i in range(4)] == [1, 0, 1, 0]
    block = torch.arange(layout.block_bytes // 4, dtype=torch.float32).view(layout.block_shape)
    cache.scatter_blocks([2], [(5,)], block[None])
    out = torch.full((1, *layout.block_shape), -1.0)
    cache.gather_blocks([2], [(5,)], out)
    assert torch.equal(out[0], block)
    k3, _ = cache.layer(3)
    assert torch.equal(k3[2], block[3, 0]) and torch.equal(cache.layer(2)[1][5], block[2, 1])
    cache.scatter_blocks([4], [None], block[None] * 2)  # no part: sliding layers go nowhere
    two = torch.full((2, *layout.block_shape), -1.0)
    cache.gather_blocks([4, 2], [None, (5,)], two)
    assert torch.equal(two[0, [1, 3]], block[[1, 3]] * 2) and not two[0, [0, 2]].any()
    assert torch.equal(two[1], block)
    assert torch.equal(cache.pool[5], torch.stack([block[0], block[2]]))  # untouched
    with pytest.raises(RuntimeError):
        cache.block(2)
