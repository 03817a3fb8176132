"""The services' Redis client survives a Redis restart: a command on a stale pooled
connection is sent again on it reconnected, rather than failing a request."""

from __future__ import annotations

import asyncio
import time

import pytest
from redis.exceptions import ConnectionError as RedisConnectionError

from shared.cluster.redis_client import connect
from shared.procs import RedisProcess, free_port


async def test_every_pooled_connection_works_again_after_a_restart() -> None:
    server = RedisProcess().start()
    try:
        client = connect(server.url)
        # several connections in the pool, as a busy gateway has
        await asyncio.gather(*(client.set(f"k{i}", i) for i in range(8)))
        assert server.proc is not None
        server.proc.kill()
        server.proc.wait()
        server.start()  # same port, empty
        results = await asyncio.gather(*(client.set(f"k{i}", i) for i in range(8)))
        assert all(results)
        await client.aclose()
    finally:
        server.stop()


async def test_a_redis_that_is_down_still_fails_at_once() -> None:
    client = connect(f"redis://127.0.0.1:{free_port()}/0")
    t0 = time.monotonic()
    with pytest.raises(RedisConnectionError):
        await client.get("k")
    assert time.monotonic() - t0 < 1.0
    await client.aclose()
