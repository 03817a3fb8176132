"""The store client keeps one node client (and its pooled connections) per store process,
and its known nodes across a Redis restarted empty."""

from __future__ import annotations

import asyncio
import uuid

import redis.asyncio as aioredis

from shared.cluster.keys import Keys
from shared.cluster.membership import Heartbeat, Member
from shared.kvstore.client import KVStoreClient
from shared.procs import RedisProcess
from shared.transport import make_transport


def store(load: float, started_at: float = 1.0) -> Member:
    return Member(
        instance_id="kvstore-1",
        role="kvstore",
        host="127.0.0.1",
        http_port=8300,
        data_port=8301,
        transport="tcp",
        load={"used_bytes": load},
        started_at=started_at,
    )


async def test_heartbeats_keep_the_node_client_and_a_restart_replaces_it() -> None:
    redis = aioredis.from_url("redis://127.0.0.1:1/0")  # never contacted here
    client = KVStoreClient(make_transport("tcp"), redis, Keys("test"))
    first = client._node(store(load=0.0))
    again = client._node(store(load=4096.0))  # a later heartbeat: new load figures
    assert again is first and again.member.load == {"used_bytes": 4096.0}
    restarted = client._node(store(load=0.0, started_at=2.0))
    assert restarted is not first
    assert client._retired == [first]  # its idle connections are closed on the next refresh
    await client.close()
    await redis.aclose()


async def test_store_nodes_outlive_a_redis_that_lost_its_state_until_the_ttl(
    redis_server: RedisProcess,
) -> None:
    """Redis restarted empty reads as every store node gone until their next heartbeat;
    the client keeps the last known nodes for a member TTL instead of failing every
    request with "no live KV store node" (seen in CI: the Redis outage test)."""
    redis = aioredis.from_url(redis_server.url)
    keys = Keys(f"t{uuid.uuid4().hex[:8]}")
    beat = Heartbeat(redis, keys, store(load=0.0), interval_s=10, ttl_s=30)
    client = KVStoreClient(make_transport("tcp"), redis, keys, member_ttl_s=0.5)
    try:
        assert await beat.beat()
        assert [n.instance_id for n in await client.nodes(force=True)] == ["kvstore-1"]
        await redis.delete(keys.member("kvstore", "kvstore-1"), keys.members("kvstore"))
        assert [n.instance_id for n in await client.nodes(force=True)] == ["kvstore-1"]
        await asyncio.sleep(0.6)  # no heartbeat within a TTL: the node is gone
        assert await client.nodes(force=True) == []
        assert await beat.beat()  # it re-registers
        assert [n.instance_id for n in await client.nodes(force=True)] == ["kvstore-1"]
    finally:
        await client.close()
        await redis.aclose()
