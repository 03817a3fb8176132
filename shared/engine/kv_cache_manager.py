"""The KV cache manager: the one owner of an engine's KV pool slots.

Pure Python, no tensors. It alone allocates slots, keeps their reference
counts, maps block keys to the slots that hold them (the local prefix cache)
and evicts: a slot whose count drops to zero stays findable by its key until
the allocator reuses it, least recently freed first (LRU over unreferenced
slots). It also writes each request's slot list (``Request.slots``) and how
many of its leading blocks are registered (``Request.num_cached_blocks``);
nothing else writes those.

Every key that becomes findable or stops being findable is recorded as a
:class:`KVEvents` entry, which the engine hands to whoever publishes this
instance's holdings (the cluster's prompt index).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import NewType

from shared.engine.request import Request
from shared.kv.block_hash import BlockHasher, BlockKey

Slot = NewType("Slot", int)


class OutOfSlotsError(RuntimeError):
    """Fewer slots are free than an allocation asked for."""


@dataclass(frozen=True)
class KVEvents:
    """Keys that became findable here (``stored``) or stopped being (``removed``)."""

    stored: tuple[BlockKey, ...] = ()
    removed: tuple[BlockKey, ...] = ()

    def __bool__(self) -> bool:
        return bool(self.stored or self.removed)


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    def __init__(self, num_slots: int, hasher: BlockHasher, *, enable_caching: bool = True):
        if num_slots < 1:
            raise ValueError("a KV pool needs at least one slot")
        self.num_slots = num_slots
        self.hasher = hasher
        self.block_size = hasher.block_size
        self.enable_caching = enable_caching
        self._refs = [0] * num_slots
        self._key_of: list[BlockKey | None] = [None] * num_slots
        # unreferenced slots in eviction order (front: reused first)
        self._free: OrderedDict[Slot, None] = OrderedDict((Slot(i), None) for i in range(num_slots))
        self._slot_of: dict[BlockKey, Slot] = {}
        self._stored: list[BlockKey] = []
        self._removed: list[BlockKey] = []

    # -- reading -----------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        """Slots with no reference (cached content in them is evictable)."""
        return len(self._free)

    @property
    def num_cached(self) -> int:
        return len(self._slot_of)

    def usage(self) -> float:
        return 1.0 - self.num_free / self.num_slots

    def ref_count(self, slot: Slot) -> int:
        return self._refs[slot]

    def blocks_for(self, num_tokens: int) -> int:
        return cdiv(num_tokens, self.block_size)

    def held_keys(self) -> list[BlockKey]:
        return list(self._slot_of)

    # -- block keys ----------------------------------------------------------------------
    def update_keys(self, req: Request) -> None:
        """Extend ``req.block_keys`` over every full block of its known tokens."""
        n_full = req.num_tokens // self.block_size
        if len(req.block_keys) < n_full:
            self.hasher.extend(req.block_keys, req.all_token_ids, req.cache_salt)

    def local_hit(self, req: Request, max_blocks: int) -> list[Slot]:
        """Slots of the longest prefix of ``req``'s first ``max_blocks`` blocks held here
        (takes no reference)."""
        if not self.enable_caching:
            return []
        self.update_keys(req)
        found: list[Slot] = []
        for key in req.block_keys[:max_blocks]:
            slot = self._slot_of.get(key)
            if slot is None:
                break
            found.append(slot)
        return found

    def uncached_prompt_blocks(self, req: Request) -> set[BlockKey]:
        """Keys of ``req``'s full prompt blocks not registered yet: those it computes."""
        if not self.enable_caching:
            return set()
        full = req.num_prompt_tokens // self.block_size
        return set(req.block_keys[req.num_cached_blocks : full])

    def waits_for_computing(self, req: Request, computing: set[BlockKey]) -> bool:
        """Whether the first block ``req`` would compute is in ``computing`` (being
        computed right now by a running request): then it should wait for that block
        and reuse it (in-batch prefix caching, as SGLang does), not compute a copy."""
        if not computing:
            return False
        usable = (req.num_tokens - 1) // self.block_size
        first = len(self.local_hit(req, usable))
        return first < usable and req.block_keys[first] in computing

    # -- a request's slots -------------------------------------------------------------------
    def can_admit(self, hits: Sequence[Slot], num_tokens: int, headroom: int = 0) -> bool:
        """Whether :meth:`admit` would succeed and leave ``headroom`` slots free."""
        need = self.blocks_for(num_tokens) - len(hits)
        taken_hits = sum(1 for s in hits if self._refs[s] == 0)
        return need + headroom <= self.num_free - taken_hits

    def admit(self, req: Request, hits: Sequence[Slot], num_tokens: int) -> None:
        """Give ``req`` the cached ``hits`` (shared) plus fresh slots up to ``num_tokens``."""
        if req.slots:
            raise ValueError(f"request {req.request_id} already holds slots")
        if not self.can_admit(hits, num_tokens):
            raise OutOfSlotsError(f"{num_tokens} tokens do not fit in {self.num_free} free slots")
        self._acquire(hits)
        req.slots = [*hits, *self._allocate(self.blocks_for(num_tokens) - len(hits))]
        req.num_cached_blocks = len(hits)

    def grow(self, req: Request, num_tokens: int) -> bool:
        """Make ``req``'s slots cover ``num_tokens``; False (nothing taken) if too few free."""
        need = self.blocks_for(num_tokens) - len(req.slots)
        if need <= 0:
            return True
        if need > self.num_free:
            return False
        req.slots.extend(self._allocate(need))
        return True

    def cache_blocks(self, req: Request) -> None:
        """Register every full, computed block of ``req`` under its key."""
        full = req.num_computed_tokens // self.block_size
        if full <= req.num_cached_blocks:
            return
        self.update_keys(req)
        if self.enable_caching:
            for i in range(req.num_cached_blocks, full):
                self._register(req.slots[i], req.block_keys[i])
        req.num_cached_blocks = full

    def free(self, req: Request) -> None:
        """Drop ``req``'s references, last block first, so its tail is evicted before the
        prefix it may share with others."""
        self._release(reversed(req.slots))
        req.slots = []
        req.num_cached_blocks = 0

    def take_events(self) -> KVEvents:
        events = KVEvents(tuple(self._stored), tuple(self._removed))
        self._stored.clear()
        self._removed.clear()
        return events

    # -- slots -------------------------------------------------------------------------------
    def _allocate(self, n: int) -> list[Slot]:
        if n > len(self._free):
            raise OutOfSlotsError(f"need {n} slots, {len(self._free)} free")
        out: list[Slot] = []
        for _ in range(n):
            slot, _unused = self._free.popitem(last=False)
            key = self._key_of[slot]
            if key is not None:  # evict its cached content
                del self._slot_of[key]
                self._key_of[slot] = None
                self._removed.append(key)
            self._refs[slot] = 1
            out.append(slot)
        return out

    def _acquire(self, slots: Iterable[Slot]) -> None:
        for slot in slots:
            if self._refs[slot] == 0:
                del self._free[slot]
            self._refs[slot] += 1

    def _release(self, slots: Iterable[Slot]) -> None:
        for slot in slots:
            if self._refs[slot] <= 0:
                raise ValueError(f"slot {slot} released more often than acquired")
            self._refs[slot] -= 1
            if self._refs[slot] == 0:
                self._free[slot] = None
                if self._key_of[slot] is None:
                    # nothing cached: reuse it first (its memory is warm, nothing is lost)
                    self._free.move_to_end(slot, last=False)

    def _register(self, slot: Slot, key: BlockKey) -> None:
        if self._key_of[slot] is not None or key in self._slot_of:
            return  # already cached (possibly as another physical copy): keep the first
        self._key_of[slot] = key
        self._slot_of[key] = slot
        self._stored.append(key)
