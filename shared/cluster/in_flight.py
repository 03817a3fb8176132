"""Prompts being computed, shared by every gateway: block key -> the prompt-serving
instances that will hold that block once a prompt routed there is computed.

A gateway routes a prompt where most of it is cached: in an instance's pool, in the
store, or about to be (a prompt with the same prefix is computing there, and the
instance waits for those blocks rather than computing a copy). The first two are in
the prompt index (:mod:`shared.cluster.block_index`); this is the third, so that a
prompt reaching another gateway is routed as the first gateway would route it.

``inflight:<block>`` is a sorted set of instance ids scored by when each entry lapses,
in Redis' own clock (the scripts read ``TIME``, so gateways' clocks need not agree).
A routed prompt's blocks are entered for ``computing_s`` and, once the prompt ends,
for ``grace_s`` more (its blocks reach the index within a publish interval). Readers
take only unlapsed entries; the key expires with its last entry. An entry is a hint:
a wrong one costs a prompt routed to a busier instance, never a wrong token.
"""

from __future__ import annotations

from collections.abc import Sequence

import redis.asyncio as aioredis

from shared.cluster.keys import Keys

# ARGV: key prefix, instance id, ms the entries live, block ids... Each key expires when
# its latest entry lapses.
_MARK = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local lapse = now + tonumber(ARGV[3])
for i = 4, #ARGV do
  local key = ARGV[1] .. ARGV[i]
  redis.call('ZADD', key, lapse, ARGV[2])
  redis.call('ZREMRANGEBYSCORE', key, '-inf', now)
  local last = redis.call('ZRANGE', key, -1, -1, 'WITHSCORES')
  redis.call('PEXPIREAT', key, last[2])
end
return #ARGV - 3
"""
# ARGV: key prefix, block ids... The unlapsed entries of each block, up to the first
# block no instance is computing (a longer prefix cannot run through it).
_READ = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local out = {}
for i = 2, #ARGV do
  local row = redis.call('ZRANGEBYSCORE', ARGV[1] .. ARGV[i], '(' .. now, '+inf')
  if #row == 0 then
    break
  end
  out[#out + 1] = row
end
return out
"""
COMPUTING_S = 60.0  # an entry outlives a prompt's compute, however queued; ended early
GRACE_S = 2.0  # after the prompt ends, until its blocks are in the prompt index


class InFlightIndex:
    def __init__(
        self,
        redis: aioredis.Redis,
        keys: Keys,
        *,
        computing_s: float = COMPUTING_S,
        grace_s: float = GRACE_S,
    ):
        self.keys = keys
        self.computing_ms = int(computing_s * 1000)
        self.grace_ms = int(grace_s * 1000)
        self._mark = redis.register_script(_MARK)
        self._read = redis.register_script(_READ)

    async def started(self, instance_id: str, ids: Sequence[str]) -> None:
        """A prompt with these blocks was routed to ``instance_id``."""
        await self._set(instance_id, ids, self.computing_ms)

    async def ended(self, instance_id: str, ids: Sequence[str]) -> None:
        """That prompt ended (computed, failed or cancelled): its entries lapse soon."""
        await self._set(instance_id, ids, self.grace_ms)

    async def _set(self, instance_id: str, ids: Sequence[str], ms: int) -> None:
        if ids:
            await self._mark(args=[self.keys.in_flight(""), instance_id, ms, *ids])

    async def computing(self, ids: Sequence[str]) -> list[set[str]]:
        """Per leading block, the instances computing it, up to the first block none is."""
        if not ids:
            return []
        rows = await self._read(args=[self.keys.in_flight(""), *ids])
        return [{m.decode() if isinstance(m, bytes) else str(m) for m in row} for row in rows]


def in_flight_prefixes(rows: Sequence[set[str]], live: set[str]) -> dict[str, int]:
    """Per live instance, how many leading blocks it is computing."""
    out: dict[str, int] = {}
    running: set[str] | None = None
    for pos, row in enumerate(rows):
        running = (row & live) if running is None else running & row
        if not running:
            break
        for instance_id in running:
            out[instance_id] = pos + 1
    return out
