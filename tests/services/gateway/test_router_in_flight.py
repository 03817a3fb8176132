"""Two gateways' routers on one real redis-server: a prompt one gateway routed and is
still computing counts, at the other gateway, as held where it went (the same
prediction one gateway makes alone), and stops counting shortly after it ends."""

from __future__ import annotations

import asyncio
import uuid

import redis.asyncio as aioredis

from services.gateway.prefix_locator import PrefixLocator
from services.gateway.router import Pick, Router
from shared.cluster.block_index import BlockIndex
from shared.cluster.in_flight import InFlightIndex
from shared.cluster.keys import Keys
from shared.cluster.membership import Member
from shared.procs import RedisProcess

BLOCK = 16


def member(name: str, pending: float = 0.0) -> Member:
    return Member(
        instance_id=name, role="prefill", host="127.0.0.1", http_port=1, model="m",
        kv_namespace="ns", load={"pending_tokens": pending},
    )  # fmt: skip


def gateway(
    redis: aioredis.Redis, keys: Keys, *, sharing: bool = True
) -> tuple[Router, PrefixLocator]:
    shared = InFlightIndex(redis, keys, grace_s=0.3) if sharing else None
    index = BlockIndex(redis, keys, ttl_s=60)
    r = Router(redis, keys, model="m", refresh_s=1.0, index=index, in_flight=shared)
    r.members = {"prefill": [member("a"), member("b", pending=100)], "decode": []}
    r.kv_namespace, r.block_size = "ns", BLOCK
    return r, PrefixLocator(index, enabled=True, in_flight=shared)


async def test_a_prompt_routed_by_one_gateway_is_seen_computing_by_the_other(
    redis_server: RedisProcess,
) -> None:
    redis = aioredis.from_url(redis_server.url)
    keys = Keys(f"t{uuid.uuid4().hex[:8]}")
    one, two, three = (gateway(redis, keys) for _ in range(3))
    blind = gateway(redis, keys, sharing=False)  # as every gateway was before
    live = {"a": "prefill", "b": "prefill"}

    async def route(gw: tuple[Router, PrefixLocator], prompt: list[int]) -> Pick:
        router, locator = gw
        hits = await locator.locate(prompt, None, namespace="ns", block_size=BLOCK, live=live)
        pick = router.pick("prefill", len(prompt), hits=hits)
        await router.share(pick)
        return pick

    system = list(range(1000, 1000 + 20 * BLOCK))  # 20 blocks both prompts share
    try:
        first = await route(one, [*system, *range(5, 5 + 40)])
        assert first.member.instance_id == "a" and first.predicted_cached == 0
        for router, _ in (two, blind):  # a has published the first prompt as its queue
            router.members["prefill"][0] = member("a", pending=360)
        # b is the shorter queue, but a computes 320 of the twin's tokens already (the
        # twin waits for them there): 360 + 300 against 100 + 620
        twin = await route(two, [*system, *range(7, 7 + 300)])
        assert twin.member.instance_id == "a" and twin.predicted_cached == 20 * BLOCK
        unseen = await route(blind, [*system, *range(9, 9 + 300)])
        # a gateway on its own view routes blind: to b, to compute it all again
        assert unseen.member.instance_id == "b" and unseen.predicted_cached == 0
        for pick in (first, twin, unseen):
            pick.done()
        await asyncio.sleep(0.5)  # the grace: by now the prompt index speaks for them
        late = await route(three, [*system, 1, 2, 3])
        assert late.predicted_cached == 0
        late.done()
    finally:
        for router, _ in (one, two, three, blind):
            await router.stop()
        await redis.aclose()
