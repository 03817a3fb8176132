"""The transfers the KV-store connector runs on the event loop, and what the engine
thread and the event loop share about them.

A :class:`Load` streams blocks from the store into pool slots, layer by
layer; a :class:`PutJob` writes a request's blocks into a two-phase put as
their layers become final, then commits. Both are state machines whose state
the engine thread reads under the connector's condition and never waits on
without a bound.
"""

from __future__ import annotations

import asyncio
import queue
import threading
from dataclasses import dataclass, field

import torch

from shared.engine.kv_cache_manager import Slot
from shared.engine.kv_connector import ConnectorEvents
from shared.engine.request import RequestId
from shared.kvstore.client import LeaseSet, PutHandle
from shared.kvstore.pool_copies import Ready, SlotBytes


@dataclass(eq=False)
class Load:
    """Blocks ``ids`` of a request loading into ``slots``.

    Engine thread and event loop share ``layers``, ``error``, ``done`` and
    ``abandoned`` under the connector's condition; ``task`` is the event loop's.
    """

    request_id: RequestId
    ids: list[str]
    slots: list[Slot]
    asynchronous: bool
    wait_s: float
    lease: LeaseSet | None
    layers: int = 0  # leading layers that landed
    # per landed layer: when its bytes are in the slots (a staged pool copies after landing)
    layer_ready: list[Ready] = field(default_factory=list)
    error: BaseException | None = None
    done: bool = False  # nothing writes into the slots any more
    abandoned: bool = False  # its request ended first: report it released when done
    task: asyncio.Task[None] | None = None

    @property
    def failed(self) -> bool:
        return self.done and self.error is not None


@dataclass(frozen=True)
class LayerItem:
    """Blocks ``indices`` of a put job, their ``layer`` (None: whole blocks), as ``copy``
    holds them (the pool's own bytes, or a staged host copy). A staged copy waits for
    the job's ``send_staged`` unless made only because the put's reservation was not
    back yet (``staged_for_reservation``)."""

    layer: int | None
    indices: list[int]
    copy: SlotBytes
    staged_for_reservation: bool = False

    @property
    def held(self) -> bool:
        """Its write waits for ``send_staged`` (a host copy, held for the first token)."""
        return not self.copy.reads_pool and not self.staged_for_reservation


@dataclass(eq=False)
class PutJob:
    """A request's blocks in a two-phase put, written layer by layer (or whole, after
    their last layer), committed once every block the store lacked is written.

    ``next_block``/``step_start`` belong to the engine thread; the rest to the
    event loop. The put's reservation (``reserved``) may still be on its way while
    the request computes (its round trip is not on the way to the first token):
    until it resolves, ``needed`` is every block, so the engine stages them all;
    then it is the block indices some replica reserved (the store lacks them), and
    the writer, which waits for the reservation before its first write, sends only
    those (a handle sends each replica only what it reserved).
    """

    request_id: RequestId
    reserved: asyncio.Future[PutHandle]
    ids: list[str]
    needed: frozenset[int]
    whole_blocks: bool
    committed: asyncio.Future[None]
    queue: asyncio.Queue[LayerItem | None] = field(default_factory=asyncio.Queue)  # None: stop
    written: set[int] = field(default_factory=set)
    failed: bool = False
    next_block: int = 0  # blocks planned so far (engine thread)
    step_start: int = 0  # the first block planned in the current step (engine thread)
    writer: asyncio.Task[None] | None = None
    # staged copies (out of the pool already: nothing waits for them) are sent once this
    # is set. The prefill role clears it until the request's first token has left: sent
    # at once, they took the CPU and the GIL that the step's last work and that token's
    # way out need (a 512-token step ran ~13 ms longer on 2 cores)
    send_staged: asyncio.Event = field(default_factory=lambda: _set(asyncio.Event()))
    # a copy waiting for send_staged is queued (engine thread): a later item of the
    # pool's own bytes would queue behind it while the step waits for it to leave
    holds_copies: bool = False
    held_bytes: int = 0  # copies made while send_staged was not set (engine thread)

    @property
    def complete(self) -> bool:
        return self.written >= self.needed


def _set(event: asyncio.Event) -> asyncio.Event:
    event.set()
    return event


class Events:
    """Thread-safe sets of finished transfers, drained by :meth:`take`."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._loaded: set[RequestId] = set()
        self._failed: set[RequestId] = set()
        self._released: set[RequestId] = set()

    def loaded(self, rid: RequestId) -> None:
        with self._lock:
            self._loaded.add(rid)

    def failed(self, rid: RequestId) -> None:
        with self._lock:
            self._failed.add(rid)

    def released(self, rid: RequestId) -> None:
        with self._lock:
            self._released.add(rid)

    def take(self) -> ConnectorEvents:
        with self._lock:
            events = ConnectorEvents(
                frozenset(self._loaded), frozenset(self._failed), frozenset(self._released)
            )
            self._loaded.clear()
            self._failed.clear()
            self._released.clear()
        return events


class StagingPool:
    """Preallocated block-sized host buffers (``[count, block_bytes]``, pinned for a CUDA
    pool): a completed block is copied into one on the engine thread (tens of
    microseconds) and written from there on the event loop, so the write never holds the
    block's slot. Taken on the engine thread, given back from any thread; when none is
    free, the caller skips (replication lags, never blocks)."""

    def __init__(self, buffers: torch.Tensor):
        self.buffers = buffers
        count = buffers.shape[0]
        self._free: queue.SimpleQueue[int] = queue.SimpleQueue()
        for i in range(count):
            self._free.put(i)

    def take(self) -> int | None:
        try:
            return self._free.get_nowait()
        except queue.Empty:
            return None

    def give(self, index: int) -> None:
        self._free.put(index)

    def take_many(self, count: int) -> list[int] | None:
        """``count`` buffers at once, or None (and none taken) when fewer are free."""
        taken: list[int] = []
        for _ in range(count):
            index = self.take()
            if index is None:
                for i in taken:
                    self.give(i)
                return None
            taken.append(index)
        return taken


@dataclass(eq=False)
class Replication:
    """A decode request's blocks on their way to the store, and how far they got.

    ``ids`` names the request's blocks in order (the prompt's from prefill, then one
    per block decode completed); the engine thread appends to it and advances
    ``staged`` (blocks written or being written). The event loop owns the rest:
    ``watermark`` is the number of leading blocks committed, ``pending`` the writes
    in flight, ``settled`` is set whenever none is. ``keep`` turns False when the
    request finished normally: its watermark is then dropped, not advanced.
    ``committed_blocks`` is the watermark as the engine thread may read it (under
    the transfer tasks' condition).
    """

    request_id: RequestId
    ids: list[str]
    staged: int
    watermark: int
    committed: set[int] = field(default_factory=set)
    pending: int = 0
    keep: bool = True
    committed_blocks: int = 0
    settled: asyncio.Event = field(default_factory=asyncio.Event)

    def __post_init__(self) -> None:
        self.settled.set()
        self.committed_blocks = self.watermark
