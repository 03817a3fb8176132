"""A fake KV store for connector tests: the subset of :class:`KVStoreClient` the
connector uses, over an in-memory dict of blocks, with the store's semantics
(two-phase puts, layers visible as written, streams that wait for layers still
arriving, leases) and hooks to make it misbehave: evict a block but keep its
index entry (a stale entry), or break a stream after some layers."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from shared.errors import KVMissError, KVUnavailableError
from shared.kvstore.client import LeaseSet, PutHandle
from shared.transport.base import Buffer, as_bytes_view


@dataclass
class FakeBlock:
    data: np.ndarray
    layers: set[int] = field(default_factory=set)
    committed: bool = False
    dead: bool = False


class FakeNode:
    """The node-side operations :class:`PutHandle` and :class:`LeaseSet` call."""

    instance_id = "fake-store"

    def __init__(self, num_layers: int):
        self.num_layers = num_layers
        self.blocks: dict[str, FakeBlock] = {}
        self.writes: list[tuple[str, int | None]] = []  # (id, layer or None = whole), in order
        self.write_calls: list[int] = []  # blocks per write call, in order
        self.leases: dict[str, tuple[str, ...]] = {}
        self.changed = asyncio.Event()
        self._lease_ids = itertools.count(1)

    def _notify(self) -> None:
        self.changed.set()
        self.changed = asyncio.Event()

    async def write(
        self, ids: Sequence[str], segments: Sequence[Buffer], layers: tuple[int, int] | None
    ) -> None:
        self.write_calls.append(len(ids))
        for block_id, seg in zip(ids, segments, strict=True):
            block = self.blocks[block_id]
            view = as_bytes_view(seg)
            if layers is None:
                block.data[:] = np.frombuffer(view, dtype=np.uint8)
                block.layers = set(range(self.num_layers))
                self.writes.append((block_id, None))
            else:
                lb = block.data.nbytes // self.num_layers
                start, stop = layers
                block.data[start * lb : stop * lb] = np.frombuffer(view, dtype=np.uint8)
                block.layers.update(range(start, stop))
                self.writes.extend((block_id, layer) for layer in range(start, stop))
        self._notify()

    async def commit(self, ids: Sequence[str]) -> None:
        for block_id in ids:
            block = self.blocks[block_id]
            if len(block.layers) != self.num_layers:
                raise KVMissError(f"block {block_id} is not completely written", [block_id])
            block.committed = True
        self._notify()

    async def revoke(self, ids: Sequence[str]) -> None:
        for block_id in ids:
            block = self.blocks.get(block_id)
            if block is not None and not block.committed:
                block.dead = True
                del self.blocks[block_id]
        self._notify()

    async def release(self, lease_id: str) -> None:
        self.leases.pop(lease_id, None)


class FakeKVStoreClient:
    def __init__(self, block_bytes: int, num_layers: int):
        self.block_bytes = block_bytes
        self.num_layers = num_layers
        self.node = FakeNode(num_layers)
        self.phantoms: set[str] = set()  # index entries for blocks the store no longer has
        self.break_streams_after: int | None = None  # layers a stream delivers, then fails
        self.streams = 0
        # streams whose ids this says to hold wait for ``gate`` (``held`` counts them)
        self.hold_streams: Callable[[list[str]], bool] | None = None
        self.held = 0
        self.gate = asyncio.Event()
        self.streamed: list[list[str]] = []  # the ids of every stream, in order
        self.streamed_bytes = 0  # the layer slices streams delivered
        self.refuse_puts = False  # begin_put raises, as a store with no live node does
        self.reserving = asyncio.Event()  # cleared: begin_put waits (a slow reservation)
        self.reserving.set()

    # -- test controls -----------------------------------------------------------------
    def evict_keep_index(self, ids: Sequence[str]) -> None:
        """Drop committed blocks but leave the index saying they are held."""
        for block_id in ids:
            if self.node.blocks.pop(block_id, None) is not None:
                self.phantoms.add(block_id)

    def committed(self) -> set[str]:
        return {i for i, b in self.node.blocks.items() if b.committed}

    # -- what the connector calls ---------------------------------------------------------
    async def lookup(self, ids: Sequence[str]) -> int:
        hits = 0
        for block_id in ids:
            block = self.node.blocks.get(block_id)
            if not (block is not None and block.committed) and block_id not in self.phantoms:
                break
            hits += 1
        return hits

    async def lease(self, ids: Sequence[str], ttl_s: float = 30.0) -> LeaseSet:
        missing = [i for i in ids if i not in self.committed()]
        if missing:
            raise KVMissError(f"{len(missing)} blocks are not held", missing)
        lease_id = f"L{next(self.node._lease_ids)}"
        self.node.leases[lease_id] = tuple(ids)
        return LeaseSet([(self.node, lease_id)])  # type: ignore[list-item]

    async def begin_put(
        self, ids: Sequence[str], sizes: Sequence[int], *, num_layers: int, ttl_s: float = 30.0
    ) -> PutHandle:
        await self.reserving.wait()
        if self.refuse_puts:
            raise KVUnavailableError("the fake store refuses puts")
        mine = []
        for block_id, size in zip(ids, sizes, strict=True):
            if block_id in self.node.blocks:
                continue  # held or being written by another put
            self.node.blocks[block_id] = FakeBlock(np.zeros(size, dtype=np.uint8))
            self.phantoms.discard(block_id)
            mine.append(block_id)
        targets = {self.node.instance_id: (self.node, mine)}
        return PutHandle(num_layers, dict(zip(ids, sizes, strict=True)), targets)  # type: ignore[arg-type]

    async def put(self, ids: Sequence[str], blocks: Sequence[Buffer], *, num_layers: int) -> None:
        """Whole blocks, reserved, written and committed at once (held ones skipped)."""
        handle = await self.begin_put(
            ids, [as_bytes_view(b).nbytes for b in blocks], num_layers=num_layers
        )
        await handle.write(ids, blocks)
        await handle.commit()

    async def stream(
        self,
        ids: Sequence[str],
        into: Sequence[Buffer],
        *,
        num_layers: int,
        wait_s: float,
        layer_into: Callable[[int, int], Buffer] | None = None,
        only: Sequence[Sequence[int] | None] | None = None,
    ) -> AsyncIterator[int]:
        self.streams += 1
        self.streamed.append(list(ids))
        if self.hold_streams is not None and self.hold_streams(list(ids)):
            self.held += 1
            await self.gate.wait()
        views = [np.frombuffer(as_bytes_view(b), dtype=np.uint8) for b in into]
        lb = self.block_bytes // num_layers
        async with asyncio.timeout(wait_s):
            for layer in range(num_layers):
                if self.break_streams_after is not None and layer >= self.break_streams_after:
                    raise KVUnavailableError("the fake store lost its node mid-stream")
                reads = [only is None or w is None or layer in w for w in only or [None] * len(ids)]
                while True:
                    blocks = [self.node.blocks.get(i) for i in ids]
                    if any(b is None or b.dead for b in blocks):
                        raise KVMissError("blocks are not held", list(ids))
                    if all(
                        b is not None and (layer in b.layers or not r)
                        for b, r in zip(blocks, reads, strict=True)
                    ):
                        break
                    await self.node.changed.wait()
                for i, block in enumerate(blocks):
                    assert block is not None
                    if not reads[i]:
                        continue
                    self.streamed_bytes += lb
                    data = block.data[layer * lb : (layer + 1) * lb]
                    if layer_into is not None:
                        np.frombuffer(as_bytes_view(layer_into(i, layer)), dtype=np.uint8)[:] = data
                    else:
                        views[i][layer * lb : (layer + 1) * lb] = data
                yield layer
            while not all(self.node.blocks[i].committed for i in ids):
                await self.node.changed.wait()
