"""Talking to one KV store node: pooled connections and one method per op.

Connections are created on demand (up to ``max_connections``), greet the node
with this client's id (the node frees this client's unfinished reservations
when its last connection goes), and are reused. A connection that saw a
transport error or a cancellation mid-exchange is closed, never reused.
Every call is bounded: ``timeout_s`` plus the read's own ``wait_s``.

Same host: when the node's hello reply names a shared arena on this host (and
``shm`` is on), the arena is mapped once (:class:`LocalArena`, shared by all
connections to that node, unmapped on :meth:`NodeClient.close`) and puts,
writes, gets and streams copy block bytes to and from it themselves; the
connection carries only the control messages. If the mapping cannot be made,
one log line says so and the socket carries the bytes as before. Either way
the caller's buffers are read or written only while the awaited call runs.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass

from pydantic import ValidationError

from shared.cluster.auth import ClusterSecret
from shared.cluster.membership import Member
from shared.errors import (
    KVBadRequestError,
    KVMissError,
    KVNoSpaceError,
    KVStoreError,
    KVUnauthorizedError,
    KVUnavailableError,
    KVWaitTimeoutError,
    ProtocolError,
    TransportError,
    TransportTimeoutError,
)
from shared.kvstore import local_arena
from shared.kvstore.device_buffers import DeviceDMA, nbytes
from shared.kvstore.local_arena import LocalArena
from shared.kvstore.protocol import (
    Ack,
    BlockSpec,
    BlockStatus,
    Commit,
    Get,
    Hello,
    HelloAuth,
    LayerRange,
    Lease,
    Lookup,
    Ping,
    Put,
    Release,
    Reserve,
    Response,
    Revoke,
    SharedArena,
    Write,
    decode_response,
    encode,
)
from shared.transport.base import Buffer, Connection, Transport

log = logging.getLogger(__name__)

ERRORS: dict[str, type[KVStoreError]] = {
    cls.code: cls
    for cls in (
        KVMissError,
        KVNoSpaceError,
        KVWaitTimeoutError,
        KVBadRequestError,
        KVUnauthorizedError,
        KVUnavailableError,
    )
}
Layers = tuple[int, int]


def _range(layers: Layers | None) -> LayerRange | None:
    return None if layers is None else LayerRange(start=layers[0], stop=layers[1])


def _raise_for(resp: Response) -> Response:
    if resp.ok:
        return resp
    err = resp.error
    if err is None:
        raise KVStoreError("store refused the operation without a reason")
    raise ERRORS.get(err.code, KVStoreError)(err.message, err.ids)


def _offsets(resp: Response, count: int) -> list[int]:
    """A local reply's arena offsets, one per block; ProtocolError if they are not."""
    offsets = resp.offsets
    if offsets is None or len(offsets) != count or None in offsets:
        raise ProtocolError(f"a local reply needs {count} arena offsets")
    return [o for o in offsets if o is not None]


def _sizes(resp: Response, count: int) -> list[int]:
    if resp.sizes is None or len(resp.sizes) != count:
        raise ProtocolError(f"a local reply needs {count} block sizes")
    return resp.sizes


@dataclass(eq=False)
class _Link:
    """A pooled connection, and the node's mapped arena when it serves this connection."""

    conn: Connection
    arena: LocalArena | None = None


class NodeClient:
    def __init__(
        self,
        transport: Transport,
        member: Member,
        client_id: str,
        *,
        max_connections: int = 8,
        timeout_s: float = 30.0,
        secret: ClusterSecret | None = None,
        shm: bool = True,
    ):
        if member.data_port is None:
            raise ValueError(f"store node {member.instance_id} has no data port")
        self.member = member
        self.transport = transport
        self.client_id = client_id
        self.timeout_s = timeout_s
        self.secret = secret or ClusterSecret()
        self.shm = shm
        self._idle: list[_Link] = []
        self._slots = asyncio.Semaphore(max_connections)
        self._arena: LocalArena | None = None  # the node's arena, once a hello named it
        self._replaced: list[LocalArena] = []  # arenas of a restarted node, unmapped at close
        self._unusable: set[str] = set()  # arena paths that could not be mapped here
        self._dma = DeviceDMA()  # CUDA buffers sent or received by socket bounce through it
        self._adopting = asyncio.Lock()  # connections opened together map the arena once

    @property
    def instance_id(self) -> str:
        return self.member.instance_id

    @property
    def local(self) -> bool:
        """Whether block bytes go through the node's shared arena (known after a connect)."""
        return self._arena is not None

    @contextlib.asynccontextmanager
    async def _connection(self, wait_s: float = 0.0) -> AsyncIterator[_Link]:
        async with self._slots:
            link = None
            try:
                async with asyncio.timeout(self.timeout_s + wait_s):
                    while self._idle and link is None:
                        candidate = self._idle.pop()
                        link = None if candidate.conn.closed else candidate
                    if link is None:
                        link = await self._open()
                    yield link
            except TimeoutError as exc:
                raise TransportTimeoutError(
                    f"store {self.instance_id} did not answer within {self.timeout_s + wait_s:.1f}s"
                ) from exc
            except KVStoreError:
                raise  # a refusal is a complete reply: the connection is still in step
            except BaseException:
                if link is not None:  # mid-exchange failure: the stream cannot be resynced
                    await link.conn.close()  # (a local copy has finished: see LocalArena)
                    link = None
                raise
            finally:
                if link is not None and not link.conn.closed:
                    self._idle.append(link)

    async def _open(self) -> _Link:
        conn = await self.transport.connect(
            self.member.host, int(self.member.data_port or 0), timeout=self.timeout_s
        )
        proof = self.secret.prove(self.client_id)
        auth = None if proof is None else HelloAuth(nonce=proof.nonce, ts=proof.ts, mac=proof.mac)
        await conn.send(encode(Hello(client_id=self.client_id, auth=auth, shm=self.shm)))
        try:
            resp = _raise_for(await self._reply(conn))
        except KVStoreError:
            await conn.close()
            raise
        return _Link(conn, await self._adopt(resp.arena) if self.shm else None)

    async def _adopt(self, shared: SharedArena | None) -> LocalArena | None:
        """The mapping of the arena a hello reply named, if it is on this host and mappable."""
        async with self._adopting:
            return await self._adopt_locked(shared)

    async def _adopt_locked(self, shared: SharedArena | None) -> LocalArena | None:
        if shared is None or shared.path in self._unusable:
            return None
        current = self._arena
        if current is not None and (current.path, current.size) == (shared.path, shared.size):
            return current
        if shared.host != local_arena.host_identity():
            self._unusable.add(shared.path)
            log.debug("store %s is on another host: blocks go by socket", self.instance_id)
            return None
        try:
            arena = await asyncio.to_thread(LocalArena.open, shared.path, shared.size)
        except (OSError, ValueError) as exc:
            self._unusable.add(shared.path)
            log.info("cannot map store %s's arena (%s): blocks go by socket", self.instance_id, exc)
            return None
        if current is not None:
            self._replaced.append(current)  # the node restarted; its old links are dead
        self._arena = arena
        log.debug("store %s is on this host: copying through %s", self.instance_id, shared.path)
        return arena

    async def _reply(self, conn: Connection) -> Response:
        frame = await conn.recv()
        try:
            resp = decode_response(frame.header)
        except ValidationError as exc:
            await conn.close()
            raise ProtocolError(f"store {self.instance_id} sent an unreadable reply") from exc
        if frame.sizes and not resp.ok:
            await conn.discard(frame)
        return resp

    async def _call(
        self, req: Hello | Reserve | Commit | Revoke | Lookup | Lease | Release | Ping
    ) -> Response:
        async with self._connection() as link:
            await link.conn.send(encode(req))
            return _raise_for(await self._reply(link.conn))

    async def reserve(
        self, specs: Sequence[BlockSpec], num_layers: int, ttl_s: float = 30.0
    ) -> list[BlockStatus]:
        resp = await self._call(Reserve(blocks=list(specs), num_layers=num_layers, ttl_s=ttl_s))
        return list(resp.statuses or [])

    async def put(
        self,
        specs: Sequence[BlockSpec],
        segments: Sequence[Buffer],
        num_layers: int,
        ttl_s: float = 30.0,
    ) -> list[BlockStatus]:
        """Whole blocks reserved, written and committed on the node: one round trip by
        socket, two when local (offsets of the reserved blocks, then the ack)."""
        async with self._connection() as link:
            if link.arena is not None:
                return await self._put_local(
                    link.conn, link.arena, specs, segments, num_layers, ttl_s
                )
            req = Put(blocks=list(specs), num_layers=num_layers, ttl_s=ttl_s)
            await link.conn.send(encode(req), await self._dma.to_host(segments))
            return list(_raise_for(await self._reply(link.conn)).statuses or [])

    async def _put_local(
        self,
        conn: Connection,
        arena: LocalArena,
        specs: Sequence[BlockSpec],
        segments: Sequence[Buffer],
        num_layers: int,
        ttl_s: float,
    ) -> list[BlockStatus]:
        if [nbytes(s) for s in segments] != [s.size for s in specs]:
            raise KVBadRequestError(f"put of {len(specs)} blocks needs one segment per block")
        req = Put(blocks=list(specs), num_layers=num_layers, ttl_s=ttl_s, local=True)
        await conn.send(encode(req))
        resp = _raise_for(await self._reply(conn))
        if resp.offsets is None or len(resp.offsets) != len(specs):
            raise ProtocolError(f"a local put needs {len(specs)} arena offsets")
        fresh = [(v, o) for v, o in zip(segments, resp.offsets, strict=True) if o is not None]
        await arena.write_many([v for v, _ in fresh], [o for _, o in fresh])
        await conn.send(encode(Ack()))
        _raise_for(await self._reply(conn))  # committed
        return list(resp.statuses or [])

    async def write(
        self, ids: Sequence[str], segments: Sequence[Buffer], layers: Layers | None = None
    ) -> None:
        """Each block's bytes (whole, or its ``layers`` slice), one round trip either way.

        Local: the reply gives offsets, we copy, and the ``ack`` that follows is not
        answered; the node marks the layers when it reads it, and a commit waits
        for that (so a later commit on another connection sees them written)."""
        async with self._connection() as link:
            conn, arena = link.conn, link.arena
            if arena is None:
                host = await self._dma.to_host(segments)
                await conn.send(encode(Write(ids=list(ids), layers=_range(layers))), host)
                _raise_for(await self._reply(conn))
                return
            sizes = [nbytes(s) for s in segments]
            req = Write(ids=list(ids), layers=_range(layers), local=True, sizes=sizes)
            await conn.send(encode(req))
            offsets = _offsets(_raise_for(await self._reply(conn)), len(ids))
            await arena.write_many(segments, offsets)
            await conn.send(encode(Ack()))

    async def commit(self, ids: Sequence[str]) -> None:
        await self._call(Commit(ids=list(ids)))

    async def revoke(self, ids: Sequence[str]) -> None:
        await self._call(Revoke(ids=list(ids)))

    async def lookup(self, ids: Sequence[str]) -> int:
        return int((await self._call(Lookup(ids=list(ids)))).num_hit or 0)

    async def lease(self, ids: Sequence[str], ttl_s: float = 30.0) -> str:
        return str((await self._call(Lease(ids=list(ids), ttl_s=ttl_s))).lease_id)

    async def release(self, lease_id: str) -> None:
        await self._call(Release(lease_id=lease_id))

    async def ping(self) -> dict[str, float]:
        return dict((await self._call(Ping())).stats or {})

    async def get(
        self,
        ids: Sequence[str],
        into: Sequence[Buffer],
        *,
        layers: Layers | None = None,
        wait_s: float = 0.0,
    ) -> None:
        """Whole committed blocks (or a layer range of them) into ``into``."""
        async with self._connection(wait_s) as link:
            conn, arena = link.conn, link.arena
            local = arena is not None
            req = Get(ids=list(ids), layers=_range(layers), wait_s=wait_s, local=local)
            await conn.send(encode(req))
            frame = await conn.recv()
            resp = decode_response(frame.header)
            if not resp.ok:
                _raise_for(resp)
            try:
                if arena is None:
                    landing = self._dma.host_landing(into)
                    await conn.recv_segments(frame, landing)
                    await self._dma.land(into, landing)
                    return
                offsets, sizes = _offsets(resp, len(ids)), _sizes(resp, len(ids))
                try:
                    await arena.read_many(into, offsets, sizes)
                finally:  # also when nothing was copied (the buffers were refused)
                    await conn.send(encode(Ack()))
            except ValueError as exc:  # our buffers do not match what the store holds
                if not local:
                    await conn.close()
                raise KVBadRequestError(
                    f"get buffers do not match the stored blocks: {exc}"
                ) from exc

    async def stream(
        self,
        ids: Sequence[str],
        layer_views: Callable[[int], Sequence[Buffer]],
        *,
        layers: Layers | None = None,
        layer_ids: Sequence[int] | None = None,
        wait_s: float,
    ) -> AsyncIterator[int]:
        """Yields each layer index once its slices landed in ``layer_views(layer)``:
        every layer, or the range ``layers``, or only the (ascending) ``layer_ids``.

        Ends normally only when the store confirmed every block committed; an
        error after some layers means those bytes must not be used.
        """
        async with self._connection(wait_s) as link:
            conn, arena = link.conn, link.arena
            req = Get(
                ids=list(ids),
                layers=_range(layers),
                layer_ids=None if layer_ids is None else list(layer_ids),
                stream=True,
                wait_s=wait_s,
                local=arena is not None,
            )
            await conn.send(encode(req))
            chunks = 0
            while True:
                frame = await conn.recv()
                resp = decode_response(frame.header)
                if not resp.ok or resp.kind == "done":
                    if arena is not None and chunks:  # we are done with every offset
                        await conn.send(encode(Ack()))
                    _raise_for(resp)
                    return
                chunks += 1
                if resp.layers is None:
                    await conn.close()
                    raise ProtocolError("layer chunk without its layer range")
                views = layer_views(resp.layers.start)
                if arena is None:
                    await conn.recv_segments(frame, views)
                else:
                    offsets, sizes = _offsets(resp, len(ids)), _sizes(resp, len(ids))
                    await arena.read_many(views, offsets, sizes)
                yield resp.layers.start

    async def close(self) -> None:
        """Close the idle connections and unmap the node's arena (no call may be running)."""
        idle, self._idle = self._idle, []
        for link in idle:
            await link.conn.close()
        arenas, self._replaced = [*self._replaced, self._arena], []
        self._arena = None
        self._unusable.clear()
        for arena in arenas:
            if arena is not None:
                arena.close()


__all__ = ["NodeClient", "TransportError"]
