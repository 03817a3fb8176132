"""The KV cache manager's allocation, reference counts, prefix table and LRU eviction,
with real block keys and no model."""

from __future__ import annotations

import itertools

import pytest

from shared.engine.kv_cache_manager import KVCacheManager, OutOfSlotsError
from shared.engine.kv_events import KVEvents
from shared.engine.request import Request, RequestId
from shared.engine.sampling_params import SamplingParams
from shared.kv.block_hash import BlockHasher

BS = 4
_ids = itertools.count()


def manager(num_slots: int = 8, caching: bool = True) -> KVCacheManager:
    return KVCacheManager(
        num_slots, BlockHasher(namespace="test", block_size=BS), enable_caching=caching
    )


def req(tokens: list[int], salt: str | None = None) -> Request:
    return Request(
        request_id=RequestId(f"r{next(_ids)}"),
        prompt_token_ids=tokens,
        params=SamplingParams(max_tokens=4),
        seed=0,
        arrival=0.0,
        cache_salt=salt,
    )


def computed(kv: KVCacheManager, r: Request, n: int) -> None:
    """Pretend the model computed ``r``'s first ``n`` tokens into its slots."""
    r.num_computed_tokens = n
    kv.cache_blocks(r)


def test_admit_takes_slots_for_the_tokens_all_or_nothing() -> None:
    kv = manager(4)
    a = req(list(range(10)))
    kv.admit(a, [], 10)
    assert len(a.slots) == 3 and kv.num_free == 1
    assert all(kv.ref_count(s) == 1 for s in a.slots)
    b = req(list(range(100, 108)))
    assert not kv.can_admit([], 8)
    with pytest.raises(OutOfSlotsError):
        kv.admit(b, [], 8)
    assert kv.num_free == 1 and b.slots == []
    kv.free(a)
    assert kv.num_free == 4 and a.slots == []


def test_grow_extends_a_request_or_takes_nothing() -> None:
    kv = manager(3)
    a = req(list(range(4)))
    kv.admit(a, [], 4)
    assert kv.grow(a, 4) and len(a.slots) == 1  # already covered
    assert kv.grow(a, 9) and len(a.slots) == 3
    assert not kv.grow(a, 13)
    assert len(a.slots) == 3


def test_cached_blocks_are_shared_and_reference_counted() -> None:
    kv = manager(8)
    a = req(list(range(10)))
    kv.admit(a, [], 10)
    computed(kv, a, 10)  # two full blocks registered, the tail is not
    assert kv.num_cached == 2 and a.num_cached_blocks == 2
    b = req(list(range(9)))
    hits = kv.local_hit(b, max_blocks=8)
    assert hits == a.slots[:2]
    kv.admit(b, hits, 9)
    assert b.slots[:2] == a.slots[:2] and b.num_cached_blocks == 2
    assert kv.ref_count(hits[0]) == 2
    kv.free(a)
    assert kv.ref_count(hits[0]) == 1
    kv.free(b)
    assert kv.num_free == 8


def test_local_hit_is_a_prefix_and_respects_the_limit() -> None:
    kv = manager(8)
    a = req(list(range(12)))
    kv.admit(a, [], 12)
    computed(kv, a, 12)
    same = req(list(range(12)))
    assert len(kv.local_hit(same, max_blocks=2)) == 2  # the caller keeps a token to compute
    diverged = req([*range(4), 99, *range(5, 12)])
    assert kv.local_hit(diverged, max_blocks=3) == a.slots[:1]


def test_salts_never_share_a_block() -> None:
    kv = manager(8)
    a = req(list(range(8)), salt="tenant-a")
    kv.admit(a, [], 8)
    computed(kv, a, 8)
    assert kv.local_hit(req(list(range(8)), salt="tenant-b"), 2) == []
    assert kv.local_hit(req(list(range(8))), 2) == []
    assert len(kv.local_hit(req(list(range(8)), salt="tenant-a"), 2)) == 2


def test_freed_cached_blocks_stay_findable_until_reused_tail_first() -> None:
    kv = manager(3)
    a = req(list(range(12)))
    kv.admit(a, [], 12)
    computed(kv, a, 12)
    slots = list(a.slots)
    kv.free(a)  # tail first: the last block is evicted first
    assert kv.local_hit(req(list(range(13))), 3) == slots
    b = req([500] * 4)
    kv.admit(b, [], 4)
    assert b.slots == [slots[2]]
    assert kv.local_hit(req(list(range(13))), 3) == slots[:2]
    assert kv.num_cached == 2


def test_uncached_free_slots_are_reused_before_cached_ones() -> None:
    kv = manager(4)
    a = req(list(range(6)))  # one full block, one partial
    kv.admit(a, [], 6)
    computed(kv, a, 6)
    cached, partial = a.slots
    kv.free(a)
    b = req([7] * 4)
    kv.admit(b, [], 4)
    assert b.slots == [partial]  # warm and holding nothing
    c = req([8] * 12)
    kv.admit(c, [], 12)
    assert c.slots[-1] == cached  # cached content is evicted last


def test_acquiring_a_free_cached_slot_takes_it_off_the_free_list() -> None:
    kv = manager(2)
    a = req(list(range(4)))
    kv.admit(a, [], 4)
    computed(kv, a, 4)
    kv.free(a)
    assert kv.num_free == 2
    b = req(list(range(6)))
    hits = kv.local_hit(b, 1)
    assert kv.can_admit(hits, 8) and not kv.can_admit(hits, 12)
    kv.admit(b, hits, 6)
    assert kv.num_free == 0


def test_events_follow_what_the_pool_holds() -> None:
    kv = manager(2)
    a = req(list(range(8)))
    kv.admit(a, [], 8)
    computed(kv, a, 8)
    events = kv.take_events()
    assert events.stored == tuple(a.block_keys) and not events.removed
    assert not kv.take_events()
    kv.free(a)
    assert kv.take_events() == KVEvents()  # freed but still cached: nothing removed
    b = req([9] * 4)
    kv.admit(b, [], 4)  # evicts a's last block
    assert kv.take_events() == KVEvents(removed=(a.block_keys[1],))
    assert kv.held_keys() == [a.block_keys[0]]


def test_caching_disabled_never_hits_or_publishes() -> None:
    kv = manager(4, caching=False)
    a = req(list(range(8)))
    kv.admit(a, [], 8)
    computed(kv, a, 8)
    assert len(a.block_keys) == 2  # keys exist (they name blocks), the table stays empty
    assert kv.local_hit(req(list(range(8))), 2) == [] and not kv.take_events()


def test_duplicate_content_keeps_the_first_copy() -> None:
    kv = manager(4)
    a, b = req(list(range(4))), req(list(range(4)))
    kv.admit(a, [], 4)
    kv.admit(b, [], 4)
    computed(kv, a, 4)
    computed(kv, b, 4)
    assert kv.local_hit(req(list(range(5))), 1) == [a.slots[0]]
    assert kv.num_cached == 1
