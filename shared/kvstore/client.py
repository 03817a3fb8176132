"""The KV store client that prefill and decode use.

Discovery: live store nodes come from Redis membership (refreshed at most
every ``refresh_s``). Placement: each block's replicas are the first
``replication`` nodes of its rendezvous ranking (:mod:`shared.kvstore.placement`).

- :meth:`KVStoreClient.begin_put` reserves on every replica and returns a
  :class:`PutHandle` for layer-by-layer or whole-block writes, then
  ``commit`` (or ``revoke``). Blocks a replica already holds are skipped.
- :meth:`KVStoreClient.get` reads whole blocks, trying each block's ranking in
  order, so a dead or evicting holder falls back to another replica.
- :meth:`KVStoreClient.stream` delivers layers as they are written (the
  decode side pulling while prefill still computes).

A node that fails at the transport level (its process died) is skipped for
``down_s`` (membership drops it within its heartbeat TTL): puts and leases
that met it are retried on the remaining ranking, so with two replicas the
loss of one node fails no operation.

Ownership: the caller's buffers are read (puts) or written (gets) only while
the awaited call runs; they are safe to reuse when it returns. That holds on
both data paths: the socket, and, for a node on this host (``shm``, default
on), this process's own copies to and from the node's shared arena.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections import defaultdict
from collections.abc import AsyncIterator, Callable, Coroutine, Sequence
from dataclasses import dataclass, field
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from shared.cluster.auth import ClusterSecret
from shared.cluster.block_index import BlockIndex
from shared.cluster.keys import Keys
from shared.cluster.membership import LastKnown, Member, live_members
from shared.errors import KVMissError, KVStoreError, KVUnavailableError, TransportError
from shared.kvstore.device_buffers import nbytes
from shared.kvstore.node_client import Layers, NodeClient
from shared.kvstore.placement import rank
from shared.kvstore.protocol import BlockSpec
from shared.transport.base import Buffer, Transport, as_bytes_view

STORE_ROLE = "kvstore"
log = logging.getLogger(__name__)
LayerInto = Callable[[int, int], Buffer]  # (block's position, layer) -> where it lands


@dataclass
class LeaseSet:
    """Leases taken by :meth:`KVStoreClient.lease`; release once (expiry covers a crash)."""

    held: list[tuple[NodeClient, str]]

    async def release(self) -> None:
        held, self.held = self.held, []
        for node, lease_id in held:
            try:
                await node.release(lease_id)
            except (TransportError, KVStoreError):
                continue  # the node is gone or the lease expired: nothing is pinned


@dataclass
class PutHandle:
    """An in-flight two-phase put across replicas; commit or revoke exactly once."""

    num_layers: int
    sizes: dict[str, int]
    targets: dict[str, tuple[NodeClient, list[str]]]  # node id -> (node, ids it must receive)
    on_down: Callable[[NodeClient], None] = field(default=lambda node: None)
    done: bool = field(default=False)

    def _check(self) -> None:
        if self.done:
            raise KVStoreError("this put was already committed or revoked")

    async def write(
        self, ids: Sequence[str], segments: Sequence[Buffer], layers: Layers | None = None
    ) -> None:
        """Write ``segments`` (per id: whole block or its ``layers`` slice) to every replica.

        A replica that fails (node gone) is dropped from this put; the put goes
        on while every block keeps at least one live replica.
        """
        self._check()
        seg_of = dict(zip(ids, segments, strict=True))
        calls = {}
        for node_id, (node, wanted) in self.targets.items():
            mine = [i for i in wanted if i in seg_of]
            if mine:
                calls[node_id] = node.write(mine, [seg_of[i] for i in mine], layers)
        await self._on_replicas(calls)

    async def commit(self) -> None:
        self._check()
        self.done = True
        await self._on_replicas(
            {n: node.commit(ids) for n, (node, ids) in self.targets.items() if ids}
        )

    async def _on_replicas(self, calls: dict[str, Coroutine[Any, Any, None]]) -> None:
        names = list(calls)
        results = await asyncio.gather(*calls.values(), return_exceptions=True)
        failed = {}
        for node_id, result in zip(names, results, strict=True):
            if isinstance(result, TransportError):
                failed[node_id] = result
            elif isinstance(result, BaseException):
                raise result
        if not failed:
            return
        for node_id in failed:
            self.on_down(self.targets[node_id][0])
        dropped = {i for n in failed for i in self.targets.pop(n)[1]}
        kept = {i for _, ids in self.targets.values() for i in ids}
        lost = sorted(dropped - kept)
        if lost:
            first = next(iter(failed.values()))
            raise KVUnavailableError(
                f"{len(lost)} blocks lost their only replica: {first}", lost
            ) from first

    async def revoke(self) -> None:
        if self.done:
            return
        self.done = True
        results = await asyncio.gather(
            *(n.revoke(ids) for n, ids in self.targets.values() if ids), return_exceptions=True
        )
        for result in results:  # a dead node frees its reservation by itself (timeout)
            if isinstance(result, BaseException) and not isinstance(
                result, TransportError | KVStoreError
            ):
                raise result


class KVStoreClient:
    def __init__(
        self,
        transport: Transport,
        redis: aioredis.Redis,
        keys: Keys,
        *,
        replication: int = 1,
        client_id: str | None = None,
        timeout_s: float = 30.0,
        refresh_s: float = 1.0,
        down_s: float = 3.0,
        member_ttl_s: float = 5.0,
        secret: ClusterSecret | None = None,
        shm: bool = True,
    ):
        self.transport = transport
        self.shm = shm  # copy through a same-host node's shared arena (see NodeClient)
        self.secret = secret or ClusterSecret()
        self.redis = redis
        self.keys = keys
        self.replication = replication
        self.client_id = client_id or f"client-{uuid.uuid4().hex[:12]}"
        self.timeout_s = timeout_s
        self.refresh_s = refresh_s
        self.down_s = down_s
        self._down: dict[str, float] = {}  # instance id -> skipped until (monotonic)
        self._nodes: dict[str, NodeClient] = {}
        self._retired: list[NodeClient] = []  # replaced clients whose idle connections to close
        self._live: list[NodeClient] = []
        self._registered = LastKnown(member_ttl_s)  # bridges a Redis restarted empty
        self._refreshed = -1e9
        self._refresh_lock = asyncio.Lock()
        self.index = BlockIndex(redis, keys, ttl_s=3600.0)

    # ----- discovery ------------------------------------------------------
    async def nodes(self, *, force: bool = False) -> list[NodeClient]:
        async with self._refresh_lock:
            if force or time.monotonic() - self._refreshed >= self.refresh_s:
                try:
                    members = await live_members(self.redis, self.keys, STORE_ROLE)
                except (RedisError, OSError):
                    members = None  # Redis down: keep the last known nodes
                if members is not None:
                    known = self._registered.update(members)
                    self._live = [self._node(m) for m in known if m.data_port is not None]
                    self._refreshed = time.monotonic()
                retired, self._retired = self._retired, []
                for node in retired:
                    await node.close()
        now = time.monotonic()
        return [n for n in self._live if self._down.get(n.instance_id, 0.0) <= now]

    async def connect(self, links: int = 2, timeout_s: float = 5.0) -> int:
        """Open ``links`` connections to every live node now (a ping on each), so that a
        service's first request does not: a UCX endpoint's creation, the transport's
        first imports and the shared arena's mapping held the event loop, and with it
        the GIL the engine thread takes between kernels, for ~1 s of a first 512-token
        prefill (2 links: a prefill leases its cached prefix and reserves its put at
        once). Returns the nodes that answered; one that did not is left to the
        requests, as it would have been (nothing is marked down here)."""
        nodes = await self.nodes(force=True)
        pings = {asyncio.ensure_future(node.ping()): node for node in nodes for _ in range(links)}
        if not pings:
            return 0
        try:
            done, pending = await asyncio.wait(pings, timeout=timeout_s)
        finally:
            for task in pings:
                task.cancel()  # those still waiting on a node that does not answer
            await asyncio.gather(*pings, return_exceptions=True)
        silent = {pings[task].instance_id for task in pending}
        if silent:
            log.info("KV store node(s) %s did not answer within %.1fs", sorted(silent), timeout_s)
        answered = set()
        for task in done:
            node, error = pings[task], task.exception()
            if error is None:
                answered.add(node.instance_id)
            elif isinstance(error, TransportError | KVStoreError):
                log.info("KV store node %s: %s", node.instance_id, error)
            else:
                raise error
        return len(answered)

    def mark_down(self, node: NodeClient) -> None:
        """Skip ``node`` for ``down_s``: it failed at the transport level."""
        if self._down.get(node.instance_id, 0.0) <= time.monotonic():
            log.warning("KV store node %s is unreachable; skipping it", node.instance_id)
        self._down[node.instance_id] = time.monotonic() + self.down_s

    async def _attempts(self) -> range:
        """Tries of an operation that skips each node failing it: one per live node."""
        return range(len(await self.nodes()) + 1)

    def _transport_failures(
        self, nodes: Sequence[NodeClient], results: Sequence[object]
    ) -> list[TransportError]:
        """Mark the nodes whose result is a transport error down; raise any other error."""
        failed = []
        for node, result in zip(nodes, results, strict=True):
            if isinstance(result, TransportError):
                self.mark_down(node)
                failed.append(result)
            elif isinstance(result, BaseException):
                raise result
        return failed

    def _node(self, member: Member) -> NodeClient:
        """The client of ``member``'s process: kept (with its pooled connections) across
        heartbeats, whose load figures change; replaced when the node restarted."""
        node = self._nodes.get(member.instance_id)
        if node is not None and node.member.endpoint == member.endpoint:
            node.member = member
            return node
        if node is not None:
            self._retired.append(node)  # its connections lead to the old process
        node = NodeClient(
            self.transport,
            member,
            self.client_id,
            timeout_s=self.timeout_s,
            secret=self.secret,
            shm=self.shm,
        )
        self._nodes[member.instance_id] = node
        return node

    async def _ranked(self, ids: Sequence[str]) -> dict[str, list[NodeClient]]:
        nodes = await self.nodes()
        if not nodes:
            raise KVUnavailableError("no live KV store node is registered")
        return {i: rank(i, nodes) for i in ids}

    # ----- writes ---------------------------------------------------------
    async def begin_put(
        self, ids: Sequence[str], sizes: Sequence[int], *, num_layers: int, ttl_s: float = 30.0
    ) -> PutHandle:
        for _ in await self._attempts():
            handle, failed = await self._reserve(ids, sizes, num_layers, ttl_s)
            if not failed:
                return handle
            await handle.revoke()  # and again on the ranking without the failed nodes
        raise KVUnavailableError(f"no KV store node took the put: {failed[0]}", ids)

    async def _reserve(
        self, ids: Sequence[str], sizes: Sequence[int], num_layers: int, ttl_s: float
    ) -> tuple[PutHandle, list[TransportError]]:
        ranked = await self._ranked(ids)
        per_node: dict[str, list[BlockSpec]] = defaultdict(list)
        node_by_id: dict[str, NodeClient] = {}
        for block_id, size in zip(ids, sizes, strict=True):
            for node in ranked[block_id][: self.replication]:
                per_node[node.instance_id].append(BlockSpec(id=block_id, size=size))
                node_by_id[node.instance_id] = node
        handle = PutHandle(num_layers, dict(zip(ids, sizes, strict=True)), {}, self.mark_down)

        async def reserve(node_id: str, specs: list[BlockSpec]) -> None:
            node = node_by_id[node_id]
            statuses = await node.reserve(specs, num_layers, ttl_s)
            mine = [s.id for s, st in zip(specs, statuses, strict=True) if st == "reserved"]
            handle.targets[node_id] = (node, mine)

        results = await asyncio.gather(
            *(reserve(n, specs) for n, specs in per_node.items()), return_exceptions=True
        )
        try:
            failed = self._transport_failures([node_by_id[n] for n in per_node], results)
        except BaseException:
            await handle.revoke()
            raise
        return handle, failed

    async def put(
        self, ids: Sequence[str], blocks: Sequence[Buffer], *, num_layers: int = 1
    ) -> None:
        """Whole blocks to every replica, one round trip per node (reserve+write+commit).

        A node that fails is skipped and the put is made again on the new ranking
        (replicas that have a block already keep it)."""
        sizes = [nbytes(b) for b in blocks]
        failed: list[TransportError] = []
        for _ in await self._attempts():
            ranked = await self._ranked(ids)
            per_node: dict[str, list[int]] = defaultdict(list)
            nodes: dict[str, NodeClient] = {}
            for pos, block_id in enumerate(ids):
                for node in ranked[block_id][: self.replication]:
                    per_node[node.instance_id].append(pos)
                    nodes[node.instance_id] = node
            results = await asyncio.gather(
                *(
                    nodes[n].put(
                        [BlockSpec(id=ids[p], size=sizes[p]) for p in positions],
                        [blocks[p] for p in positions],
                        num_layers,
                    )
                    for n, positions in per_node.items()
                ),
                return_exceptions=True,
            )
            failed = self._transport_failures([nodes[n] for n in per_node], results)
            if not failed:
                return
        raise KVUnavailableError(f"no KV store node took the put: {failed[0]}", ids)

    # ----- reads ----------------------------------------------------------
    async def get(
        self,
        ids: Sequence[str],
        into: Sequence[Buffer],
        *,
        layers: Layers | None = None,
        wait_s: float = 0.0,
    ) -> None:
        """Fill ``into`` (one buffer per id) from the first holder that has each block."""
        ranked = await self._ranked(ids)
        buf_of = dict(zip(ids, into, strict=True))
        pending = list(ids)
        tried: dict[str, int] = defaultdict(int)
        last_error: BaseException | None = None
        while pending:
            groups: dict[str, list[str]] = defaultdict(list)
            nodes: dict[str, NodeClient] = {}
            for block_id in pending:
                choices = ranked[block_id]
                if tried[block_id] >= len(choices):
                    raise KVMissError(
                        f"{len(pending)} blocks are held by no live store node", pending
                    ) from last_error
                node = choices[tried[block_id]]
                groups[node.instance_id].append(block_id)
                nodes[node.instance_id] = node
            results = await asyncio.gather(
                *(
                    nodes[n].get(g, [buf_of[i] for i in g], layers=layers, wait_s=wait_s)
                    for n, g in groups.items()
                ),
                return_exceptions=True,
            )
            pending = []
            for (node_id, group), result in zip(groups.items(), results, strict=True):
                if isinstance(result, TransportError):
                    self.mark_down(nodes[node_id])
                if isinstance(result, KVMissError | TransportError):
                    last_error = result
                    for block_id in group:
                        tried[block_id] += 1
                    pending.extend(group)
                elif isinstance(result, BaseException):
                    raise result

    async def stream(
        self,
        ids: Sequence[str],
        into: Sequence[Buffer],
        *,
        num_layers: int,
        wait_s: float,
        layer_into: LayerInto | None = None,
        only: Sequence[Sequence[int] | None] | None = None,
    ) -> AsyncIterator[int]:
        """Yields each layer index, in order, once that layer of every block that
        reads it is in ``into``.

        ``into`` holds one whole-block buffer per id; or ``layer_into(i, layer)``
        gives where layer ``layer`` of the ``i``-th block goes (a pool whose blocks
        are not contiguous: ``into`` is then unused). ``only[i]``, where given and
        not None, names the only layers (ascending) to read of the ``i``-th block.
        Each block is read from its first-ranked holder; if that holder is lost
        mid-stream (or lost the block), its blocks are read again from their next
        replica. Ends only once every block is confirmed committed.
        """
        ranked = await self._ranked(ids)
        views = [] if layer_into is not None else [as_bytes_view(b) for b in into]
        wanted: list[tuple[int, ...] | None] = (
            [None] * len(ids) if only is None else [None if w is None else tuple(w) for w in only]
        )
        # a layer a block does not read counts as there
        have: list[set[int]] = [
            set() if w is None else set(range(num_layers)) - set(w) for w in wanted
        ]
        done: set[int] = set()
        rank_of = [0] * len(ids)
        events: asyncio.Queue[tuple[list[int], int | None, BaseException | None]] = asyncio.Queue()

        def layer_views(positions: list[int]) -> Callable[[int], list[memoryview]]:
            def slices(layer: int) -> list[memoryview]:
                if layer_into is not None:
                    return [as_bytes_view(layer_into(p, layer)) for p in positions]
                out = []
                for p in positions:
                    lb = views[p].nbytes // num_layers
                    out.append(views[p][layer * lb : (layer + 1) * lb])
                return out

            return slices

        async def pump(node: NodeClient, positions: list[int]) -> None:
            layer_ids = wanted[positions[0]]
            try:
                async for layer in node.stream(
                    [ids[p] for p in positions],
                    layer_views(positions),
                    layers=(0, num_layers) if layer_ids is None else None,
                    layer_ids=layer_ids,
                    wait_s=wait_s,
                ):
                    events.put_nowait((positions, layer, None))
                events.put_nowait((positions, None, None))
            except Exception as exc:  # handed to the consumer loop below
                events.put_nowait((positions, None, exc))

        tasks: list[asyncio.Task[None]] = []

        def launch(positions: Sequence[int]) -> None:
            groups: dict[tuple[str, tuple[int, ...] | None], list[int]] = defaultdict(list)
            for p in positions:
                groups[ranked[ids[p]][rank_of[p]].instance_id, wanted[p]].append(p)
            for group in groups.values():
                node = ranked[ids[group[0]]][rank_of[group[0]]]
                tasks.append(asyncio.create_task(pump(node, group)))

        launch(range(len(ids)))
        next_layer = 0
        try:
            while len(done) < len(ids) or next_layer < num_layers:
                positions, layer, error = await events.get()
                if error is not None:
                    if isinstance(error, TransportError):
                        self.mark_down(ranked[ids[positions[0]]][rank_of[positions[0]]])
                    retry = isinstance(error, TransportError | KVMissError) and all(
                        rank_of[p] + 1 < min(len(ranked[ids[p]]), self.replication)
                        for p in positions
                    )
                    if not retry:
                        raise error
                    for p in positions:
                        rank_of[p] += 1
                    launch(positions)
                elif layer is None:
                    done.update(positions)
                else:
                    for p in positions:
                        have[p].add(layer)
                while next_layer < num_layers and all(next_layer in h for h in have):
                    yield next_layer
                    next_layer += 1
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def lookup(self, ids: Sequence[str]) -> int:
        """Longest prefix of ``ids`` held by live store nodes, from the Redis index."""
        if not ids:
            return 0
        live = {n.instance_id for n in await self.nodes()}
        try:
            return await self.index.longest_prefix(ids, live)
        except (RedisError, OSError) as exc:  # Redis down: degraded, no cache hits
            log.warning("block index unreachable, treating as a miss: %s", exc)
            return 0

    async def lease(self, ids: Sequence[str], ttl_s: float = 30.0) -> LeaseSet:
        """Pin ``ids`` against eviction on every replica that holds them.

        The first-ranked live holders must have the blocks (else KVMissError);
        other replicas are pinned where they hold them, so a read that falls
        back after a node loss still finds its blocks. A node that fails is
        skipped and the lease taken again on the new ranking.
        """
        for _ in await self._attempts():
            leases = LeaseSet([])
            try:
                if await self._lease_ranked(ids, ttl_s, leases):
                    return leases
            except BaseException:
                await leases.release()
                raise
            await leases.release()
        raise KVUnavailableError("no KV store node could lease the blocks", ids)

    async def _lease_ranked(self, ids: Sequence[str], ttl_s: float, leases: LeaseSet) -> bool:
        """Lease on the current ranking; False when a node failed (marked down)."""
        ranked = await self._ranked(ids)
        covered: set[str] = set()
        for r in range(self.replication):
            groups: dict[str, list[str]] = defaultdict(list)
            for block_id in ids:
                if r < len(ranked[block_id]):
                    groups[ranked[block_id][r].instance_id].append(block_id)
            for group in groups.values():
                node = ranked[group[0]][r]
                try:
                    leases.held.append((node, await node.lease(group, ttl_s)))
                except TransportError:
                    self.mark_down(node)
                    return False
                except KVMissError:
                    continue  # another replica may hold them (a restarted node is empty)
                covered.update(group)
        missing = [i for i in ids if i not in covered]
        if missing:
            raise KVMissError(f"{len(missing)} blocks are held by no live store node", missing)
        return True

    async def close(self) -> None:
        for node in [*self._retired, *self._nodes.values()]:
            await node.close()
        self._nodes.clear()
        self._retired = []
        self._live = []
