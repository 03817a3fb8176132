"""Moving KV bytes between an engine's pool and the host buffers the store's transports use.

Three implementations of one boundary, chosen by where the pool lives and how it
holds a block (:func:`pool_copies`):

- :class:`InPlace` (a CPU pool): the transports send from and receive into the
  slots' own bytes; nothing is copied and nothing waits.
- :class:`Gathered` (a CPU pool split by layer groups, for sliding-window
  layers): a block's layers are spread over several slots, so whole blocks leave
  gathered into host rows in the layout's format; one layer of a block is sent
  from its slot in place, and a load lands each layer in its slot. A block whose
  window part is gone (no row to compute reads it) arrives without its sliding
  layers.
- :class:`Staged` (a CUDA pool): bytes go through pinned host buffers. Every
  copy runs on one dedicated copy stream; a copy out of the pool is ordered
  after the compute that produced the bytes by a CUDA event recorded on the
  engine's stream, and the engine's stream waits on an event before it reads
  (or overwrites) slots a copy touches. Nothing synchronizes the device: a
  host thread that needs copied bytes waits for that copy's own event. Slots
  move as one gather (or scatter) kernel plus one DMA per transfer, not one
  copy per slot.

Ownership: the connector owns the instance. :meth:`PoolCopies.from_pool` and
:meth:`PoolCopies.order_after_saves` run on the engine thread, the load-side
methods on the event loop; the caching allocators keep a buffer alive until the
copies that use it are done.
"""

from __future__ import annotations

import asyncio
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from shared.engine.kv_cache_manager import Slot
from shared.kv.kv_cache import KVCache
from shared.kv.layout import KVLayout


@dataclass(eq=False)
class Ready:
    """Completion of copies queued on a CUDA stream (``event`` None: already done)."""

    event: torch.cuda.Event | None = None

    @property
    def done(self) -> bool:
        return self.event is None or self.event.query()

    async def wait(self) -> None:
        """Until the copies are done, without blocking the event loop."""
        if self.event is not None and not self.event.query():
            await asyncio.to_thread(self.event.synchronize)


class Later(Ready):
    """Completion of host copies out of the pool that the engine thread makes after the
    step that asked for them (see :meth:`KVConnector.flush`): :meth:`run` copies, on the
    engine thread, before anything can reuse the slots, then has ``on_loop`` (the
    event loop's thread-safe call) wake the waiters; a failed copy fails :meth:`wait`,
    so the transfer that reads the rows fails instead of sending garbage."""

    def __init__(self, copy: Callable[[], object], on_loop: Callable[[Callable[[], None]], object]):
        super().__init__()
        self._copy: Callable[[], object] | None = copy
        self._on_loop = on_loop
        self._copied = asyncio.Event()  # bound to the loop at its first wait, set there
        self._done = False
        self._error: Exception | None = None

    def run(self) -> None:
        copy, self._copy = self._copy, None
        if copy is None:
            return
        try:
            copy()
        except Exception as exc:  # reported to the transfer by wait()
            self._error = exc
        finally:
            self._done = True
            self._on_loop(self._copied.set)

    @property
    def done(self) -> bool:
        return self._done

    async def wait(self) -> None:
        await self._copied.wait()
        if self._error is not None:
            raise RuntimeError("a deferred copy out of the KV pool failed") from self._error


@dataclass(eq=False)
class SlotBytes:
    """Slot bytes as the store client reads or writes them: ``buffers`` (one flat
    ``uint8`` row per slot, host memory or, for a CUDA pool's own blocks, device memory)
    are safe to use once ``ready`` is done. ``reads_pool``: the buffers are the slots'
    own bytes, so the slots must not change until the transfer is done."""

    buffers: list[torch.Tensor]
    ready: Ready = field(default_factory=Ready)
    reads_pool: bool = False
    # the transfer calls it once it no longer reads the buffers (staging goes back)
    done: Callable[[], None] = field(default=lambda: None)


@dataclass(eq=False)
class Landing:
    """Where a load receives its blocks: ``rows`` (one whole-block ``uint8`` buffer per
    slot, in order); ``host``: the pinned ``[n, block_bytes]`` they are rows of, when
    staged (None: the rows are the slots themselves); ``layer_into(i, layer)``: where
    layer ``layer`` of the ``i``-th block goes, for slots whose layers are apart."""

    slots: list[Slot]
    rows: list[torch.Tensor]
    host: torch.Tensor | None = None
    # where each block's layer lands instead, in place (a pool split by layer groups;
    # ``rows`` is then empty)
    layer_into: Callable[[int, int], torch.Tensor] | None = None
    # per block, the only layers a row reads (ascending; None: every layer)
    only: list[tuple[int, ...] | None] | None = None

    def nbytes(self, layout: KVLayout) -> int:
        """The bytes the load moves."""
        if self.only is None:
            return len(self.slots) * layout.block_bytes
        return sum(
            layout.block_bytes if w is None else len(w) * layout.layer_bytes for w in self.only
        )


class PoolCopies(ABC):
    staged: bool

    def __init__(self, pool: KVCache):
        self.pool = pool
        self.layout = pool.layout

    @abstractmethod
    def from_pool(
        self, slots: Sequence[Slot], layer: int | None = None, out: torch.Tensor | None = None
    ) -> SlotBytes:
        """The slots' bytes (``layer`` of each, or whole blocks) as they are once the work
        queued so far on the calling thread's stream is done. ``out``: host rows to copy
        into (``[len(slots), nbytes]`` ``uint8``); None: wherever is cheapest."""

    def blocks(self, slots: Sequence[Slot]) -> SlotBytes:
        """The slots' whole blocks in place, for a transfer that reads or fills them
        directly (the store client moves a CUDA pool's by DMA): ready once the work
        queued so far on the calling thread's stream is done."""
        rows = self._block_bytes()
        return SlotBytes([rows[s] for s in slots], self._produced(), reads_pool=True)

    def _block_bytes(self) -> torch.Tensor:
        """The pool as ``[num_blocks, block_bytes]`` ``uint8`` rows (a view)."""
        return self.pool.pool.view(self.pool.num_blocks, -1).view(torch.uint8)

    def _produced(self) -> Ready:
        return Ready()

    @abstractmethod
    def landing(self, slots: Sequence[Slot]) -> Landing:
        """Event loop: where a load of ``slots`` receives its blocks."""

    def layer_to_pool(self, landing: Landing, layer: int) -> Ready:
        """Event loop: ``layer`` of the received blocks into their slots."""
        return Ready()

    def blocks_to_pool(self, landing: Landing) -> Ready:
        """Event loop: the whole received blocks into their slots."""
        return Ready()

    def order_before_compute(self, ready: Ready) -> None:
        """Engine thread: work queued on the engine's stream from now on runs after
        ``ready``'s copies (no host wait). In place: nothing to order."""
        return None

    def order_after_saves(self) -> None:
        """Engine thread: work queued on the engine's stream from now on runs after every
        copy :meth:`from_pool` queued (so the slots it read may be overwritten). In
        place: nothing to order."""
        return None

    def staging(self, count: int, nbytes: int) -> torch.Tensor:
        """``[count, nbytes]`` host rows that copies out of the pool may target."""
        return torch.empty((count, nbytes), dtype=torch.uint8)


class InPlace(PoolCopies):
    """A CPU pool: the transports use the slots' own bytes."""

    staged = False

    def from_pool(
        self, slots: Sequence[Slot], layer: int | None = None, out: torch.Tensor | None = None
    ) -> SlotBytes:
        p = self.pool.pool
        rows = [
            (p[s] if layer is None else p[s, layer]).reshape(-1).view(torch.uint8) for s in slots
        ]
        if out is None:
            return SlotBytes(rows, reads_pool=True)
        for dst, src in zip(out, rows, strict=False):
            dst.copy_(src)
        return SlotBytes(list(out[: len(rows)]))

    def landing(self, slots: Sequence[Slot]) -> Landing:
        return Landing(list(slots), [self.pool.block(s) for s in slots])


class Gathered(PoolCopies):
    """A CPU pool split by layer groups (see the module): each block's window part
    comes from the pool's lookup, read when the copy runs; a request holds the parts
    of the blocks it moves, so they do not change meanwhile."""

    staged = False

    def from_pool(
        self, slots: Sequence[Slot], layer: int | None = None, out: torch.Tensor | None = None
    ) -> SlotBytes:
        pool = self.pool
        if layer is not None and out is None:
            rows = []
            for s in slots:
                view = pool.layer_slot(s, layer, pool.part_of(s))
                if view is None:
                    raise RuntimeError(f"layer {layer} of the block in slot {s} is not held")
                rows.append(view.reshape(-1).view(torch.uint8))
            return SlotBytes(rows, reads_pool=True)
        nbytes = self.layout.block_bytes if layer is None else self.layout.layer_bytes
        host = out if out is not None else torch.empty((len(slots), nbytes), dtype=torch.uint8)
        if layer is None:
            typed = host[: len(slots)].view(self.layout.torch_dtype)
            blocks = typed.view(len(slots), *self.layout.block_shape)
            pool.gather_blocks(slots, [pool.part_of(s) for s in slots], blocks)
            return SlotBytes(list(host[: len(slots)]))
        for s, row in zip(slots, host, strict=False):
            view = pool.layer_slot(s, layer, pool.part_of(s))
            if view is None:
                raise RuntimeError(f"layer {layer} of the block in slot {s} is not held")
            row.copy_(view.reshape(-1).view(torch.uint8))
        return SlotBytes(list(host[: len(slots)]))

    def blocks(self, slots: Sequence[Slot]) -> SlotBytes:
        return self.from_pool(slots)

    def landing(self, slots: Sequence[Slot]) -> Landing:
        """Each layer lands in its own slot; of a block without a window part (no row
        reads its sliding layers), only the full-attention layers are read."""
        pool, order = self.pool, list(slots)
        parts = [pool.part_of(s) for s in order]  # held by the loading request
        full = pool.groups.groups[0]

        def layer_into(i: int, layer: int) -> torch.Tensor:
            view = pool.layer_slot(order[i], layer, parts[i])
            if view is None:
                raise RuntimeError(f"layer {layer} of the block in slot {order[i]} is not held")
            return view.reshape(-1).view(torch.uint8)

        only = [None if part is not None else full for part in parts]
        return Landing(order, [], None, layer_into, only)


class Staged(PoolCopies):
    """A CUDA pool, through pinned host buffers on one copy stream (see the module)."""

    staged = True

    def __init__(self, pool: KVCache):
        super().__init__(pool)
        self.device = pool.pool.device
        self.stream = torch.cuda.Stream(self.device)
        self._last_save: torch.cuda.Event | None = None

    def _produced(self) -> Ready:
        produced = torch.cuda.Event(blocking=True)
        produced.record(torch.cuda.current_stream(self.device))
        return Ready(produced)

    def _index(self, slots: Sequence[Slot]) -> torch.Tensor:
        """The slots as a device index, copied without blocking the calling thread."""
        host = torch.tensor(list(slots), dtype=torch.int64).pin_memory()
        return host.to(self.device, non_blocking=True)

    def _region(self, layer: int | None) -> torch.Tensor:
        """The pool's blocks (or one layer of each), indexed by slot."""
        return self.pool.pool if layer is None else self.pool.pool[:, layer]

    def from_pool(
        self, slots: Sequence[Slot], layer: int | None = None, out: torch.Tensor | None = None
    ) -> SlotBytes:
        n = len(slots)
        nbytes = self.layout.block_bytes if layer is None else self.layout.layer_bytes
        produced = torch.cuda.Event()
        produced.record(torch.cuda.current_stream(self.device))
        host = out[:n] if out is not None else _pinned(n, nbytes)
        done = torch.cuda.Event(blocking=True)
        with torch.cuda.stream(self.stream):
            self.stream.wait_event(produced)
            gathered = torch.index_select(self._region(layer), 0, self._index(slots))
            host.copy_(gathered.reshape(n, -1).view(torch.uint8), non_blocking=True)
            done.record(self.stream)
        self._last_save = done
        return SlotBytes(list(host), Ready(done))

    def landing(self, slots: Sequence[Slot]) -> Landing:
        host = _pinned(len(slots), self.layout.block_bytes)
        return Landing(list(slots), list(host), host)

    def _scatter(self, host: torch.Tensor, slots: Sequence[Slot], layer: int | None) -> Ready:
        region = self._region(layer)
        done = torch.cuda.Event(blocking=True)
        with torch.cuda.stream(self.stream):
            staged = host.to(self.device, non_blocking=True)
            typed = staged.view(region.dtype).view(len(slots), *region.shape[1:])
            region.index_copy_(0, self._index(slots), typed)
            done.record(self.stream)
        return Ready(done)

    def layer_to_pool(self, landing: Landing, layer: int) -> Ready:
        if landing.host is None or not landing.slots:
            return Ready()
        n, lb = len(landing.slots), self.layout.layer_bytes
        layer_rows = _pinned(n, lb)  # the layer's slices made dense: one DMA, not n
        layer_rows.copy_(landing.host.view(n, self.layout.num_layers, lb)[:, layer])
        return self._scatter(layer_rows, landing.slots, layer)

    def blocks_to_pool(self, landing: Landing) -> Ready:
        if landing.host is None or not landing.slots:
            return Ready()
        return self._scatter(landing.host, landing.slots, None)

    def order_before_compute(self, ready: Ready) -> None:
        if ready.event is not None:
            torch.cuda.current_stream(self.device).wait_event(ready.event)

    def order_after_saves(self) -> None:
        if self._last_save is not None:
            torch.cuda.current_stream(self.device).wait_event(self._last_save)

    def staging(self, count: int, nbytes: int) -> torch.Tensor:
        return _pinned(count, nbytes)


def _pinned(count: int, nbytes: int) -> torch.Tensor:
    return torch.empty((count, nbytes), dtype=torch.uint8, pin_memory=True)


def pool_copies(pool: KVCache) -> PoolCopies:
    """In place for a CPU pool (gathered when it is split by layer groups), staged
    through pinned memory for a CUDA one."""
    if pool.pool.device.type == "cuda":
        return Staged(pool)
    return Gathered(pool) if pool.windowed else InPlace(pool)
