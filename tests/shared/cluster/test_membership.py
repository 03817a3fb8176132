"""Membership against a real redis-server: live members are read from their role's id
set (never by scanning the keyspace, which the prompt index fills), an expired
member is dropped and pruned, a deregistered one is gone at once."""

from __future__ import annotations

import asyncio
import uuid

import redis.asyncio as aioredis

from shared.cluster.keys import Keys
from shared.cluster.membership import Heartbeat, Member, live_members
from shared.procs import RedisProcess


async def test_live_members_follow_heartbeats(redis_server: RedisProcess) -> None:
    redis = aioredis.from_url(redis_server.url)
    keys = Keys(f"t{uuid.uuid4().hex[:8]}")

    def beat(name: str, ttl_s: float) -> Heartbeat:
        member = Member(instance_id=name, role="prefill", host="h", http_port=1)
        return Heartbeat(redis, keys, member, interval_s=10, ttl_s=ttl_s)

    a, b, c = beat("a", 30), beat("b", 0.2), beat("c", 30)
    try:
        for hb in (a, b, c):
            assert await hb.beat()
        assert [m.instance_id for m in await live_members(redis, keys, "prefill")] == [
            "a",
            "b",
            "c",
        ]
        await asyncio.sleep(0.4)  # b's key expires: b died
        assert [m.instance_id for m in await live_members(redis, keys, "prefill")] == ["a", "c"]
        assert await redis.smembers(keys.members("prefill")) == {b"a", b"c"}  # pruned
        await c.stop(deregister=True)
        assert [m.instance_id for m in await live_members(redis, keys, "prefill")] == ["a"]
        assert await live_members(redis, keys, "decode") == []
    finally:
        await a.stop()
        await redis.aclose()
