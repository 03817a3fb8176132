"""Membership against a real redis-server: live members are read from their role's id
set (never by scanning the keyspace, which the prompt index fills), an expired
member is dropped and pruned, a deregistered one is gone at once."""

from __future__ import annotations

import asyncio
import uuid

import redis.asyncio as aioredis

from shared.cluster.keys import Keys
from shared.cluster.membership import Heartbeat, LastKnown, Member, live_members
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


class FakeClock:
    """A settable monotonic clock (a fake, for the pure logic below)."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def member(name: str) -> Member:
    return Member(instance_id=name, role="kvstore", host="h", http_port=1)


def test_an_emptied_registry_keeps_the_last_known_members_for_the_grace_only() -> None:
    clock = FakeClock()
    view = LastKnown(grace_s=5.0, clock=clock)
    assert view.update([]) == []  # nothing known yet: nothing to bridge
    a, b = member("a"), member("b")
    assert view.update([a, b]) == [a, b]
    clock.now += 12.0  # Redis unreachable meanwhile (no reads): the grace is not used up
    assert view.update([]) == [a, b]  # it came back empty: bridged
    clock.now += 4.9
    assert view.update([]) == [a, b]
    clock.now += 0.2  # empty for 5.1 s: they are gone
    assert view.update([]) == []
    assert view.update([]) == []


def test_a_non_empty_registry_replaces_the_view_at_once() -> None:
    clock = FakeClock()
    view = LastKnown(grace_s=5.0, clock=clock)
    a, b = member("a"), member("b")
    view.update([a, b])
    assert view.update([a]) == [a]  # b deregistered (drained): gone on the next read
    assert view.update([]) == [a]
    clock.now += 4.0
    assert view.update([b]) == [b]  # re-registration after a restart
    assert view.update([]) == [b]
    clock.now += 4.0
    assert view.update([]) == [b]  # the grace restarts with each empty spell
    clock.now += 1.0
    assert view.update([]) == []
