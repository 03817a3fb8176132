"""The store's data plane: one loop per connection turning frames into store ops.

Every frame is answered; a refused op answers an error body and the
connection stays usable (an unwanted payload is drained first). Only a broken
stream (peer gone, garbage preamble) ends the connection. When a client's last
connection ends, its unfinished reservations are freed.

When the cluster has a secret, a connection's first frame must be a hello that
proves it (:mod:`shared.cluster.auth`); anything else gets one ``unauthorized``
refusal, is counted, and the connection is closed.

Same-host clients: a hello that asks (``shm``) is answered with the shared
arena's path, size and host, only once it passed the secret check. Their
``local`` ops move no payload (see :mod:`shared.kvstore.protocol`): the reply
carries arena offsets of blocks this loop keeps pinned (a write's
``begin_write``, a read's ``open_read``) until the client's ``ack`` on this
connection, or until the connection breaks, so no slot a client may still be
copying to or from is ever freed or reused. That ``ack`` (or the loss) is the
only thing that ends the pin: no timeout does, since the client's copy may
still run.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence
from itertools import count

import numpy as np
from pydantic import ValidationError

from services.kvstore.metrics import StoreMetrics
from services.kvstore.store import BlockStore, Entry
from shared.cluster.auth import AuthMetrics, ClusterSecret, HelloProof, ProofChecker
from shared.errors import KVBadRequestError, KVStoreError, KVUnauthorizedError, TransportError
from shared.kvstore.local_arena import host_identity
from shared.kvstore.protocol import (
    REQUEST,
    Ack,
    Commit,
    ErrorBody,
    Get,
    Hello,
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
    encode,
)
from shared.transport.base import Connection, Frame

log = logging.getLogger(__name__)
OK = encode(Response())
SETTLE_S = 5.0  # how long a commit waits for writes to its blocks still in flight


def _span(layers: LayerRange | None) -> tuple[int, int] | None:
    return None if layers is None else (layers.start, layers.stop)


def _shared_arena(store: BlockStore) -> SharedArena | None:
    """What same-host clients are told to map, or None (not shared, or no host identity)."""
    path, host = store.arena.shm_path, host_identity()
    if path is None or host is None:
        return None
    return SharedArena(path=str(path), size=store.arena.capacity, host=host)


def _maybe(offsets: Sequence[int]) -> list[int | None]:
    """Offsets as the reply's field type (where a put's skipped blocks are None)."""
    return [*offsets]


def _error(exc: KVStoreError) -> bytes:
    body = ErrorBody(code=exc.code, message=str(exc), ids=exc.ids[:64])
    return encode(Response(ok=False, error=body))


class DataPlane:
    def __init__(
        self,
        store: BlockStore,
        metrics: StoreMetrics,
        publish: Callable[[], Awaitable[object]] | None = None,
        *,
        secret: ClusterSecret | None = None,
        auth_metrics: AuthMetrics | None = None,
    ):
        self.store = store
        self.proofs = ProofChecker(secret or ClusterSecret())
        self.auth_metrics = auth_metrics
        self.metrics = metrics
        self.publish = publish  # awaited after a commit: the reply means "indexed"
        self._clients: Counter[str] = Counter()
        self._anon = count(1)
        self.shared = _shared_arena(store)

    def _hello_reply(self, req: Hello) -> bytes:
        return encode(Response(arena=self.shared)) if req.shm and self.shared else OK

    async def serve(self, conn: Connection) -> None:
        client = f"anon-{next(self._anon)}"
        self._clients[client] += 1
        self.metrics.connections.inc()
        try:
            if self.proofs.secret.enabled:
                admitted = await self._admit(conn, await conn.recv())
                if admitted is None:
                    return
                self._leave(client)
                client = admitted
                self._clients[client] += 1
            while True:
                frame = await conn.recv()
                client = await self._one(conn, frame, client)
        except TransportError as exc:
            log.debug("data connection %s ended: %s", conn.peer, exc)
        finally:
            self.metrics.connections.dec()
            self._leave(client)

    async def _admit(self, conn: Connection, frame: Frame) -> str | None:
        """The client id of a hello that proves the secret; else refuse, close, None."""
        try:
            req = REQUEST.validate_json(frame.header)
        except ValidationError:
            req = None
        if isinstance(req, Hello) and not frame.sizes:
            auth = req.auth
            proof = None if auth is None else HelloProof(auth.nonce, auth.ts, auth.mac)
            if self.proofs.accepts(req.client_id, proof):
                await conn.send(self._hello_reply(req))
                return req.client_id
        if self.auth_metrics is not None:
            self.auth_metrics.refused.labels("dataplane").inc()
        log.warning("refused a data connection from %s: no valid cluster secret", conn.peer)
        self.metrics.errors.labels("unauthorized").inc()
        if frame.sizes:
            await conn.discard(frame)
        await conn.send(_error(KVUnauthorizedError("the KV data plane needs the cluster secret")))
        await conn.close()
        return None

    def _leave(self, client: str) -> None:
        self._clients[client] -= 1
        if self._clients[client] <= 0:
            del self._clients[client]
            freed = self.store.client_gone(client)
            if freed:
                log.info("client %s left; freed %d unfinished reservations", client, freed)

    async def _one(self, conn: Connection, frame: Frame, client: str) -> str:
        started = time.perf_counter()
        op = "invalid"
        try:
            try:
                req = REQUEST.validate_json(frame.header)
            except ValidationError as exc:
                first = exc.errors()[0]
                where = ".".join(str(p) for p in first["loc"])
                raise KVBadRequestError(f"invalid request ({where}): {first['msg']}") from exc
            op = req.op
            local = isinstance(req, Write | Put | Get) and req.local
            if frame.sizes and (local or not isinstance(req, Write | Put)):
                raise KVBadRequestError(f"op {op!r} takes no payload")
            if local and self.shared is None:
                raise KVBadRequestError("this node's arena is not shared: no local ops")
            if isinstance(req, Hello):
                self._leave(client)
                client = req.client_id
                self._clients[client] += 1
                await conn.send(self._hello_reply(req))
            elif isinstance(req, Ack):
                raise KVBadRequestError("ack without a local copy to acknowledge")
            elif isinstance(req, Write):
                await (self._write_local(conn, req) if local else self._write(conn, frame, req))
            elif isinstance(req, Put):
                await (
                    self._put_local(conn, req, client)
                    if local
                    else self._put(conn, frame, req, client)
                )
            elif isinstance(req, Get):
                await self._get(conn, req)
            elif isinstance(req, Commit):
                await self.store.settled(req.ids, time.monotonic() + SETTLE_S)
                self.store.commit(req.ids)
                if self.publish is not None:
                    await self.publish()
                await conn.send(OK)
            else:
                await conn.send(self._simple(req, client))
        except KVStoreError as exc:
            self.metrics.errors.labels(exc.code).inc()
            if frame.sizes:
                await conn.discard(frame)
            await conn.send(_error(exc))
        self.metrics.op_seconds.labels(op).observe(time.perf_counter() - started)
        return client

    def _simple(
        self, req: Reserve | Revoke | Lookup | Lease | Release | Ping, client: str
    ) -> bytes:
        s = self.store
        if isinstance(req, Reserve):
            return encode(
                Response(statuses=s.reserve(client, req.blocks, req.num_layers, req.ttl_s))
            )
        if isinstance(req, Revoke):
            s.revoke(req.ids)
        elif isinstance(req, Lookup):
            return encode(Response(num_hit=s.lookup(req.ids)))
        elif isinstance(req, Lease):
            return encode(Response(lease_id=s.lease(req.ids, req.ttl_s)))
        elif isinstance(req, Release):
            s.release(req.lease_id)
        else:
            return encode(Response(stats=s.stats()))
        return OK

    async def _write(self, conn: Connection, frame: Frame, req: Write) -> None:
        transfer = self.store.begin_write(req.ids, _span(req.layers))
        ok = False
        try:
            want = tuple(v.nbytes for v in transfer.views)
            if frame.sizes != want:
                raise KVBadRequestError(
                    f"payload segments {list(frame.sizes[:8])}... do not match the "
                    f"reserved sizes {list(want[:8])}... of {len(want)} blocks"
                )
            await conn.recv_segments(frame, transfer.views)
            ok = True
        finally:
            self.store.end_write(transfer, ok)
        self.metrics.bytes_in.inc(frame.payload_bytes)
        await conn.send(OK)

    async def _await_ack(self, conn: Connection) -> bool:
        """The client's ``ack`` of its copies (its ``ok``); anything else is refused.

        A broken connection raises TransportError: the caller's ``finally`` unpins."""
        frame = await conn.recv()
        try:
            req = REQUEST.validate_json(frame.header)
        except ValidationError:
            req = None
        if isinstance(req, Ack) and not frame.sizes:
            return req.ok
        if frame.sizes:
            await conn.discard(frame)
        raise KVBadRequestError("expected the ack of a local copy; the copy is abandoned")

    async def _write_local(self, conn: Connection, req: Write) -> None:
        transfer = self.store.begin_write(req.ids, _span(req.layers))
        want = [v.nbytes for v in transfer.views]
        ok = False
        try:
            if req.sizes != want:
                raise KVBadRequestError(
                    f"payload segments {list((req.sizes or [])[:8])}... do not match the "
                    f"reserved sizes {want[:8]}... of {len(want)} blocks"
                )
            await conn.send(encode(Response(offsets=_maybe(transfer.offsets))))
            ok = await self._await_ack(conn)  # not answered: the write is 1 round trip
        finally:
            self.store.end_write(transfer, ok)
        if ok:
            self.metrics.bytes_in.inc(sum(want))
            self.metrics.local_bytes_in.inc(sum(want))

    async def _put_local(self, conn: Connection, req: Put, client: str) -> None:
        statuses = self.store.reserve(client, req.blocks, req.num_layers, req.ttl_s)
        fresh = [b.id for b, st in zip(req.blocks, statuses, strict=True) if st == "reserved"]
        transfer = self.store.begin_write(fresh, None)
        offsets = iter(transfer.offsets)
        ok = False
        try:
            head = Response(
                statuses=statuses,
                offsets=[next(offsets) if st == "reserved" else None for st in statuses],
            )
            await conn.send(encode(head))
            ok = await self._await_ack(conn)
        finally:
            self.store.end_write(transfer, ok)
            if not ok:
                self.store.revoke(fresh)
        if not ok:  # the client's copy failed: it knows, nothing was kept
            await conn.send(OK)
            return
        nbytes = sum(v.nbytes for v in transfer.views)
        self.metrics.bytes_in.inc(nbytes)
        self.metrics.local_bytes_in.inc(nbytes)
        self.store.commit(fresh)
        if self.publish is not None:
            await self.publish()
        await conn.send(encode(Response(statuses=statuses)))

    async def _put(self, conn: Connection, frame: Frame, req: Put, client: str) -> None:
        sizes = tuple(b.size for b in req.blocks)
        if frame.sizes != sizes:
            raise KVBadRequestError(f"put of {len(sizes)} blocks needs one segment per block")
        statuses = self.store.reserve(client, req.blocks, req.num_layers, req.ttl_s)
        fresh = [b.id for b, st in zip(req.blocks, statuses, strict=True) if st == "reserved"]
        transfer = self.store.begin_write(fresh, None)
        slots = iter(transfer.views)
        into = [  # blocks held already are drained into scratch and dropped
            next(slots) if st == "reserved" else np.empty(b.size, dtype=np.uint8)
            for b, st in zip(req.blocks, statuses, strict=True)
        ]
        ok = False
        try:
            await conn.recv_segments(frame, into)
            ok = True
        finally:
            self.store.end_write(transfer, ok)
            if not ok:
                self.store.revoke(fresh)
        self.metrics.bytes_in.inc(frame.payload_bytes)
        self.store.commit(fresh)
        if self.publish is not None:
            await self.publish()
        await conn.send(encode(Response(statuses=statuses)))

    async def _get(self, conn: Connection, req: Get) -> None:
        entries = self.store.open_read(req.ids)
        try:
            deadline = time.monotonic() + req.wait_s
            if req.stream:
                await self._stream(conn, req, entries, deadline)
                return
            await self.store.wait_for(entries, None, deadline)
            span = _span(req.layers)
            views = self.store.views(entries, span)
            head = Response(
                sizes=[v.nbytes for v in views],
                num_layers=[e.num_layers for e in entries],
                offsets=_maybe(self.store.offsets(entries, span)) if req.local else None,
            )
            if req.local:
                await conn.send(encode(head))
                await self._await_ack(conn)
                self._count_local_out(views)
            else:
                await self._send_payload(conn, encode(head), views)
        finally:
            self.store.close_read(entries)

    async def _stream(
        self, conn: Connection, req: Get, entries: Sequence[Entry], deadline: float
    ) -> None:
        layer_counts = {e.num_layers for e in entries}
        if len(layer_counts) != 1:
            raise KVBadRequestError("a layer stream needs blocks with the same layer count")
        count = layer_counts.pop()
        start, stop = _span(req.layers) or (0, count)
        layers = range(start, stop) if req.layer_ids is None else req.layer_ids
        if req.layer_ids is not None and req.layer_ids[-1] >= count:
            raise KVBadRequestError(f"layer_ids: the blocks have {count} layers")
        chunks = 0  # a local reader acks the final frame once it had offsets
        try:
            for layer in layers:
                await self.store.wait_for(entries, layer, deadline)
                span = (layer, layer + 1)
                views = self.store.views(entries, span)
                head = Response(
                    kind="chunk",
                    layers=LayerRange(start=layer, stop=layer + 1),
                    sizes=[v.nbytes for v in views] if req.local else None,
                    offsets=_maybe(self.store.offsets(entries, span)) if req.local else None,
                )
                if req.local:
                    await conn.send(encode(head))
                    self._count_local_out(views)
                else:
                    await self._send_payload(conn, encode(head), views)
                chunks += 1
            await self.store.wait_for(entries, None, deadline)
            end = encode(Response(kind="done"))
        except KVStoreError as exc:
            self.metrics.errors.labels(exc.code).inc()
            end = _error(exc)  # ends the stream; the reader drops what it got
        await conn.send(end)
        if req.local and chunks:
            await self._await_ack(conn)  # the caller unpins the blocks after this

    def _count_local_out(self, views: Sequence[np.ndarray]) -> None:
        nbytes = sum(v.nbytes for v in views)
        self.metrics.bytes_out.inc(nbytes)
        self.metrics.local_bytes_out.inc(nbytes)

    async def _send_payload(
        self, conn: Connection, head: bytes, views: Sequence[np.ndarray]
    ) -> None:
        await conn.send(head, views)
        self.metrics.bytes_out.inc(sum(v.nbytes for v in views))
