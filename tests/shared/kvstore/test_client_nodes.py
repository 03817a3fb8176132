"""The store client keeps one node client (and its pooled connections) per store process."""

from __future__ import annotations

import redis.asyncio as aioredis

from shared.cluster.keys import Keys
from shared.cluster.membership import Member
from shared.kvstore.client import KVStoreClient
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
