"""The global prompt index: block id -> the instances that hold it.

One Redis set per block id (members = instance ids), with a TTL refreshed on
every registration. A batch is one Lua script call, atomic, so a reader never
sees half of a batch. Readers filter holders by live membership,
so a crashed instance's entries are ignored until their TTL removes them.

:class:`IndexPublisher` is the writer side for one instance: it coalesces
added/removed ids and flushes them in the background; when Redis was
unreachable it republishes everything the instance holds once Redis is back.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Sequence

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from shared.cluster.keys import Keys

log = logging.getLogger(__name__)
FLUSH_INTERVAL_S = 0.02
BATCH = 2048
# ARGV: key prefix, instance id, ttl ms, block ids...
_ADD = """
for i = 4, #ARGV do
  local key = ARGV[1] .. ARGV[i]
  redis.call('SADD', key, ARGV[2])
  redis.call('PEXPIRE', key, ARGV[3])
end
return #ARGV - 3
"""
# ARGV: key prefix, instance id, block ids...
_REMOVE = """
for i = 3, #ARGV do
  redis.call('SREM', ARGV[1] .. ARGV[i], ARGV[2])
end
return #ARGV - 2
"""


class BlockIndex:
    def __init__(self, redis: aioredis.Redis, keys: Keys, ttl_s: float):
        self.redis = redis
        self.keys = keys
        self.ttl_ms = int(ttl_s * 1000)
        # One atomic script call per batch instead of two commands per block:
        # commits are acknowledged only once indexed, so this is on the put path.
        self._add = redis.register_script(_ADD)
        self._remove = redis.register_script(_REMOVE)

    async def add(self, instance_id: str, ids: Sequence[str]) -> None:
        for start in range(0, len(ids), BATCH):
            batch = ids[start : start + BATCH]
            await self._add(args=[self.keys.block(""), instance_id, self.ttl_ms, *batch])

    async def remove(self, instance_id: str, ids: Sequence[str]) -> None:
        for start in range(0, len(ids), BATCH):
            batch = ids[start : start + BATCH]
            await self._remove(args=[self.keys.block(""), instance_id, *batch])

    async def holders(self, ids: Sequence[str]) -> list[set[str]]:
        if not ids:
            return []
        async with self.redis.pipeline(transaction=False) as pipe:
            for block_id in ids:
                pipe.smembers(self.keys.block(block_id))
            rows = await pipe.execute()
        return [{m.decode() if isinstance(m, bytes) else m for m in row} for row in rows]

    async def longest_prefix(self, ids: Sequence[str], live: set[str] | None = None) -> int:
        """How many leading ids some (live) instance holds."""
        hits = 0
        for holders in await self.holders(ids):
            if live is not None:
                holders &= live
            if not holders:
                break
            hits += 1
        return hits


class IndexPublisher:
    """Background, coalescing writer of one instance's index entries."""

    def __init__(self, index: BlockIndex, instance_id: str, held: Callable[[], list[str]]):
        self.index = index
        self.instance_id = instance_id
        self.held = held
        self._add: set[str] = set()
        self._remove: set[str] = set()
        self._resync = False
        self._wake = asyncio.Event()
        self._idle = asyncio.Event()
        self._idle.set()
        self._task: asyncio.Task[None] | None = None
        self._flushing = asyncio.Lock()

    def added(self, ids: Sequence[str]) -> None:
        self._add.update(ids)
        self._remove.difference_update(ids)
        self._kick()

    def removed(self, ids: Sequence[str]) -> None:
        self._remove.update(ids)
        self._add.difference_update(ids)
        self._kick()

    def resync(self) -> None:
        """Republish everything held (after Redis came back)."""
        self._resync = True
        self._kick()

    def _kick(self) -> None:
        self._idle.clear()
        self._wake.set()

    async def flush(self) -> bool:
        """Push pending changes now; False (and kept pending) when Redis is down.

        Serialised: when it returns, every change recorded before the call is
        in Redis (or Redis was unreachable), including ones a concurrent flush
        had already picked up.
        """
        async with self._flushing:
            return await self._flush()

    async def _flush(self) -> bool:
        if self._resync:
            self._add = set(self.held())
            self._resync = False
        add, remove = sorted(self._add), sorted(self._remove)
        self._add.clear()
        self._remove.clear()
        try:
            if remove:
                await self.index.remove(self.instance_id, remove)
            if add:
                await self.index.add(self.instance_id, add)
        except (RedisError, OSError) as exc:
            log.warning("index update failed (%s); will resync when Redis is back", exc)
            self._resync = True
            self._remove.update(remove)
            return False
        return True

    async def _loop(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            if await self.flush() and not (self._add or self._remove or self._resync):
                self._idle.set()
                await asyncio.sleep(FLUSH_INTERVAL_S)  # coalesce bursts of commits
            else:
                await asyncio.sleep(0.5)
                self._wake.set()

    async def wait_idle(self) -> None:
        await self._idle.wait()

    def start(self) -> None:
        self._task = asyncio.create_task(self._loop(), name="index-publisher")

    async def stop(self, *, withdraw: bool) -> None:
        """Stop; with ``withdraw`` remove every entry this instance published."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        if withdraw:
            self._add.clear()
            self._remove.update(self.held())
            await self.flush()
