"""Holdings changes are netted between takes, so a reader that applies removals first
ends with the true holdings whatever order they happened in."""

from __future__ import annotations

import random

from shared.engine.kv_events import Changes
from shared.kv.block_hash import BlockKey


def test_netted_changes_replay_to_the_true_set_in_any_order() -> None:
    rng = random.Random(0)
    keys = [BlockKey(bytes([i])) for i in range(6)]
    changes, truth, mirror = Changes(), set[BlockKey](), set[BlockKey]()
    for step in range(2000):
        key = rng.choice(keys)
        if key in truth:
            truth.discard(key)
            changes.remove(key)
        else:
            truth.add(key)
            changes.add(key)
        if step % rng.randint(1, 7) == 0:
            added, removed = changes.take()
            assert not set(added) & (set(removed) - mirror)  # re-added ones were there
            mirror.difference_update(removed)
            mirror.update(added)
            assert mirror == truth


def test_added_then_removed_between_takes_is_never_seen() -> None:
    changes = Changes()
    a, b = BlockKey(b"a"), BlockKey(b"b")
    changes.add(a)
    changes.remove(a)
    changes.remove(b)
    changes.add(b)
    assert changes.take() == ((b,), (b,))
    assert changes.take() == ((), ())
