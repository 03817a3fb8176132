from __future__ import annotations

import itertools

import pytest

from services.kvstore.arena import Arena, Slot

MB = 1 << 20


def test_slots_do_not_overlap_and_stay_inside_their_slab() -> None:
    arena = Arena(8 * MB, 2 * MB, pinned=False)
    slots = [arena.allocate(700_000) for _ in range(8)]  # 2 per slab
    assert all(s is not None for s in slots)
    spans = sorted((s.offset, s.offset + s.size) for s in slots if s is not None)
    assert all(a_end <= b_start for (_, a_end), (b_start, _) in itertools.pairwise(spans))
    for start, end in spans:
        assert start // (2 * MB) == (end - 1) // (2 * MB)
    assert arena.allocate(700_000) is None  # 4 slabs x 2 slots
    assert arena.used_bytes == 8 * 700_000


def test_empty_slab_goes_back_for_another_size() -> None:
    arena = Arena(2 * MB, 1 * MB, pinned=False)
    a, b = arena.allocate(600_000), arena.allocate(600_000)
    assert a is not None and b is not None
    assert arena.allocate(300_000) is None
    arena.free(a)
    small = [arena.allocate(300_000) for _ in range(3)]
    assert all(s is not None for s in small)
    arena.free(b)
    assert arena.allocate(1 * MB) is not None


def test_views_address_the_slot() -> None:
    arena = Arena(2 * MB, 1 * MB, pinned=False)
    slot = arena.allocate(1000)
    assert slot is not None
    arena.view(slot)[:] = 7
    assert arena.view(slot, 10, 20).sum() == 70
    assert arena.buffer[slot.offset : slot.offset + 1000].sum() == 7000


def test_rejects_bad_sizes() -> None:
    with pytest.raises(ValueError):
        Arena(MB, 2 * MB, pinned=False)
    arena = Arena(2 * MB, MB, pinned=False)
    with pytest.raises(ValueError):
        arena.allocate(MB + 1)
    with pytest.raises(ValueError):
        arena.allocate(0)
    assert isinstance(arena.allocate(MB), Slot)
