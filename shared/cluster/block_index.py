"""The global prompt index: block key -> the instances that hold that block.

Two kinds of Redis sets, kept in step by Lua scripts (each call atomic, so a
reader never sees half of a batch): ``block:<key>`` holds the ids of the
instances holding the block (KV store nodes, and prefill/decode instances for
their local pools), ``holds:<instance>`` the keys one instance holds, so all
of an instance's entries can be cleared when it starts, stops or is declared
dead. Entries follow holdings: added on store commit and on local caching,
removed on eviction. A TTL, refreshed while the holder lives, is only a
backstop; readers also filter holders by live membership. A stale entry costs
a failed lease and a recompute, never a wrong token.

:class:`IndexPublisher` is the writer side for one instance: it mirrors what
the instance holds, coalesces changes and flushes them in the background;
when Redis was unreachable, or the instance was declared dead meanwhile, it
republishes everything it holds.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Iterable, Sequence

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from shared.cluster.keys import Keys

log = logging.getLogger(__name__)
FLUSH_INTERVAL_S = 0.02
WINDOW_ENTRY = "w"  # see window_entry
BATCH = 2048


def window_entry(block_id: str) -> str:
    """The index entry saying a holder of ``block_id`` also keeps its sliding-window
    layers (a pool split by layer groups keeps them only while some window reads the
    block, or until their memory is reused): a prefix is reusable there as far as the
    blocks its next row's window reads have this entry too."""
    return WINDOW_ENTRY + block_id


# KEYS: the instance's holds set, the holders set. ARGV: block key prefix, instance id,
# ttl ms, keys...
_ADD = """
for i = 4, #ARGV do
  local key = ARGV[1] .. ARGV[i]
  redis.call('SADD', key, ARGV[2])
  redis.call('PEXPIRE', key, ARGV[3])
  redis.call('SADD', KEYS[1], ARGV[i])
end
redis.call('PEXPIRE', KEYS[1], ARGV[3])
redis.call('SADD', KEYS[2], ARGV[2])
return #ARGV - 3
"""
# KEYS: the instance's holds set. ARGV: block key prefix, instance id, keys...
_REMOVE = """
for i = 3, #ARGV do
  redis.call('SREM', ARGV[1] .. ARGV[i], ARGV[2])
  redis.call('SREM', KEYS[1], ARGV[i])
end
return #ARGV - 2
"""
# KEYS: the instance's holds set, the holders set. ARGV: block key prefix, instance id,
# batch size. Removes up to one batch of the instance's entries; returns how many.
_CLEAR = """
local keys = redis.call('SPOP', KEYS[1], ARGV[3])
for _, k in ipairs(keys) do
  redis.call('SREM', ARGV[1] .. k, ARGV[2])
end
if redis.call('SCARD', KEYS[1]) == 0 then
  redis.call('SREM', KEYS[2], ARGV[2])
end
return #keys
"""
# ARGV: block key prefix, keys... The holders of each leading key, up to the first that
# none holds (no prefix reaches past it): one round trip, and one key for a cold prompt.
_PREFIX = """
local rows = {}
for i = 2, #ARGV do
  local holders = redis.call('SMEMBERS', ARGV[1] .. ARGV[i])
  if #holders == 0 then
    break
  end
  rows[#rows + 1] = holders
end
return rows
"""


class BlockIndex:
    def __init__(self, redis: aioredis.Redis, keys: Keys, ttl_s: float):
        self.redis = redis
        self.keys = keys
        self.ttl_ms = int(ttl_s * 1000)
        self._add = redis.register_script(_ADD)
        self._remove = redis.register_script(_REMOVE)
        self._clear = redis.register_script(_CLEAR)
        self._prefix = redis.register_script(_PREFIX)

    async def add(self, instance_id: str, ids: Sequence[str]) -> None:
        holds = self.keys.holds(instance_id)
        for start in range(0, len(ids), BATCH):
            batch = ids[start : start + BATCH]
            await self._add(
                keys=[holds, self.keys.holders()],
                args=[self.keys.block(""), instance_id, self.ttl_ms, *batch],
            )

    async def remove(self, instance_id: str, ids: Sequence[str]) -> None:
        holds = self.keys.holds(instance_id)
        for start in range(0, len(ids), BATCH):
            batch = ids[start : start + BATCH]
            await self._remove(keys=[holds], args=[self.keys.block(""), instance_id, *batch])

    async def clear(self, instance_id: str) -> int:
        """Remove every entry of ``instance_id``; returns how many there were."""
        holds = self.keys.holds(instance_id)
        total = 0
        while True:
            n = int(
                await self._clear(
                    keys=[holds, self.keys.holders()],
                    args=[self.keys.block(""), instance_id, BATCH],
                )
            )
            total += n
            if n < BATCH:
                return total

    async def instances(self) -> set[str]:
        """Every instance that has entries (live or not). To find the dead, read
        membership after this: an instance registers before it publishes."""
        return {
            m.decode() if isinstance(m, bytes) else str(m)
            for m in await self.redis.smembers(self.keys.holders())
        }

    async def holders(self, ids: Sequence[str]) -> list[set[str]]:
        if not ids:
            return []
        async with self.redis.pipeline(transaction=False) as pipe:
            for block_id in ids:
                pipe.smembers(self.keys.block(block_id))
            rows = await pipe.execute()
        return [{m.decode() if isinstance(m, bytes) else m for m in row} for row in rows]

    async def prefix_holders(self, ids: Sequence[str]) -> list[set[str]]:
        """:meth:`holders` of the leading ``ids`` up to the first that no instance holds."""
        if not ids:
            return []
        rows = await self._prefix(args=[self.keys.block(""), *ids])
        return [{m.decode() if isinstance(m, bytes) else m for m in row} for row in rows]

    async def longest_prefix(self, ids: Sequence[str], live: set[str] | None = None) -> int:
        """How many leading ids some (live) instance holds (not necessarily one instance:
        a store client reads each block from whichever node holds it)."""
        hits = 0
        for holders in await self.prefix_holders(ids):
            if live is not None:
                holders &= live
            if not holders:
                break
            hits += 1
        return hits


class IndexPublisher:
    """Background, coalescing writer of one instance's index entries."""

    def __init__(self, index: BlockIndex, instance_id: str, refresh_s: float | None = None):
        self.index = index
        self.instance_id = instance_id
        # re-add everything held this often, so the TTL only ends entries of the dead
        self.refresh_s = refresh_s if refresh_s is not None else index.ttl_ms / 3000
        self._held: set[str] = set()
        self._add: set[str] = set()
        self._remove: set[str] = set()
        self._resync = False
        self._wake = asyncio.Event()
        self._idle = asyncio.Event()
        self._idle.set()
        self._task: asyncio.Task[None] | None = None
        self._flushing = asyncio.Lock()

    @property
    def held(self) -> set[str]:
        return set(self._held)

    def added(self, ids: Iterable[str]) -> None:
        ids = set(ids)
        self._held |= ids
        self._add |= ids
        self._remove -= ids
        self._kick()

    def removed(self, ids: Iterable[str]) -> None:
        ids = set(ids)
        self._held -= ids
        self._remove |= ids
        self._add -= ids
        self._kick()

    def resync(self) -> None:
        """Republish everything held (after Redis came back, or the instance was declared
        dead and its entries cleared while it lived)."""
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
            self._add = set(self._held)
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
        loop = asyncio.get_running_loop()
        next_refresh = loop.time() + self.refresh_s
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), max(0.0, next_refresh - loop.time()))
            if loop.time() >= next_refresh:
                self._resync = True
                next_refresh = loop.time() + self.refresh_s
            self._wake.clear()
            if await self.flush() and not (self._add or self._remove or self._resync):
                self._idle.set()
                await asyncio.sleep(FLUSH_INTERVAL_S)  # coalesce bursts of commits
            else:
                await asyncio.sleep(0.5)
                self._wake.set()

    async def wait_idle(self) -> None:
        await self._idle.wait()

    async def start(self) -> None:
        """Clear what an earlier process of this instance id left, then publish."""
        try:
            await self.index.clear(self.instance_id)
        except (RedisError, OSError) as exc:
            log.warning("could not clear old index entries of %s: %s", self.instance_id, exc)
        self._task = asyncio.create_task(self._loop(), name="index-publisher")

    async def stop(self, *, withdraw: bool) -> None:
        """Stop; with ``withdraw`` remove every entry this instance published."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        if withdraw:
            self._add.clear()
            self._remove.clear()
            try:
                await self.index.clear(self.instance_id)
            except (RedisError, OSError) as exc:
                log.warning("could not withdraw the index entries of %s: %s", self.instance_id, exc)
