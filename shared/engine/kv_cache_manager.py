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

With sliding-window layers (:mod:`shared.kv.layer_groups`) a block's slot holds
its full-attention layers, and a *window part* (one more slot per sliding
group) holds its sliding layers while some row still to be computed reads them.
A request holds the parts of its blocks from ``Request.window_from`` on; the
manager moves that forward as the request computes (never past what
``window_hold`` says the KV connector still reads) and a part nobody holds
stays attached to its block, cached and evictable like a slot. A prefix is
reused only up to a block whose window (the blocks the next row reads) still
has every part. Parts and slots come from one free list: the groups share the
pool's memory as the requests' lengths change.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from typing import NewType

from shared.engine.kv_events import Changes, KVEvents
from shared.engine.request import Request
from shared.kv.block_hash import BlockHasher, BlockKey
from shared.kv.layer_groups import LayerGroups

Slot = NewType("Slot", int)
WindowPart = tuple[Slot, ...]  # a block's slots of the sliding groups, in group order
WindowHold = Callable[[Request], "int | None"]
PartChange = Callable[[Slot, "WindowPart | None"], None]


class OutOfSlotsError(RuntimeError):
    """Fewer slots are free than an allocation asked for."""


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    def __init__(
        self,
        num_slots: int,
        hasher: BlockHasher,
        *,
        enable_caching: bool = True,
        groups: LayerGroups | None = None,
        window_hold: WindowHold | None = None,
        on_part: PartChange | None = None,
    ):
        """``groups``: the pool's layer groups (None: one, every block in one slot).
        ``window_hold(req)``: the first block of ``req`` whose window part must stay
        (the connector still reads it from the pool); None: none. ``on_part(slot,
        part)``: told each time a block's part is attached (or detached: None)."""
        if num_slots < 1:
            raise ValueError("a KV pool needs at least one slot")
        self.num_slots = num_slots
        self.hasher = hasher
        self.block_size = hasher.block_size
        self.enable_caching = enable_caching
        windowed = groups is not None and groups.windowed and groups.window is not None
        self.window = groups.window if windowed and groups is not None else None
        self.part_size = groups.num_window_groups if windowed and groups is not None else 0
        self.window_hold = window_hold
        self.on_part = on_part
        self._refs = [0] * num_slots
        self._key_of: list[BlockKey | None] = [None] * num_slots
        # unreferenced slots in eviction order (front: reused first)
        self._free: OrderedDict[Slot, None] = OrderedDict((Slot(i), None) for i in range(num_slots))
        self._slot_of: dict[BlockKey, Slot] = {}
        self._part: dict[Slot, WindowPart] = {}  # a block's slot -> its window part
        self._owner: dict[Slot, Slot] = {}  # a window part's slot -> its block's slot
        self._keys = Changes()  # findable keys
        self._window_keys = Changes()  # of those, the ones whose part is attached

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

    def window_keys(self) -> list[BlockKey]:
        """The held keys whose blocks have their window part attached."""
        return [k for k, s in self._slot_of.items() if s in self._part]

    def window_part(self, slot: int) -> WindowPart | None:
        """The window part attached to the block in ``slot`` (None: none, or no
        sliding layers). Stable while a request holds it."""
        return self._part.get(Slot(slot))

    def window_first(self, start: int) -> int:
        """The first block whose window part a request computing from position
        ``start`` keeps: the first its row ``start - 1`` reads in a sliding layer (one
        row back, so a request may always recompute its last token: a resumed one
        does)."""
        if self.window is None:
            return 0
        return max(0, start - self.window) // self.block_size

    def slots_held(self, req: Request) -> int:
        """Slots ``req`` holds references on (its blocks' and its window parts')."""
        return len(req.slots) + self.part_size * (len(req.slots) - req.window_from)

    def max_slots(self, num_tokens: int, max_chunk: int) -> int:
        """The most slots one request of ``num_tokens`` ever holds at once, computing
        at most ``max_chunk`` tokens a step."""
        blocks = self.blocks_for(num_tokens)
        if not self.part_size or self.window is None:
            return blocks
        # the window and the step's chunk, and the chunk before it, whose parts stay
        # until replication has staged them (at the next step's start)
        in_window = cdiv(self.window - 1 + 2 * max_chunk, self.block_size) + 2
        return blocks + self.part_size * min(blocks, in_window)

    # -- block keys ----------------------------------------------------------------------
    def update_keys(self, req: Request) -> None:
        """Extend ``req.block_keys`` over every full block of its known tokens."""
        n_full = req.num_tokens // self.block_size
        if len(req.block_keys) < n_full:
            self.hasher.extend(req.block_keys, req.all_token_ids, req.cache_salt)

    def local_hit(self, req: Request, max_blocks: int) -> list[Slot]:
        """Slots of the longest prefix of ``req``'s first ``max_blocks`` blocks held here
        (takes no reference); with sliding layers, the longest whose window (the blocks
        its next row reads) still has every part, as has every block from
        ``window_hold(req)`` on (the connector will read them whole)."""
        if not self.enable_caching:
            return []
        self.update_keys(req)
        found: list[Slot] = []
        for key in req.block_keys[:max_blocks]:
            slot = self._slot_of.get(key)
            if slot is None:
                break
            found.append(slot)
        n = len(found)
        hold = self._hold(req) if self.part_size else 0
        if self.part_size and self.window is not None and hold < n:
            # parts held for the connector from ``hold`` on: no more than a window's
            # worth of them, so the request holds what max_slots allows (the blocks
            # past that are recomputed, and sent as they are)
            n = min(n, hold + cdiv(self.window, self.block_size) + 1)
        while self.part_size and n:
            first = min(self.window_first(n * self.block_size), hold)
            missing = [i for i in range(first, n) if found[i] not in self._part]
            if not missing:
                break
            n = missing[-1]  # a prefix ending before the last block without its part
        return found[:n]

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
    def can_admit(
        self,
        hits: Sequence[Slot],
        num_tokens: int,
        headroom: int = 0,
        start: int = 0,
        req: Request | None = None,
    ) -> bool:
        """Whether :meth:`admit` would succeed and leave ``headroom`` blocks' slots free
        (``start``: the first position the request computes; ``req``: the request,
        whose ``window_hold`` counts)."""
        blocks = self.blocks_for(num_tokens)
        need = blocks - len(hits)
        taken = sum(1 for s in hits if self._refs[s] == 0)
        if self.part_size:
            first = self._parts_from(req, start, blocks)
            for i in range(first, blocks):
                part = self._part.get(hits[i]) if i < len(hits) else None
                if part is None:
                    need += self.part_size
                elif self._refs[part[0]] == 0:
                    taken += self.part_size
        return need + taken + headroom * (1 + self.part_size) <= self.num_free

    def admit(self, req: Request, hits: Sequence[Slot], num_tokens: int, start: int = 0) -> None:
        """Give ``req`` the cached ``hits`` (shared) plus fresh slots up to ``num_tokens``,
        and window parts for the blocks its rows from position ``start`` on read."""
        if req.slots:
            raise ValueError(f"request {req.request_id} already holds slots")
        if not self.can_admit(hits, num_tokens, start=start, req=req):
            raise OutOfSlotsError(f"{num_tokens} tokens do not fit in {self.num_free} free slots")
        blocks = self.blocks_for(num_tokens)
        first = self._parts_from(req, start, blocks)
        if any(self._part.get(slot) is None for slot in hits[first:]):
            raise ValueError("a cached block the request needs whole has no window part")
        self._acquire(hits)
        for slot in hits[first:]:  # before any allocation, which could evict them
            self._acquire(self._part[slot])
        req.slots = [*hits, *self._allocate(blocks - len(hits))]
        req.num_cached_blocks = len(hits)
        req.window_from = first if self.part_size else 0
        for slot in req.slots[max(first, len(hits)) :] if self.part_size else ():
            self._attach_part(slot)

    def grow(self, req: Request, num_tokens: int) -> bool:
        """Make ``req``'s slots cover ``num_tokens``; False (nothing taken) if too few
        free. Window parts no row from ``req.num_computed_tokens`` on reads go first."""
        self._advance_window(req)
        need = self.blocks_for(num_tokens) - len(req.slots)
        if need <= 0:
            return True
        if need * (1 + self.part_size) > self.num_free:
            return False
        new = self._allocate(need)
        req.slots.extend(new)
        for slot in new:
            self._attach_part(slot)
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
        for slot in reversed(req.slots[req.window_from :] if self.part_size else []):
            self._release(self._part[slot])
        self._release(reversed(req.slots))
        req.slots = []
        req.num_cached_blocks = 0
        req.window_from = 0

    def take_events(self) -> KVEvents:
        stored, removed = self._keys.take()
        window_stored, window_removed = self._window_keys.take()
        events = KVEvents(stored, removed, window_stored, window_removed)
        return events

    # -- window parts ---------------------------------------------------------------------
    def _hold(self, req: Request | None) -> int:
        """The first block of ``req`` the connector still reads whole (a large number:
        none)."""
        hold = None if req is None or self.window_hold is None else self.window_hold(req)
        return (1 << 62) if hold is None else hold

    def _parts_from(self, req: Request | None, start: int, blocks: int) -> int:
        """The first of ``blocks`` blocks whose part a request computing from ``start``
        holds: its window's, or the connector's hold if earlier."""
        if not self.part_size:
            return blocks
        return min(self.window_first(start), self._hold(req), blocks)

    def _advance_window(self, req: Request) -> None:
        """Release the parts of ``req``'s blocks before the window of its next row."""
        if not self.part_size:
            return
        first = self._parts_from(req, req.num_computed_tokens, len(req.slots))
        if first <= req.window_from:
            return
        for slot in req.slots[req.window_from : first]:
            self._release(self._part[slot])
        req.window_from = first

    def _attach_part(self, slot: Slot) -> None:
        """Give the block in ``slot`` (just allocated: nothing attached) a fresh part."""
        if not self.part_size:
            return
        part = tuple(self._allocate(self.part_size))
        self._part[slot] = part
        for s in part:
            self._owner[s] = slot
        if (key := self._key_of[slot]) is not None:
            self._window_keys.add(key)
        if self.on_part is not None:
            self.on_part(slot, part)

    def _detach_part(self, slot: Slot) -> None:
        """The block in ``slot`` loses its (unreferenced) part, whose slots are reused
        first."""
        part = self._part.pop(slot, None)
        if part is None:
            return
        if (key := self._key_of[slot]) is not None:
            self._window_keys.remove(key)
        for s in part:
            del self._owner[s]
            if s in self._free:
                self._free.move_to_end(s, last=False)
        if self.on_part is not None:
            self.on_part(slot, None)

    # -- slots -------------------------------------------------------------------------------
    def _allocate(self, n: int) -> list[Slot]:
        if n > len(self._free):
            raise OutOfSlotsError(f"need {n} slots, {len(self._free)} free")
        out: list[Slot] = []
        for _ in range(n):
            slot, _unused = self._free.popitem(last=False)
            if self.part_size:
                self._detach_part(slot)  # it held a block: its part goes too
                owner = self._owner.get(slot)
                if owner is not None:  # it held a part: that block loses it
                    self._detach_part(owner)
            key = self._key_of[slot]
            if key is not None:  # evict its cached content
                del self._slot_of[key]
                self._key_of[slot] = None
                self._keys.remove(key)
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
                block = self._owner.get(slot, slot)  # a part's slot: its block's
                if self._key_of[block] is None:
                    # nothing cached: reuse it first (its memory is warm, nothing is lost)
                    self._free.move_to_end(slot, last=False)
                    if block == slot:
                        self._detach_part(slot)

    def _register(self, slot: Slot, key: BlockKey) -> None:
        if self._key_of[slot] is not None or key in self._slot_of:
            return  # already cached (possibly as another physical copy): keep the first
        self._key_of[slot] = key
        self._slot_of[key] = slot
        self._keys.add(key)
        if slot in self._part:
            self._window_keys.add(key)
