"""A KV store node: data-plane listener + HTTP control plane + Redis membership.

Long-lived parts (transport, Redis client, store) are created once in the
FastAPI lifespan and torn down in reverse order. A clean shutdown withdraws
the node's blocks from the Redis index and deregisters it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from services.kvstore.dataplane import DataPlane
from services.kvstore.metrics import StoreMetrics
from services.kvstore.settings import KVStoreSettings
from services.kvstore.store import BlockStore
from shared.cluster import redis_client
from shared.cluster.auth import AuthMetrics, ClusterSecret
from shared.cluster.block_index import BlockIndex, IndexPublisher
from shared.cluster.keys import Keys
from shared.cluster.membership import Heartbeat, Member
from shared.config import ClusterConfig
from shared.service import component_of, service_app
from shared.transport import Listener, Transport, make_transport

log = logging.getLogger(__name__)
ROLE = "kvstore"
PUBLISH_WAIT_S = 1.0


class KVStoreNode:
    def __init__(self, settings: KVStoreSettings, cluster: ClusterConfig):
        self.settings = settings
        self.cluster = cluster
        self.metrics = StoreMetrics()
        self.redis = redis_client.connect(cluster.redis_url)
        self.keys = Keys(cluster.redis_prefix)
        index = BlockIndex(self.redis, self.keys, cluster.index_ttl_s)
        self.publisher = IndexPublisher(index, settings.instance_id)
        self.store = BlockStore(settings.store_config(), self.metrics, self.publisher)
        self.metrics.bind_gauges(self.store.stats)
        secret = ClusterSecret(cluster.secret)
        secret.warn_if_open("kvstore")
        self.dataplane = DataPlane(
            self.store,
            self.metrics,
            self._publish,
            secret=secret,
            auth_metrics=AuthMetrics(self.metrics.registry),
        )
        self.transport: Transport | None = None
        self.listener: Listener | None = None
        self.heartbeat: Heartbeat | None = None
        self._sweeper: asyncio.Task[None] | None = None

    async def _publish(self) -> None:
        """Index a commit before acknowledging it, bounded so a slow Redis cannot stall puts."""
        if self.heartbeat is None or not self.heartbeat.healthy:
            return  # degraded: the publisher resyncs when Redis is back
        try:
            await asyncio.wait_for(asyncio.shield(self.publisher.flush()), PUBLISH_WAIT_S)
        except TimeoutError:
            log.warning("index update slower than %.1fs; continuing", PUBLISH_WAIT_S)

    async def start(self) -> None:
        s = self.settings
        self.transport = make_transport(self.cluster.transport)
        self.listener = await self.transport.listen(s.host, s.data_port, self.dataplane.serve)
        member = Member(
            instance_id=s.instance_id,
            role=ROLE,
            host=s.advertise_host,
            http_port=s.http_port,
            data_port=self.listener.port,
            transport=self.transport.name,
            capacity_bytes=self.store.arena.capacity,
            started_at=time.time(),
        )

        async def resync() -> None:
            self.publisher.resync()

        self.heartbeat = Heartbeat.for_cluster(
            self.redis, self.cluster, member, load=self.store.stats, on_reconnect=resync
        )
        await self.publisher.start()
        await self.heartbeat.beat()
        self.heartbeat.start()
        self._sweeper = asyncio.create_task(self._sweep(), name="kvstore-sweeper")
        log.info(
            "kvstore %s: data %s port %d, capacity %.2f GiB, shared with local clients: %s",
            s.instance_id,
            self.transport.name,
            self.listener.port,
            self.store.arena.capacity / (1 << 30),
            self.store.arena.shm_path or "no",
        )

    async def _sweep(self) -> None:
        while True:
            await asyncio.sleep(self.settings.sweep_s)
            self.store.expire()

    async def stop(self) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._sweeper
        if self.heartbeat is not None:
            await self.heartbeat.stop(deregister=True)
        await self.publisher.stop(withdraw=True)
        if self.listener is not None:
            await self.listener.close()
        if self.transport is not None:
            await self.transport.shutdown()
        await self.redis.aclose()
        self.store.close()  # after the listener: no connection can touch the arena now

    def ready(self) -> tuple[bool, dict[str, object]]:
        redis_ok = self.heartbeat is not None and self.heartbeat.healthy
        up = self.listener is not None
        status = "ready" if up and redis_ok else ("degraded" if up else "starting")
        return up, {"status": status, "redis": redis_ok, "instance_id": self.settings.instance_id}


def create_app(settings: KVStoreSettings, cluster: ClusterConfig) -> FastAPI:
    async def build() -> KVStoreNode:
        return KVStoreNode(settings, cluster)

    app = service_app("Baton KV store", build)

    def node_of(request: Request) -> KVStoreNode:
        return component_of(request, KVStoreNode)

    @app.get("/ready")
    async def ready(request: Request) -> JSONResponse:
        up, body = node_of(request).ready()
        return JSONResponse(body, status_code=200 if up else 503)

    @app.get("/stats")
    async def stats(request: Request) -> dict[str, float]:
        return node_of(request).store.stats()

    @app.get("/metrics")
    async def metrics(request: Request) -> Response:
        body = node_of(request).metrics.render()
        return Response(body, media_type="text/plain; version=0.0.4")

    return app
