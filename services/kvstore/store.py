"""Block bookkeeping of one KV store node: two-phase puts, reads, leases, eviction.

Pure asyncio logic over an :class:`~services.kvstore.arena.Arena`; the data
plane moves bytes into and out of the views this class hands out.

Life of a block: ``reserve`` (slot allocated, owned by a client, deadline) ->
``write`` whole or by layer ranges (each layer marked when its bytes landed) ->
``commit`` (visible to lookups and whole-block reads, indexed) -> evicted
(LRU, never while leased or in a transfer). ``revoke``, the reservation's
deadline, or its client's last connection closing frees an uncommitted block.

Safety: a slot is never reused while a transfer touches it (``io`` count); a
block dropped during a transfer is marked ``dead`` and its slot freed when the
last transfer ends. Whole-block readers see only committed blocks; layer
streams see only fully written layers and learn at the end whether the
block committed.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from services.kvstore.arena import Arena, Slot
from services.kvstore.metrics import StoreMetrics
from shared.errors import KVBadRequestError, KVMissError, KVNoSpaceError, KVWaitTimeoutError
from shared.kvstore.protocol import BlockSpec, BlockStatus


class IndexSink(Protocol):
    """Told about blocks becoming visible and going away (the Redis index)."""

    def added(self, ids: Sequence[str]) -> None: ...

    def removed(self, ids: Sequence[str]) -> None: ...


@dataclass(frozen=True)
class StoreConfig:
    capacity_bytes: int
    slab_bytes: int = 32 << 20
    high_watermark: float = 0.95
    low_watermark: float = 0.85
    shared: bool = False  # arena in /dev/shm for same-host clients (see arena.py)


@dataclass(eq=False)
class Entry:
    id: str
    slot: Slot
    num_layers: int
    owner: str
    deadline: float
    # bit i: layer i landed (an int, not an array: a node holds tens of thousands of
    # entries and marks them on every write of every block)
    written: int = 0
    committed: bool = False
    io: int = 0  # transfers touching the slot (reads and writes): never freed while > 0
    writing: int = 0  # writes among them (a commit waits for them to settle)
    pins: int = 0
    dead: bool = False

    def mark_written(self, start: int, stop: int) -> None:
        self.written |= (1 << stop) - (1 << start)

    @property
    def complete(self) -> bool:
        """Every layer written."""
        return self.written == (1 << self.num_layers) - 1

    def has_layer(self, layer: int) -> bool:
        return bool(self.written >> layer & 1)

    @property
    def layer_bytes(self) -> int:
        return self.slot.size // self.num_layers

    def span(self, layers: tuple[int, int] | None) -> tuple[int, int]:
        """Bytes ``[start, stop)`` of the block that ``layers`` (None: all) cover."""
        if layers is None:
            return 0, self.slot.size
        return layers[0] * self.layer_bytes, layers[1] * self.layer_bytes


@dataclass(frozen=True)
class Transfer:
    """Blocks pinned for one incoming payload and the views it lands in.

    ``offsets`` are the views' positions in the arena: what a same-host client
    copies to itself. They stay valid (the slots pinned) until :meth:`BlockStore.end_write`.
    """

    entries: list[Entry]
    views: list[np.ndarray]
    layers: tuple[int, int] | None
    offsets: list[int]


@dataclass(frozen=True)
class LeaseRecord:
    ids: tuple[str, ...]
    deadline: float


class BlockStore:
    def __init__(self, config: StoreConfig, metrics: StoreMetrics, index: IndexSink):
        self.config = config
        self.arena = Arena(config.capacity_bytes, config.slab_bytes, shared=config.shared)
        self.metrics = metrics
        self.index = index
        self._entries: dict[str, Entry] = {}
        self._lru: OrderedDict[str, Entry] = OrderedDict()  # committed blocks, oldest first
        self._leases: dict[str, LeaseRecord] = {}
        self._lease_ids = itertools.count(1)
        self._tick = asyncio.Event()

    # ----- two-phase put -------------------------------------------------
    def reserve(
        self, owner: str, specs: Sequence[BlockSpec], num_layers: int, ttl_s: float
    ) -> list[BlockStatus]:
        statuses: list[BlockStatus] = []
        made: list[Entry] = []
        deadline = time.monotonic() + ttl_s
        for spec in specs:
            if spec.size > self.arena.max_block_bytes:
                self._drop_all(made)
                raise KVBadRequestError(
                    f"block {spec.id} of {spec.size} bytes is over the store's "
                    f"largest block ({self.arena.max_block_bytes})"
                )
            old = self._entries.get(spec.id)
            if old is not None:
                statuses.append("exists" if old.committed else "pending")
                continue
            slot = self._allocate(spec.size)
            if slot is None:
                self._drop_all(made)
                raise KVNoSpaceError(f"no room for {len(specs)} blocks: all space is leased")
            entry = Entry(spec.id, slot, num_layers, owner, deadline)
            self._entries[spec.id] = entry
            made.append(entry)
            statuses.append("reserved")
        return statuses

    def begin_write(self, ids: Sequence[str], layers: tuple[int, int] | None) -> Transfer:
        """Pins the blocks and returns views to receive into; always call :meth:`end_write`."""
        entries = []
        for block_id in ids:
            entry = self._entries.get(block_id)
            if entry is None or entry.committed:
                why = "is committed" if entry else "is not reserved"
                raise KVBadRequestError(f"cannot write block {block_id}: it {why}", [block_id])
            entries.append(entry)
        views = [self._slice(e, layers) for e in entries]
        for entry in entries:
            entry.io += 1
            entry.writing += 1
        return Transfer(entries, views, layers, self.offsets(entries, layers))

    def end_write(self, transfer: Transfer, ok: bool) -> None:
        for entry in transfer.entries:
            if ok and not entry.dead:
                start, stop = transfer.layers or (0, entry.num_layers)
                entry.mark_written(start, stop)
            entry.writing -= 1
            self._io_done(entry)
        self._notify()  # readers of the layers, and commits waiting for writes to settle

    async def settled(self, ids: Sequence[str], deadline: float) -> None:
        """Until no write to ``ids`` is in flight, or ``deadline``; never raises.

        A local writer's ``ack`` is not answered, so its commit on another
        connection can arrive first; the commit waits here for that ack."""
        while True:
            busy = any((e := self._entries.get(i)) is not None and e.writing for i in ids)
            tick, remaining = self._tick, deadline - time.monotonic()
            if not busy or remaining <= 0:
                return
            try:
                await asyncio.wait_for(tick.wait(), remaining)
            except TimeoutError:
                continue

    def commit(self, ids: Sequence[str]) -> None:
        entries = [self._entries.get(i) for i in ids]
        missing = [i for i, e in zip(ids, entries, strict=True) if e is None]
        if missing:
            raise KVMissError(f"{len(missing)} blocks are not reserved", missing)
        incomplete = [e.id for e in entries if e is not None and not e.complete]
        if incomplete:
            raise KVBadRequestError(
                f"{len(incomplete)} blocks are not completely written", incomplete
            )
        fresh = [e for e in entries if e is not None and not e.committed]
        for entry in fresh:
            entry.committed = True
            self._lru[entry.id] = entry
        self.index.added([e.id for e in fresh])
        self._notify()
        if self.arena.used_bytes > self.config.high_watermark * self.arena.capacity:
            self._evict(self.arena.capacity * self.config.low_watermark)

    def revoke(self, ids: Sequence[str]) -> int:
        doomed = [e for i in ids if (e := self._entries.get(i)) is not None and not e.committed]
        self._drop_all(doomed)
        return len(doomed)

    # ----- reads ---------------------------------------------------------
    def lookup(self, ids: Sequence[str]) -> int:
        hits = 0
        for block_id in ids:
            entry = self._entries.get(block_id)
            if entry is None or not entry.committed:
                break
            hits += 1
        self.metrics.lookup(hits, len(ids))
        return hits

    def open_read(self, ids: Sequence[str]) -> list[Entry]:
        """Pin the blocks for a read; unknown ids are a miss right away."""
        entries = [self._entries.get(i) for i in ids]
        missing = [i for i, e in zip(ids, entries, strict=True) if e is None]
        self.metrics.reads(len(ids) - len(missing), len(missing))
        if missing:
            raise KVMissError(f"{len(missing)} of {len(ids)} blocks are not held", missing)
        pinned = [e for e in entries if e is not None]
        for entry in pinned:
            entry.io += 1
            if entry.committed:
                self._lru.move_to_end(entry.id)
        return pinned

    def close_read(self, entries: Sequence[Entry]) -> None:
        for entry in entries:
            self._io_done(entry)

    async def wait_for(self, entries: Sequence[Entry], layer: int | None, deadline: float) -> None:
        """Until every entry has ``layer`` written (None: is committed), or raise."""
        while True:
            dead = [e.id for e in entries if e.dead]
            if dead:
                raise KVMissError(f"{len(dead)} blocks were revoked while being read", dead)
            ready = all(e.committed if layer is None else e.has_layer(layer) for e in entries)
            if ready:
                return
            tick, remaining = self._tick, deadline - time.monotonic()
            if remaining <= 0:
                raise KVWaitTimeoutError("blocks being written did not complete in time")
            try:
                await asyncio.wait_for(tick.wait(), remaining)
            except TimeoutError:
                continue

    def views(self, entries: Sequence[Entry], layers: tuple[int, int] | None) -> list[np.ndarray]:
        for entry in entries:
            if layers is not None and layers[1] > entry.num_layers:
                raise KVBadRequestError(
                    f"layers {layers} outside block {entry.id}'s {entry.num_layers}"
                )
        return [self._slice(e, layers) for e in entries]

    def offsets(self, entries: Sequence[Entry], layers: tuple[int, int] | None) -> list[int]:
        """Where each entry's ``layers`` start in the arena; valid only while pinned (``io``)."""
        return [e.slot.offset + e.span(layers)[0] for e in entries]

    # ----- leases, owners, expiry ------------------------------------------
    def lease(self, ids: Sequence[str], ttl_s: float) -> str:
        entries = [self._entries.get(i) for i in ids]
        missing = [i for i, e in zip(ids, entries, strict=True) if e is None or not e.committed]
        if missing:
            raise KVMissError(f"{len(missing)} blocks are not held", missing)
        lease_id = f"L{next(self._lease_ids)}"
        self._leases[lease_id] = LeaseRecord(tuple(ids), time.monotonic() + ttl_s)
        for entry in entries:
            if entry is not None:
                entry.pins += 1
        return lease_id

    def release(self, lease_id: str) -> None:
        record = self._leases.pop(lease_id, None)
        if record is None:
            raise KVMissError(f"unknown or expired lease {lease_id}")
        for block_id in record.ids:
            entry = self._entries.get(block_id)
            if entry is not None:
                entry.pins -= 1

    def client_gone(self, owner: str) -> int:
        """The owner's last connection closed: its uncommitted reservations are freed."""
        doomed = [e for e in self._entries.values() if e.owner == owner and not e.committed]
        self._drop_all(doomed)
        return len(doomed)

    def expire(self, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        for lease_id in [k for k, r in self._leases.items() if r.deadline <= now]:
            self.release(lease_id)
        stale = [e for e in self._entries.values() if not e.committed and e.deadline <= now]
        self._drop_all(stale)
        self.metrics.reservations_expired.inc(len(stale))

    def close(self) -> None:
        """Release the arena (and its shared file); the store is unusable afterwards."""
        self.arena.close()

    def held_ids(self) -> list[str]:
        return list(self._lru)

    def stats(self) -> dict[str, float]:
        reserved = sum(1 for e in self._entries.values() if not e.committed)
        return {
            "blocks_held": len(self._lru),
            "blocks_reserved": reserved,
            "bytes_used": self.arena.used_bytes,
            "capacity_bytes": self.arena.capacity,
            "leases": len(self._leases),
        }

    # ----- internals -----------------------------------------------------
    def _slice(self, entry: Entry, layers: tuple[int, int] | None) -> np.ndarray:
        if layers is None:
            return self.arena.view(entry.slot)
        start, stop = layers
        if stop > entry.num_layers:
            raise KVBadRequestError(
                f"layers [{start}, {stop}) outside block {entry.id}'s {entry.num_layers}",
                [entry.id],
            )
        return self.arena.view(entry.slot, *entry.span(layers))

    def _allocate(self, size: int) -> Slot | None:
        slot = self.arena.allocate(size)
        while slot is None and self._evict_one():
            slot = self.arena.allocate(size)
        return slot

    def _evict(self, target_bytes: float) -> None:
        """The least recently committed blocks no transfer or lease holds, until the
        arena's use is down to ``target_bytes``: dropped together (one index update)."""
        excess = self.arena.used_bytes - target_bytes
        victims = []
        for entry in self._lru.values():
            if excess <= 0:
                break
            if entry.pins == 0 and entry.io == 0:
                victims.append(entry)
                excess -= entry.slot.size
        self._drop_all(victims)
        self.metrics.evictions.inc(len(victims))

    def _evict_one(self) -> bool:
        victim = next((e for e in self._lru.values() if e.pins == 0 and e.io == 0), None)
        if victim is None:
            return False
        self._drop_all([victim])
        self.metrics.evictions.inc()
        return True

    def _drop_all(self, entries: Sequence[Entry]) -> None:
        gone = []
        for entry in entries:
            if self._entries.get(entry.id) is not entry:
                continue
            del self._entries[entry.id]
            if entry.committed:
                del self._lru[entry.id]
                gone.append(entry.id)
            entry.dead = True
            if entry.io == 0:
                self.arena.free(entry.slot)
        if gone:
            self.index.removed(gone)
        if entries:
            self._notify()

    def _io_done(self, entry: Entry) -> None:
        entry.io -= 1
        if entry.dead and entry.io == 0:
            self.arena.free(entry.slot)

    def _notify(self) -> None:
        self._tick.set()
        self._tick = asyncio.Event()
