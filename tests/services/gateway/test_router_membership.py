"""The router's membership view against a real redis-server: it reads again out of turn
when no instance qualifies (a replacement registered since its last poll), and it
keeps its last known instances while a restarted, empty Redis has not heard their
next heartbeat yet."""

from __future__ import annotations

import uuid

import pytest
import redis.asyncio as aioredis

from services.gateway.router import Router
from shared.cluster.keys import Keys
from shared.cluster.membership import Heartbeat, Member
from shared.procs import RedisProcess
from shared.serving.errors import ServiceError


def prefill(name: str) -> Member:
    return Member(
        instance_id=name, role="prefill", host="127.0.0.1", http_port=1, model="m",
        kv_namespace="ns",
    )  # fmt: skip


async def test_no_qualifying_instance_reads_membership_again_before_503(
    redis_server: RedisProcess,
) -> None:
    redis = aioredis.from_url(redis_server.url)
    keys = Keys(f"t{uuid.uuid4().hex[:8]}")
    router = Router(redis, keys, model="m", refresh_s=60.0)  # its own poll never comes
    a = Heartbeat(redis, keys, prefill("a"), interval_s=10, ttl_s=30)
    b = Heartbeat(redis, keys, prefill("b"), interval_s=10, ttl_s=30)
    try:
        await a.beat()
        await router.refresh()
        router.bench(router.members["prefill"][0])  # a drains: it refused a request
        await b.beat()  # its replacement registered after the router's last poll
        with pytest.raises(ServiceError):
            router.pick("prefill", 10)  # the stale view has none
        await router.catch_up("prefill")
        assert router.pick("prefill", 10).member.instance_id == "b"
    finally:
        await redis.aclose()


async def test_an_emptied_registry_keeps_the_last_known_instances_for_a_member_ttl(
    redis_server: RedisProcess,
) -> None:
    redis = aioredis.from_url(redis_server.url)
    keys = Keys(f"t{uuid.uuid4().hex[:8]}")
    router = Router(redis, keys, model="m", refresh_s=60.0, member_ttl_s=30.0)
    a = Heartbeat(redis, keys, prefill("a"), interval_s=10, ttl_s=30)
    try:
        await a.beat()
        await router.refresh()
        await redis.delete(keys.member("prefill", "a"), keys.members("prefill"))  # Redis lost it
        await router.refresh()
        assert [m.instance_id for m in router.live("prefill")] == ["a"]
        assert router.registered("prefill", "a")
    finally:
        await redis.aclose()
