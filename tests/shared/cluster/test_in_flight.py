"""The shared in-flight view against a real redis-server: a routed prompt's blocks are
seen by every reader until shortly after it ends, rows stop at the first block nobody
computes, keys expire with their last entry; and the pure prefix reading."""

from __future__ import annotations

import asyncio
import uuid

import redis.asyncio as aioredis

from shared.cluster.in_flight import InFlightIndex, in_flight_prefixes
from shared.cluster.keys import Keys
from shared.procs import RedisProcess


async def test_entries_last_while_computing_and_lapse_after_the_end(
    redis_server: RedisProcess,
) -> None:
    redis = aioredis.from_url(redis_server.url)
    keys = Keys(f"t{uuid.uuid4().hex[:8]}")
    index = InFlightIndex(redis, keys, computing_s=30, grace_s=0.3)
    try:
        await index.started("prefill-a", ["k1", "k2", "k3"])
        await index.started("prefill-b", ["k1", "k2"])
        assert await index.computing(["k1", "k2", "k3", "k4"]) == [
            {"prefill-a", "prefill-b"},
            {"prefill-a", "prefill-b"},
            {"prefill-a"},
        ]
        # a row nobody computes ends the answer: no prefix runs through it
        assert await index.computing(["zz", "k1"]) == []
        await index.ended("prefill-b", ["k1", "k2"])
        assert await index.computing(["k1"]) == [{"prefill-a", "prefill-b"}]  # the grace
        await asyncio.sleep(0.45)
        assert await index.computing(["k1", "k2", "k3"]) == [{"prefill-a"}] * 3
        # a key lives as long as its latest entry, not the latest write
        assert 25_000 < await redis.pttl(keys.in_flight("k1")) <= 30_000
        await index.ended("prefill-a", ["k1", "k2", "k3"])
        await asyncio.sleep(0.45)
        assert await index.computing(["k1"]) == []
        assert not await redis.exists(keys.in_flight("k1"), keys.in_flight("k3"))
    finally:
        await redis.aclose()


def test_prefixes_count_leading_blocks_per_live_instance() -> None:
    rows = [{"a", "b", "dead"}, {"a", "b"}, {"a"}, {"b"}]
    assert in_flight_prefixes(rows, {"a", "b"}) == {"a": 3, "b": 2}
    assert in_flight_prefixes(rows, {"dead"}) == {"dead": 1}
    assert in_flight_prefixes(rows, set()) == {}
    assert in_flight_prefixes([], {"a"}) == {}
