from __future__ import annotations

import pytest

from shared.kv.block_hash import BlockHash
from shared.kv.block_pool import BlockId, BlockPool, OutOfBlocksError


def h(i: int) -> BlockHash:
    return BlockHash(i.to_bytes(16, "little"))


def test_allocate_and_release_counts() -> None:
    pool = BlockPool(4)
    a = pool.allocate(3)
    assert pool.num_free == 1
    assert all(pool.ref_count(b) == 1 for b in a)
    with pytest.raises(OutOfBlocksError):
        pool.allocate(2)
    assert pool.num_free == 1  # all or nothing
    pool.release(a)
    assert pool.num_free == 4
    with pytest.raises(ValueError):
        pool.release([a[0]])


def test_shared_prefix_blocks_are_reference_counted() -> None:
    pool = BlockPool(4)
    (b,) = pool.allocate(1)
    pool.cache_full_block(b, h(1))
    hits = pool.lookup([h(1), h(2)])
    assert hits == [b]
    pool.acquire(hits)
    assert pool.ref_count(b) == 2
    pool.release([b])
    assert pool.ref_count(b) == 1 and pool.num_free == 3


def test_freed_cached_blocks_stay_findable_until_reused_lru() -> None:
    pool = BlockPool(3)
    blocks = pool.allocate(3)
    for i, b in enumerate(blocks):
        pool.cache_full_block(b, h(i))
    pool.release(reversed(blocks))  # tail first: block 2 is evicted first
    assert pool.lookup([h(0), h(1), h(2)]) == blocks
    (reused,) = pool.allocate(1)
    assert reused == blocks[2]
    assert pool.lookup([h(0), h(1), h(2)]) == blocks[:2]
    assert pool.num_cached == 2


def test_acquiring_a_free_cached_block_takes_it_off_the_free_list() -> None:
    pool = BlockPool(2)
    (b,) = pool.allocate(1)
    pool.cache_full_block(b, h(7))
    pool.release([b])
    assert pool.num_free == 2
    pool.acquire([b])
    assert pool.num_free == 1
    assert pool.allocate(1) != [b]


def test_uncached_free_blocks_are_reused_before_cached_ones() -> None:
    pool = BlockPool(4)
    cached, partial = pool.allocate(2)
    pool.cache_full_block(cached, h(1))
    pool.release([cached, partial])
    # the untouched blocks 2, 3 are not preferred over a warm block with no content
    assert pool.allocate(1) == [partial]
    assert pool.lookup([h(1)]) == [cached]
    assert pool.allocate(3)[-1] == cached  # cached content is evicted last


def test_caching_disabled_never_hits() -> None:
    pool = BlockPool(2, enable_caching=False)
    (b,) = pool.allocate(1)
    pool.cache_full_block(b, h(1))
    assert pool.lookup([h(1)]) == []


def test_duplicate_content_keeps_first_copy() -> None:
    pool = BlockPool(2)
    a, b = pool.allocate(2)
    pool.cache_full_block(a, h(1))
    pool.cache_full_block(b, h(1))
    assert pool.lookup([h(1)]) == [BlockId(a)]
