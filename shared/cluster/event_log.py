"""The event log of resumable responses, in Redis, so that any gateway can continue one.

A resumable response (the Responses API, or a chat / completions stream opened with
``stream_options.resumable``) has

- a **record** (a hash): the request as received (what a new owner needs to
  rebuild it), its tenant, status, the last sequence number and the owner's epoch;
- its **events** (a stream): entry ``<n + 1>-0`` is event ``n`` (sequence numbers
  start at 0), so a reader resumes with one ``XREAD`` after ``starting_after``;
- the **token ids** those events carry (a list): a new owner replays them to
  rebuild the text state, then generates from there;
- a **lease** (``<owner>:<epoch>`` with a TTL the owner renews).

Ownership and safety: only the holder of a live lease whose epoch is the record's
may append (:meth:`EventLog.append` checks both inside one script, so an owner that
lost its lease, e.g. paused past the TTL while another took over, appends nothing:
fencing). An event is appended before any client is sent it, so every event a
client saw is in the log. A taker (:meth:`EventLog.take_over`) gets the lease once it
has expired, or at once from an owner it found gone (its address, in the record,
refuses connections: a killed gateway), and bumps the epoch either way. Every key
expires ``retention_s`` after the last append; a log longer than ``max_events``
refuses more (its response goes on for the client attached, without resumption).
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import redis.asyncio as aioredis

from shared.cluster.keys import Keys
from shared.errors import BatonError

IN_PROGRESS = "in_progress"

# KEYS: record, events, tokens, lease.
# ARGV: lease value, epoch, data, token ids (comma-separated), max events, retention ms,
# status to set ("" none), the generation's finish reason ("" none), the sequence
# number the event must get (a retry of an append that landed returns it again), the
# prompt tokens whose KV was reused ("" not known yet)
_APPEND = """
if redis.call('GET', KEYS[4]) ~= ARGV[1] then return -1 end
if redis.call('HGET', KEYS[1], 'epoch') ~= ARGV[2] then return -1 end
local seq = tonumber(redis.call('HGET', KEYS[1], 'seq')) + 1
local want = tonumber(ARGV[9])
if want < seq then return want end
if want > seq then return -3 end
if seq >= tonumber(ARGV[5]) then
  redis.call('HSET', KEYS[1], 'truncated', 1)
  return -2
end
redis.call('XADD', KEYS[2], (seq + 1) .. '-0', 'd', ARGV[3], 's', ARGV[7])
redis.call('HSET', KEYS[1], 'seq', seq)
if ARGV[8] ~= '' then redis.call('HSET', KEYS[1], 'finish', ARGV[8]) end
if ARGV[10] ~= '' then redis.call('HSET', KEYS[1], 'cached', ARGV[10]) end
for id in string.gmatch(ARGV[4], '[^,]+') do redis.call('RPUSH', KEYS[3], id) end
if ARGV[7] ~= '' then
  redis.call('HSET', KEYS[1], 'status', ARGV[7])
  redis.call('DEL', KEYS[4])
end
for i = 1, 3 do redis.call('PEXPIRE', KEYS[i], ARGV[6]) end
return seq
"""

# KEYS: record, lease. ARGV: owner, lease ms, owner's address, the lease value that may
# be replaced ("": none, the lease must have expired). -> new epoch; 0: held by another
# or finished; -1: no such response
_TAKE = """
if redis.call('EXISTS', KEYS[1]) == 0 then return -1 end
local held = redis.call('GET', KEYS[2])
if held and held ~= ARGV[4] then return 0 end
if redis.call('HGET', KEYS[1], 'status') ~= 'in_progress' then return 0 end
local epoch = redis.call('HINCRBY', KEYS[1], 'epoch', 1)
redis.call('SET', KEYS[2], ARGV[1] .. ':' .. epoch, 'PX', ARGV[2])
redis.call('HSET', KEYS[1], 'owner', ARGV[1], 'owner_url', ARGV[3])
return epoch
"""

# KEYS: record, lease. ARGV: lease value, lease ms. -> 1 held (cancel asked: 2); 0 lost
_RENEW = """
if redis.call('GET', KEYS[2]) ~= ARGV[1] then return 0 end
redis.call('PEXPIRE', KEYS[2], ARGV[2])
if redis.call('HGET', KEYS[1], 'cancel') == '1' then return 2 end
return 1
"""


# KEYS: lease. ARGV: lease value. Deletes it only while it is this owner's.
_RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then redis.call('DEL', KEYS[1]) end
return 0
"""


class EventLogError(BatonError):
    """The log refused an append."""


class LeaseLostError(EventLogError):
    """This owner's lease expired or another owner took the response over (fenced)."""


class LogFullError(EventLogError):
    """The response has more events than the log keeps; it can no longer be resumed."""


@dataclass(frozen=True)
class Lease:
    response_id: str
    owner: str
    epoch: int

    @property
    def value(self) -> str:
        return f"{self.owner}:{self.epoch}"


@dataclass(frozen=True)
class ResponseRecord:
    response_id: str
    tenant: str  # "" when the gateway takes no API keys
    status: str
    last_seq: int  # -1: no event yet
    owner: str
    epoch: int
    owner_url: str  # where the owner serves ("": unknown), to tell it is gone
    cancel_requested: bool
    request: dict[str, Any]  # what the owner needs to rebuild the response
    finish: str | None  # why generation ended, once the event with its last token is in
    truncated: bool  # the log refused events past its cap: it ends before the response
    cached_tokens: int | None = None  # prompt tokens whose KV was reused, once known

    @property
    def finished(self) -> bool:
        return self.status != IN_PROGRESS

    @property
    def lease(self) -> Lease:
        """The lease its owner holds (or held)."""
        return Lease(self.response_id, self.owner, self.epoch)


@dataclass(frozen=True)
class LoggedEvent:
    seq: int
    data: str
    status: str | None = None  # set on the response's last event: how it ended


class EventLog:
    """Long-lived (one per gateway); every method is one or two Redis round trips."""

    def __init__(
        self,
        redis: aioredis.Redis,
        keys: Keys,
        *,
        retention_s: float = 600.0,
        max_events: int = 100_000,
        lease_s: float = 3.0,
    ):
        self.redis = redis
        self.keys = keys
        self.retention_ms = int(retention_s * 1000)
        self.max_events = max_events
        self.lease_ms = int(lease_s * 1000)
        self._append = redis.register_script(_APPEND)
        self._take = redis.register_script(_TAKE)
        self._renew = redis.register_script(_RENEW)
        self._release = redis.register_script(_RELEASE)

    def _keys(self, rid: str) -> list[str]:
        k = self.keys
        return [
            k.response(rid),
            k.response_events(rid),
            k.response_tokens(rid),
            k.response_lease(rid),
        ]

    async def create(
        self,
        response_id: str,
        owner: str,
        tenant: str | None,
        request: dict[str, Any],
        owner_url: str = "",
    ) -> Lease:
        """A new response owned by ``owner`` (epoch 1), which serves at ``owner_url``."""
        record, _, _, lease_key = self._keys(response_id)
        lease = Lease(response_id, owner, 1)
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.hset(
                record,
                mapping={
                    "tenant": tenant or "",
                    "status": IN_PROGRESS,
                    "seq": -1,
                    "owner": owner,
                    "owner_url": owner_url,
                    "epoch": 1,
                    "cancel": 0,
                    "created": time.time(),
                    "request": json.dumps(request),
                },
            )
            pipe.pexpire(record, self.retention_ms)
            pipe.set(lease_key, lease.value, px=self.lease_ms)
            await pipe.execute()
        return lease

    async def append(
        self,
        lease: Lease,
        seq: int,
        data: str,
        tokens: Sequence[int] = (),
        status: str | None = None,
        finish: str | None = None,
        cached_tokens: int | None = None,
    ) -> int:
        """Event ``data`` (carrying ``tokens``) as sequence number ``seq``, the next one
        (the owner, sole writer, knows it); appending it again after a lost reply
        changes nothing (safe to retry). ``status``: the response ends with it (the
        lease is released); ``finish``: its last token is among ``tokens``, and
        generation ended so; ``cached_tokens``: the prompt tokens whose KV was reused
        (what a take-over reports). Returns ``seq``."""
        answer = int(
            await self._append(
                keys=self._keys(lease.response_id),
                args=[
                    lease.value,
                    lease.epoch,
                    data,
                    ",".join(str(t) for t in tokens),
                    self.max_events,
                    self.retention_ms,
                    status or "",
                    finish or "",
                    seq,
                    "" if cached_tokens is None else cached_tokens,
                ],
            )
        )
        if answer == -1:
            raise LeaseLostError(f"lease on {lease.response_id} lost (epoch {lease.epoch})")
        if answer == -2:
            raise LogFullError(f"{lease.response_id} has {self.max_events} events logged")
        if answer == -3:
            raise EventLogError(f"{lease.response_id}: an event before this one is missing")
        return answer

    async def renew(self, lease: Lease) -> bool:
        """Extends the lease; True when a cancel was asked for. Raises
        :class:`LeaseLostError` when it is no longer held."""
        answer = int(
            await self._renew(
                keys=[
                    self.keys.response(lease.response_id),
                    self.keys.response_lease(lease.response_id),
                ],
                args=[lease.value, self.lease_ms],
            )
        )
        if answer == 0:
            raise LeaseLostError(f"lease on {lease.response_id} lost (epoch {lease.epoch})")
        return answer == 2

    async def take_over(
        self, response_id: str, owner: str, owner_url: str = "", *, gone: Lease | None = None
    ) -> Lease | None:
        """The lease of an unfinished response, for ``owner`` (serving at ``owner_url``):
        when its holder's has expired, or while it is still ``gone``'s (an owner the
        caller found dead; its appends are fenced off by the new epoch)."""
        epoch = int(
            await self._take(
                keys=[self.keys.response(response_id), self.keys.response_lease(response_id)],
                args=[owner, self.lease_ms, owner_url, gone.value if gone is not None else ""],
            )
        )
        return Lease(response_id, owner, epoch) if epoch > 0 else None

    async def release(self, lease: Lease) -> None:
        """Gives the lease up at once (a draining gateway: a follower takes over now)."""
        await self._release(keys=[self.keys.response_lease(lease.response_id)], args=[lease.value])

    async def held(self, response_id: str) -> bool:
        """Whether some owner's lease is live."""
        return bool(await self.redis.exists(self.keys.response_lease(response_id)))

    async def record(self, response_id: str) -> ResponseRecord | None:
        raw: Any = await self.redis.hgetall(self.keys.response(response_id))
        if not raw:
            return None
        f = {k.decode(): v.decode() for k, v in raw.items()}
        return ResponseRecord(
            response_id=response_id,
            tenant=f.get("tenant", ""),
            status=f.get("status", IN_PROGRESS),
            last_seq=int(f.get("seq", -1)),
            owner=f.get("owner", ""),
            epoch=int(f.get("epoch", 0)),
            owner_url=f.get("owner_url", ""),
            cancel_requested=f.get("cancel") == "1",
            request=json.loads(f.get("request", "{}")),
            finish=f.get("finish") or None,
            truncated=f.get("truncated") == "1",
            cached_tokens=int(f["cached"]) if "cached" in f else None,
        )

    async def first_seq(self, response_id: str) -> int | None:
        """The oldest sequence number still kept (None: no event)."""
        first: Any = await self.redis.xrange(self.keys.response_events(response_id), count=1)
        return None if not first else _seq(first[0][0])

    async def read(
        self, response_id: str, after: int, *, block_ms: int | None = None, count: int = 256
    ) -> list[LoggedEvent]:
        """Events after sequence number ``after`` (-1: from the first), waiting up to
        ``block_ms`` for one when there is none yet (None: not at all)."""
        key = self.keys.response_events(response_id)
        answer: Any = await self.redis.xread({key: f"{after + 1}-0"}, count=count, block=block_ms)
        if not answer:
            return []
        return [
            LoggedEvent(_seq(eid), fields[b"d"].decode(), fields.get(b"s", b"").decode() or None)
            for eid, fields in answer[0][1]
        ]

    async def tokens(self, response_id: str) -> list[int]:
        return [
            int(t) for t in await self.redis.lrange(self.keys.response_tokens(response_id), 0, -1)
        ]

    async def cancel(self, response_id: str) -> None:
        """Asks the owner to stop (it sees it when it next renews its lease)."""
        await self.redis.hset(self.keys.response(response_id), "cancel", 1)

    async def delete(self, response_id: str) -> None:
        await self.redis.delete(*self._keys(response_id))


def _seq(entry_id: bytes) -> int:
    return int(entry_id.split(b"-", 1)[0]) - 1
