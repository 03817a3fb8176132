"""Talking to one KV store node: pooled connections and one method per op.

Connections are created on demand (up to ``max_connections``), greet the node
with this client's id (the node frees this client's unfinished reservations
when its last connection goes), and are reused. A connection that saw a
transport error or a cancellation mid-exchange is closed, never reused.
Every call is bounded: ``timeout_s`` plus the read's own ``wait_s``.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable, Sequence

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
from shared.kvstore.protocol import (
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
    Write,
    decode_response,
    encode,
)
from shared.transport.base import Buffer, Connection, Transport

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
    ):
        if member.data_port is None:
            raise ValueError(f"store node {member.instance_id} has no data port")
        self.member = member
        self.transport = transport
        self.client_id = client_id
        self.timeout_s = timeout_s
        self.secret = secret or ClusterSecret()
        self._idle: list[Connection] = []
        self._slots = asyncio.Semaphore(max_connections)

    @property
    def instance_id(self) -> str:
        return self.member.instance_id

    @contextlib.asynccontextmanager
    async def _connection(self, wait_s: float = 0.0) -> AsyncIterator[Connection]:
        async with self._slots:
            conn = None
            try:
                async with asyncio.timeout(self.timeout_s + wait_s):
                    while self._idle and conn is None:
                        candidate = self._idle.pop()
                        conn = None if candidate.closed else candidate
                    if conn is None:
                        conn = await self._open()
                    yield conn
            except TimeoutError as exc:
                raise TransportTimeoutError(
                    f"store {self.instance_id} did not answer within {self.timeout_s + wait_s:.1f}s"
                ) from exc
            except KVStoreError:
                raise  # a refusal is a complete reply: the connection is still in step
            except BaseException:
                if conn is not None:  # mid-exchange failure: the stream cannot be resynced
                    await conn.close()
                    conn = None
                raise
            finally:
                if conn is not None and not conn.closed:
                    self._idle.append(conn)

    async def _open(self) -> Connection:
        conn = await self.transport.connect(
            self.member.host, int(self.member.data_port or 0), timeout=self.timeout_s
        )
        proof = self.secret.prove(self.client_id)
        auth = None if proof is None else HelloAuth(nonce=proof.nonce, ts=proof.ts, mac=proof.mac)
        await conn.send(encode(Hello(client_id=self.client_id, auth=auth)))
        try:
            _raise_for(await self._reply(conn))
        except KVStoreError:
            await conn.close()
            raise
        return conn

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
        async with self._connection() as conn:
            await conn.send(encode(req))
            return _raise_for(await self._reply(conn))

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
        """Whole blocks in one round trip: reserved, written and committed on the node."""
        req = Put(blocks=list(specs), num_layers=num_layers, ttl_s=ttl_s)
        async with self._connection() as conn:
            await conn.send(encode(req), segments)
            return list(_raise_for(await self._reply(conn)).statuses or [])

    async def write(
        self, ids: Sequence[str], segments: Sequence[Buffer], layers: Layers | None = None
    ) -> None:
        async with self._connection() as conn:
            await conn.send(encode(Write(ids=list(ids), layers=_range(layers))), segments)
            _raise_for(await self._reply(conn))

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
        req = Get(ids=list(ids), layers=_range(layers), wait_s=wait_s)
        async with self._connection(wait_s) as conn:
            await conn.send(encode(req))
            frame = await conn.recv()
            resp = decode_response(frame.header)
            if not resp.ok:
                _raise_for(resp)
            try:
                await conn.recv_segments(frame, into)
            except ValueError as exc:  # our buffers do not match what the store holds
                await conn.close()
                raise KVBadRequestError(
                    f"get buffers do not match the stored blocks: {exc}"
                ) from exc

    async def stream(
        self,
        ids: Sequence[str],
        layer_views: Callable[[int], Sequence[Buffer]],
        *,
        layers: Layers,
        wait_s: float,
    ) -> AsyncIterator[int]:
        """Yields each layer index once its slices landed in ``layer_views(layer)``.

        Ends normally only when the store confirmed every block committed; an
        error after some layers means those bytes must not be used.
        """
        req = Get(ids=list(ids), layers=_range(layers), stream=True, wait_s=wait_s)
        async with self._connection(wait_s) as conn:
            await conn.send(encode(req))
            while True:
                frame = await conn.recv()
                resp = _raise_for(decode_response(frame.header))
                if resp.kind == "done":
                    return
                if resp.layers is None:
                    await conn.close()
                    raise ProtocolError("layer chunk without its layer range")
                await conn.recv_segments(frame, layer_views(resp.layers.start))
                yield resp.layers.start

    async def close(self) -> None:
        idle, self._idle = self._idle, []
        for conn in idle:
            await conn.close()


__all__ = ["NodeClient", "TransportError"]
