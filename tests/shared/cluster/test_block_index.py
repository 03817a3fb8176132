"""The prompt index against a real redis-server: entries follow holdings, an instance's
entries clear at once, a publisher mirrors and republishes what it holds, and a
heartbeat that finds its key expired asks for that republish."""

from __future__ import annotations

import asyncio
import uuid

import redis.asyncio as aioredis

from shared.cluster.block_index import BlockIndex, IndexPublisher
from shared.cluster.keys import Keys
from shared.cluster.membership import Heartbeat, Member
from shared.procs import RedisProcess


def fresh(redis_server: RedisProcess) -> tuple[aioredis.Redis, BlockIndex]:
    redis = aioredis.from_url(redis_server.url)
    return redis, BlockIndex(redis, Keys(f"t{uuid.uuid4().hex[:8]}"), ttl_s=60)


async def test_entries_follow_holdings_and_clear_per_instance(redis_server: RedisProcess) -> None:
    redis, index = fresh(redis_server)
    try:
        await index.add("store-a", ["a1", "a2", "a3"])
        await index.add("prefill-1", ["a1", "a2"])
        assert await index.holders(["a1", "a3", "zz"]) == [
            {"store-a", "prefill-1"},
            {"store-a"},
            set(),
        ]
        assert await index.longest_prefix(["a1", "a2", "a3"], live={"prefill-1"}) == 2
        await index.remove("store-a", ["a2"])
        assert await index.longest_prefix(["a1", "a2", "a3"], live={"store-a"}) == 1
        assert await index.instances() == {"store-a", "prefill-1"}
        assert await index.clear("prefill-1") == 2
        assert await index.holders(["a1", "a2"]) == [{"store-a"}, set()]
        assert await index.instances() == {"store-a"}
        # many entries clear in batches
        many = [f"b{i}" for i in range(5000)]
        await index.add("decode-9", many)
        assert await index.clear("decode-9") == 5000
        assert (await index.holders(many[-1:])) == [set()]
    finally:
        await redis.aclose()


async def test_prefix_holders_end_at_the_first_block_nobody_holds(
    redis_server: RedisProcess,
) -> None:
    redis, index = fresh(redis_server)
    try:
        await index.add("store-a", ["p1", "p2", "p4"])
        await index.add("prefill-1", ["p1"])
        ids = ["p1", "p2", "p3", "p4"]
        assert await index.prefix_holders(ids) == (await index.holders(ids))[:2]
        assert await index.prefix_holders(["p3", "p1"]) == []
        assert await index.prefix_holders([]) == []
        assert await index.longest_prefix(ids) == 2
        assert await index.longest_prefix(ids, live={"prefill-1"}) == 1
    finally:
        await redis.aclose()


async def test_publisher_mirrors_holdings_clears_on_start_and_withdraws(
    redis_server: RedisProcess,
) -> None:
    redis, index = fresh(redis_server)
    try:
        await index.add("p-1", ["left-by-an-earlier-process"])
        pub = IndexPublisher(index, "p-1")
        await pub.start()  # an instance's old entries go when it starts
        assert await index.holders(["left-by-an-earlier-process"]) == [set()]
        pub.added(["k1", "k2", "k3"])
        pub.removed(["k2"])
        await pub.flush()
        assert pub.held == {"k1", "k3"}
        assert await index.holders(["k1", "k2", "k3"]) == [{"p-1"}, set(), {"p-1"}]
        await index.clear("p-1")  # declared dead by someone else while alive
        pub.resync()
        await pub.flush()
        assert await index.holders(["k1", "k3"]) == [{"p-1"}, {"p-1"}]
        await pub.stop(withdraw=True)
        assert await index.instances() == set()
    finally:
        await redis.aclose()


async def test_heartbeat_that_finds_its_key_expired_asks_for_a_republish(
    redis_server: RedisProcess,
) -> None:
    redis = aioredis.from_url(redis_server.url)
    keys = Keys(f"t{uuid.uuid4().hex[:8]}")
    member = Member(instance_id="d-1", role="decode", host="h", http_port=1)
    calls: list[str] = []

    async def republish() -> None:
        calls.append("republish")

    beat = Heartbeat(redis, keys, member, interval_s=10, ttl_s=0.2, on_reconnect=republish)
    try:
        assert await beat.beat()
        assert calls == ["republish"]  # the first registration
        assert await beat.beat()
        assert calls == ["republish"]  # refreshed in time: nothing to do
        await asyncio.sleep(0.4)  # a stall longer than the key's TTL
        assert await beat.beat()
        assert calls == ["republish", "republish"]
    finally:
        await beat.stop()
        await redis.aclose()
