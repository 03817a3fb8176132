"""Membership: each instance keeps a TTL'd key with its role, addresses and load.

An expired key is a dead instance; no static host lists. Redis being down is
degraded, not fatal: the heartbeat keeps trying and re-registers (and asks the
owner to resync whatever else it publishes) once Redis answers again.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import time
from collections.abc import Awaitable, Callable

import redis.asyncio as aioredis
from pydantic import BaseModel, ConfigDict, ValidationError
from redis.exceptions import RedisError

from shared.cluster.keys import Keys
from shared.config import ClusterConfig

log = logging.getLogger(__name__)


def default_advertise_host() -> str:
    """This host's address as others reach it: under compose, the container's own IP
    (so scaled replicas each register their own address, no static host lists)."""
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"


Endpoint = tuple[str, int, int | None, str | None, float]  # where, and which process


class Member(BaseModel):
    model_config = ConfigDict(frozen=True, extra="ignore")

    instance_id: str
    role: str
    host: str
    http_port: int
    data_port: int | None = None
    transport: str | None = None
    capacity_bytes: int | None = None
    model: str | None = None  # served model name (prefill/decode)
    dtype: str | None = None  # compute dtype (prefill/decode)
    kv_namespace: str | None = None  # model identity + KV layout: workers pair only when equal
    block_size: int | None = None  # tokens per KV block (the gateway computes block keys)
    # tokens the sliding layers read back, where the pool keeps only their window's KV
    # (its prompt index entries say which blocks still have it: see window_entry)
    kv_window: int | None = None
    load: dict[str, float] = {}
    started_at: float = 0.0
    heartbeat_at: float = 0.0  # wall clock of the record's last refresh

    @property
    def http_url(self) -> str:
        return f"http://{self.host}:{self.http_port}"

    @property
    def endpoint(self) -> Endpoint:
        """Where and which process this member is: equal across heartbeats of one process
        (unlike ``load``), different once it restarts."""
        return (self.host, self.http_port, self.data_port, self.transport, self.started_at)


async def live_members(redis: aioredis.Redis, keys: Keys, role: str) -> list[Member]:
    """Every instance of ``role`` whose heartbeat key has not expired, by instance id.
    Costs one round trip for the role's id set and one for the keys, however many
    other keys Redis holds; ids whose key expired are pruned from the set."""
    ids = sorted(
        m.decode() if isinstance(m, bytes) else str(m)
        for m in await redis.smembers(keys.members(role))
    )
    if not ids:
        return []
    members = []
    dead = []
    for instance_id, raw in zip(
        ids, await redis.mget([keys.member(role, i) for i in ids]), strict=True
    ):
        if raw is None:
            dead.append(instance_id)
            continue
        try:
            members.append(Member.model_validate_json(raw))
        except ValidationError:
            log.warning("ignoring a malformed membership record")
    if dead:
        await redis.srem(keys.members(role), *dead)
    return members


class LastKnown:
    """The members of one role as last seen, bridging a registry that lost its state.

    Redis restarted empty reads as every instance gone at once, until each one's next
    heartbeat re-registers it. A role whose registry turns empty therefore keeps its
    last known members until it has read empty for ``grace_s`` (the member TTL: no
    longer than a killed instance's key outlives it; a dead one among them fails at
    the transport, as it would before its key expired). The grace counts from the
    first empty read, not from the last full one, so an outage while Redis was
    unreachable does not use it up. A non-empty registry replaces the view at once,
    so a drained instance that deregistered leaves it on the next read."""

    def __init__(self, grace_s: float, clock: Callable[[], float] = time.monotonic):
        self.grace_s = grace_s
        self.clock = clock
        self.members: list[Member] = []
        self._empty_since: float | None = None  # the first empty read while bridging

    def update(self, members: list[Member]) -> list[Member]:
        if members:
            self.members, self._empty_since = members, None
        elif self.members:
            now = self.clock()
            if self._empty_since is None:
                self._empty_since = now
            if now - self._empty_since >= self.grace_s:
                self.members, self._empty_since = [], None
        return self.members


class Heartbeat:
    """Registers ``member`` and refreshes it every ``interval_s`` until stopped."""

    def __init__(
        self,
        redis: aioredis.Redis,
        keys: Keys,
        member: Member,
        *,
        interval_s: float,
        ttl_s: float,
        load: Callable[[], dict[str, float]] = dict,
        on_reconnect: Callable[[], Awaitable[None]] | None = None,
    ):
        self.redis = redis
        self.key = keys.member(member.role, member.instance_id)
        self.role_set = keys.members(member.role)
        self.member = member
        self.interval_s = interval_s
        self.ttl_ms = int(ttl_s * 1000)
        self.load = load
        self.on_reconnect = on_reconnect
        self.healthy = False
        self._task: asyncio.Task[None] | None = None

    @classmethod
    def for_cluster(
        cls,
        redis: aioredis.Redis,
        cluster: ClusterConfig,
        member: Member,
        *,
        load: Callable[[], dict[str, float]] = dict,
        on_reconnect: Callable[[], Awaitable[None]] | None = None,
    ) -> Heartbeat:
        """The heartbeat with the cluster's key prefix, interval and TTL."""
        return cls(
            redis,
            Keys(cluster.redis_prefix),
            member,
            interval_s=cluster.heartbeat_s,
            ttl_s=cluster.member_ttl_s,
            load=load,
            on_reconnect=on_reconnect,
        )

    async def beat(self) -> bool:
        """Refresh the key. If Redis was unreachable, or the key had expired (a stall
        long enough for others to declare this instance dead and clear its index
        entries), ``on_reconnect`` runs so the owner republishes what it holds."""
        record = self.member.model_copy(update={"load": self.load(), "heartbeat_at": time.time()})
        try:
            async with self.redis.pipeline(transaction=True) as pipe:
                pipe.set(self.key, record.model_dump_json(), px=self.ttl_ms, get=True)
                pipe.sadd(self.role_set, self.member.instance_id)
                previous, _ = await pipe.execute()
        except (RedisError, OSError) as exc:
            if self.healthy:
                log.warning("Redis unreachable, running degraded: %s", exc)
            self.healthy = False
            return False
        lost = self.healthy and previous is None
        if lost:
            log.warning("membership key %s had expired; re-registered", self.key)
        if (lost or not self.healthy) and self.on_reconnect is not None:
            await self.on_reconnect()
        self.healthy = True
        return True

    async def _loop(self) -> None:
        while True:
            started = time.monotonic()
            await self.beat()
            await asyncio.sleep(max(0.0, self.interval_s - (time.monotonic() - started)))

    def start(self) -> None:
        self._task = asyncio.create_task(self._loop(), name=f"heartbeat:{self.key}")

    async def stop(self, *, deregister: bool = True) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        if deregister:
            try:
                async with self.redis.pipeline(transaction=True) as pipe:
                    pipe.delete(self.key)
                    pipe.srem(self.role_set, self.member.instance_id)
                    await pipe.execute()
            except (RedisError, OSError) as exc:
                log.warning("could not deregister %s: %s", self.key, exc)
