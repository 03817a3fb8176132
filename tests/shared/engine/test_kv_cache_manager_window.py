"""The KV cache manager with sliding-window layers: window parts held only for the
blocks a row still to be computed reads, shared and cached like slots, evicted from
one free list, and prefix hits cut where a window part is gone. Real block keys, no
model; the invariants are checked after every operation of a random workload."""

from __future__ import annotations

import random

import pytest

from shared.engine.kv_cache_manager import KVCacheManager, Slot, WindowPart
from shared.engine.request import Request, RequestId
from shared.kv.block_hash import BlockHasher
from shared.kv.layer_groups import LayerGroups
from tests.shared.engine.test_kv_cache_manager import req

BS = 4
WINDOW = 8  # tokens: a row reads its block and up to two before it
GROUPS = LayerGroups(((2, 5), (0, 1), (3, 4)), WINDOW)  # two sliding groups


def manager(num_slots: int = 64, hold: dict[RequestId, int] | None = None) -> KVCacheManager:
    seen: dict[Slot, WindowPart | None] = {}
    kv = KVCacheManager(
        num_slots,
        BlockHasher(namespace="test", block_size=BS),
        groups=GROUPS,
        window_hold=None if hold is None else (lambda r: hold.get(r.request_id)),
        on_part=seen.__setitem__,
    )
    kv.seen_parts = seen  # type: ignore[attr-defined]  # what on_part was told
    kv.published = (set(), set())  # type: ignore[attr-defined]  # what its events said
    return kv


def run(kv: KVCacheManager, r: Request, upto: int, chunk: int = 4) -> None:
    """Compute ``r`` to ``upto`` tokens in steps of ``chunk``, as the scheduler grows it."""
    while r.num_computed_tokens < upto:
        n = min(chunk, upto - r.num_computed_tokens)
        assert kv.grow(r, r.num_computed_tokens + n)
        r.num_computed_tokens += n
        kv.cache_blocks(r)


def check(kv: KVCacheManager, live: list[Request]) -> None:
    """Every reference accounted for; every block a live request's next row reads has
    its part; parts and owners mirror each other and what on_part was told."""
    refs: dict[int, int] = {}
    for r in live:
        for s in r.slots:
            refs[s] = refs.get(s, 0) + 1
        for s in r.slots[r.window_from :]:
            part = kv.window_part(s)
            assert part is not None, (r.request_id, s)
            for p in part:
                refs[p] = refs.get(p, 0) + 1
        assert r.window_from <= kv.window_first(r.num_computed_tokens) or r.window_from == 0
    for slot in range(kv.num_slots):
        assert kv.ref_count(Slot(slot)) == refs.get(slot, 0), slot
    assert kv.num_free == kv.num_slots - len(refs)
    told = {s: p for s, p in kv.seen_parts.items() if p is not None}  # type: ignore[attr-defined]
    attached = {Slot(s): kv.window_part(s) for s in range(kv.num_slots) if kv.window_part(s)}
    assert told == attached
    owners = [p for part in attached.values() if part for p in part]
    assert len(owners) == len(set(owners))
    assert not set(owners) & set(attached)  # a slot holds a block or a part, not both
    # the events (applied as the worker publishes them: removals first) mirror which
    # keys are findable, and which of them have their window part
    events = kv.take_events()
    held, windowed = kv.published  # type: ignore[attr-defined]
    held.difference_update(events.removed)
    held.update(events.stored)
    windowed.difference_update(events.window_removed)
    windowed.update(events.window_stored)
    assert held == set(kv.held_keys())
    assert windowed == set(kv.window_keys())


def test_a_long_request_holds_its_window_parts_only() -> None:
    kv = manager()
    r = req(list(range(40)))
    kv.admit(r, [], 4, start=0)
    r.num_computed_tokens = 0
    run(kv, r, 40)
    assert kv.grow(r, 41)
    # the row at 40 reads positions 33..40: blocks 8..10; one row back (32) block 8 too
    assert r.window_from == kv.window_first(40) == 8
    assert kv.slots_held(r) == 11 + 2 * 3
    check(kv, [r])
    kv.free(r)
    check(kv, [])
    assert kv.num_free == kv.num_slots


def test_without_sliding_layers_nothing_changes() -> None:
    kv = KVCacheManager(16, BlockHasher(namespace="t", block_size=BS), groups=LayerGroups.full(6))
    r = req(list(range(40)))
    kv.admit(r, [], 40)
    assert kv.part_size == 0 and kv.slots_held(r) == 10 and kv.window_part(r.slots[0]) is None


def test_a_prefix_hit_needs_the_parts_of_its_window() -> None:
    kv = manager()
    a = req(list(range(40)))
    kv.admit(a, [], 4, start=0)
    run(kv, a, 40)
    kv.free(a)
    # the parts of blocks 8..9 are still attached (cached): a 10-block hit is whole
    b = req([*range(40), 99, 98])
    hits = kv.local_hit(b, (b.num_tokens - 1) // BS)
    assert len(hits) == 10
    # another request takes nearly every free slot: the cached parts (released
    # before the blocks) are evicted, and the hit shrinks to what still has its window
    filler = req(list(range(500, 500 + 4 * (kv.num_free - 11))))
    kv.admit(filler, [], filler.num_tokens, start=filler.num_tokens)
    assert all(kv.window_part(s) is None for s in hits[:10])
    shorter = kv.local_hit(b, (b.num_tokens - 1) // BS)
    for blocks in range(1, len(shorter) + 1):
        first = kv.window_first(blocks * BS)
        assert all(kv.window_part(s) is not None for s in shorter[first:blocks])
    assert len(shorter) < 10
    kv.free(filler)
    kv.admit(b, shorter, b.num_tokens, start=len(shorter) * BS)
    b.num_computed_tokens = len(shorter) * BS
    check(kv, [b])


def test_parts_are_shared_by_requests_on_one_prefix() -> None:
    kv = manager()
    a = req(list(range(20)))
    kv.admit(a, [], 4, start=0)
    run(kv, a, 20)
    b = req([*range(20), 7, 7, 7])
    hits = kv.local_hit(b, (b.num_tokens - 1) // BS)
    assert len(hits) == 5
    kv.admit(b, hits, b.num_tokens, start=20)
    b.num_computed_tokens = 20
    shared = [s for s in b.slots[b.window_from : 5]]
    assert shared and all(kv.ref_count(kv.window_part(s)[0]) == 2 for s in shared)  # type: ignore[index]
    check(kv, [a, b])


def test_the_connector_hold_keeps_parts_it_still_reads() -> None:
    hold: dict[RequestId, int] = {}
    kv = manager(hold=hold)
    r = req(list(range(40)))
    hold[r.request_id] = 2
    kv.admit(r, [], 4, start=0)
    run(kv, r, 40)
    assert r.window_from == 2
    check(kv, [r])
    hold[r.request_id] = 9
    assert kv.grow(r, 41)
    assert r.window_from == kv.window_first(40)


def test_a_hit_the_connector_reads_whole_needs_every_part() -> None:
    """A request whose put must send its cached prefix again (the store lacks it):
    the hold covers every block, so the hit ends before the first block without a part,
    and admission takes the parts of every hit block."""
    hold: dict[RequestId, int] = {}
    kv = manager(hold=hold)
    a = req(list(range(40)))
    kv.admit(a, [], 4, start=0)
    run(kv, a, 40)
    kv.free(a)
    # 34 never-used slots, then the parts released first (blocks 0 and 1): a filler
    # of 34 blocks and the parts of its last 2 takes exactly those
    filler = req(list(range(500, 500 + 34 * BS)))
    kv.admit(filler, [], filler.num_tokens, start=filler.num_tokens)
    b = req([*range(40), 99, 98])
    assert len(kv.local_hit(b, 10)) == 10  # the window's parts are there
    hold[b.request_id] = 0
    assert kv.local_hit(b, 10) == []  # block 0's part is gone
    hold[b.request_id] = 2
    # from block 2 on every part is there, but the connector's parts are at most a
    # window's worth (2 blocks) and one: the rest is recomputed
    hits = kv.local_hit(b, 10)
    assert len(hits) == 2 + 3
    kv.free(filler)
    kv.admit(b, hits, b.num_tokens, start=len(hits) * BS)
    b.num_computed_tokens = len(hits) * BS
    assert b.window_from == 2  # it holds the parts the connector will read
    check(kv, [b])


def test_growth_fails_whole_when_parts_are_short() -> None:
    kv = manager(num_slots=9)
    r = req(list(range(40)))
    kv.admit(r, [], 4, start=0)  # 1 block + 2 part slots
    run(kv, r, 8)  # 2 blocks: 6 slots
    assert kv.num_free == 3
    assert not kv.grow(r, 13)  # 2 more blocks with parts: 6 slots
    assert len(r.slots) == 2
    check(kv, [r])


def test_max_slots_bounds_a_request_whatever_its_length() -> None:
    kv = manager(num_slots=400)
    for tokens in (4, 40, 400):
        r = req(list(range(tokens)))
        kv.admit(r, [], min(tokens, 8), start=0)
        peak = kv.slots_held(r)
        while r.num_computed_tokens < tokens:
            n = min(8, tokens - r.num_computed_tokens)
            assert kv.grow(r, r.num_computed_tokens + n)
            peak = max(peak, kv.slots_held(r))
            r.num_computed_tokens += n
        assert peak <= kv.max_slots(tokens, 8)
        kv.free(r)


@pytest.mark.parametrize("seed", range(6))
def test_random_workload_keeps_every_invariant(seed: int) -> None:
    """Admissions with prefix hits, chunked growth, frees and pressure: after every
    operation the references, parts and windows agree (``check``)."""
    rng = random.Random(seed)
    kv = manager(num_slots=48)
    live: list[Request] = []
    bases = [[rng.randrange(50) for _ in range(60)] for _ in range(3)]
    for _ in range(300):
        op = rng.random()
        if op < 0.35 and len(live) < 5:
            base = rng.choice(bases)
            r = req(base[: rng.randrange(2, 60)] + [rng.randrange(50) for _ in range(3)])
            hits = kv.local_hit(r, (r.num_tokens - 1) // BS)
            start = len(hits) * BS
            end = min(r.num_tokens, start + rng.choice([1, 4, 9]))
            if kv.can_admit(hits, end, start=start):
                kv.admit(r, hits, end, start=start)
                r.num_computed_tokens = start
                live.append(r)
        elif op < 0.8 and live:
            r = rng.choice(live)
            end = min(r.num_tokens + 8, r.num_computed_tokens + rng.choice([1, 3, 8]))
            if end > r.num_tokens:
                r.output_token_ids.append(rng.randrange(50))
                end = min(end, r.num_tokens)
            if kv.grow(r, end):
                r.num_computed_tokens = end
                kv.cache_blocks(r)
        elif live:
            r = live.pop(rng.randrange(len(live)))
            kv.free(r)
        check(kv, live)
