"""What became findable in a KV cache and what stopped being, between two takes: the
prompt index mirrors it (see :mod:`shared.cluster.block_index`)."""

from __future__ import annotations

from dataclasses import dataclass

from shared.kv.block_hash import BlockKey


@dataclass(frozen=True)
class KVEvents:
    """Keys that became findable here (``stored``) or stopped being (``removed``); with
    sliding layers, those of the findable blocks whose window part became held here
    (``window_stored``) or stopped being (``window_removed``): a prefix is reused only
    as far as its window's blocks have theirs (see :meth:`KVCacheManager.local_hit`).
    Applied removals first, they give the new holdings whatever happened in between."""

    stored: tuple[BlockKey, ...] = ()
    removed: tuple[BlockKey, ...] = ()
    window_stored: tuple[BlockKey, ...] = ()
    window_removed: tuple[BlockKey, ...] = ()

    def __bool__(self) -> bool:
        return bool(self.stored or self.removed or self.window_stored or self.window_removed)


class Changes:
    """Keys added to and removed from a set since the last take, netted: a key added and
    removed in between is in neither list, one removed and added again in both."""

    def __init__(self) -> None:
        self._added: dict[BlockKey, None] = {}
        self._removed: dict[BlockKey, None] = {}

    def add(self, key: BlockKey) -> None:
        self._added[key] = None

    def remove(self, key: BlockKey) -> None:
        if key in self._added:
            del self._added[key]  # never seen outside; an earlier removal stays
        else:
            self._removed[key] = None

    def take(self) -> tuple[tuple[BlockKey, ...], tuple[BlockKey, ...]]:
        """(added, removed), and start over."""
        out = tuple(self._added), tuple(self._removed)
        self._added.clear()
        self._removed.clear()
        return out
