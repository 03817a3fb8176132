"""Real KV store processes on free ports, and clients over both transports."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path

import pytest
import pytest_asyncio
import redis.asyncio as aioredis

from shared.cluster.auth import ClusterSecret
from shared.cluster.keys import Keys
from shared.errors import ConfigError
from shared.kvstore.client import KVStoreClient
from shared.procs import RedisProcess, ServiceProcess, free_port
from shared.transport import Transport
from tests.services.conftest import TRANSPORTS as TRANSPORTS


class StoreNode:
    def __init__(self, proc: ServiceProcess, http_port: int, instance_id: str):
        self.proc = proc
        self.http = f"http://127.0.0.1:{http_port}"
        self.instance_id = instance_id


StoreFactory = Callable[..., StoreNode]


@pytest.fixture
def start_store(redis_server: RedisProcess, tmp_path: Path) -> Iterator[StoreFactory]:
    started: list[StoreNode] = []

    def start(
        transport: str,
        prefix: str,
        *,
        redis_url: str | None = None,
        secret: str | None = None,
        **settings: str,
    ) -> StoreNode:
        for attempt in range(3):
            http = free_port()
            instance_id = f"kvstore-{uuid.uuid4().hex[:6]}"
            env = {
                "BATON_REDIS_URL": redis_url or redis_server.url,
                "BATON_REDIS_PREFIX": prefix,
                "BATON_TRANSPORT": transport,
                "BATON_HEARTBEAT_S": "0.2",
                "BATON_MEMBER_TTL_S": "1.0",
                "BATON_KVSTORE_HTTP_PORT": str(http),
                "BATON_KVSTORE_DATA_PORT": str(free_port()),
                "BATON_KVSTORE_CAPACITY_GB": "0.0625",
                "BATON_KVSTORE_SLAB_MB": "4",
                "BATON_KVSTORE_SWEEP_S": "0.1",
                "BATON_KVSTORE_ADVERTISE_HOST": "127.0.0.1",
                "BATON_KVSTORE_INSTANCE_ID": instance_id,
                "BATON_LOG_LEVEL": "warning",
            }
            env.update({f"BATON_KVSTORE_{k.upper()}": v for k, v in settings.items()})
            if secret is not None:
                env["BATON_CLUSTER_SECRET"] = secret
            log = tmp_path / f"{instance_id}.log"
            proc = ServiceProcess("services.kvstore", env, f"http://127.0.0.1:{http}/ready", log)
            node = StoreNode(proc.start(), http, instance_id)
            started.append(node)
            try:
                proc.wait_ready()
            except ConfigError as exc:  # a port taken between picking and binding
                if "already in use" not in str(exc) or attempt == 2:
                    raise
                continue
            return node
        raise AssertionError("unreachable")

    yield start
    for node in started:
        node.proc.stop()


ClientFactory = Callable[..., KVStoreClient]


@pytest_asyncio.fixture(loop_scope="session")
async def make_client(
    redis_server: RedisProcess, transports: dict[str, Transport]
) -> AsyncIterator[ClientFactory]:
    redis = aioredis.from_url(redis_server.url)
    clients: list[KVStoreClient] = []

    def make(
        transport: str,
        prefix: str,
        *,
        replication: int = 1,
        timeout_s: float = 10.0,
        secret: str | None = None,
        shm: bool = True,
    ) -> KVStoreClient:
        client = KVStoreClient(
            transports[transport],
            redis,
            Keys(prefix),
            replication=replication,
            timeout_s=timeout_s,
            refresh_s=0.1,
            secret=ClusterSecret(secret),
            shm=shm,
        )
        clients.append(client)
        return client

    yield make
    for client in clients:
        await client.close()
    await redis.aclose()


def prefix() -> str:
    return f"t{uuid.uuid4().hex[:8]}"


OneStore = Callable[..., tuple[StoreNode, KVStoreClient]]


@pytest.fixture
def one_store(start_store: StoreFactory, make_client: ClientFactory) -> OneStore:
    """A store node under a fresh key prefix, and a client of it."""

    def make(transport: str, **settings: str) -> tuple[StoreNode, KVStoreClient]:
        p = prefix()
        return start_store(transport, p, **settings), make_client(transport, p)

    return make
