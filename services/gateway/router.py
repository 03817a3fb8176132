"""Which prefill and which decode instance serve a request.

Live instances come from Redis membership, polled every ``refresh_s`` (half a
heartbeat), so a new replica takes traffic within one heartbeat interval and
a stopped one (deregistered) or a dead one (key expired) stops getting any.
An instance that refuses connections is benched locally for a few seconds
before its key expires. While Redis is down the last known set is kept
(degraded, not dead).

Prefill: join the shortest queue (Splitwise JSQ), counted in prompt tokens:
the instance's published ``pending_tokens`` plus what this gateway sent it
since. Decode: least loaded: published running + queued requests plus this
gateway's requests in flight there. Only instances of the gateway's model and
KV namespace qualify (a decode cannot read a prefill's KV otherwise).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import defaultdict
from dataclasses import dataclass

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from shared.cluster.keys import Keys
from shared.cluster.membership import Member, live_members
from shared.serving.errors import ServiceError

log = logging.getLogger(__name__)
ROLES = ("prefill", "decode", "colocated")
# what JSQ counts per role
LOAD_KEYS = {"prefill": "pending_tokens", "decode": "running", "colocated": "pending_tokens"}
BENCH_S = 5.0


@dataclass
class Pick:
    """One routing choice; ``done`` returns this gateway's share of the load."""

    member: Member
    cost: float
    router: Router

    @property
    def url(self) -> str:
        return self.member.http_url

    def done(self) -> None:
        if self.cost:
            self.router.local[self.member.instance_id] -= self.cost
            self.cost = 0.0


class Router:
    def __init__(self, redis: aioredis.Redis, keys: Keys, *, model: str, refresh_s: float):
        self.redis = redis
        self.keys = keys
        self.model = model
        self.refresh_s = refresh_s
        self.members: dict[str, list[Member]] = {r: [] for r in ROLES}
        self.local: defaultdict[str, float] = defaultdict(float)
        self.benched: dict[str, float] = {}
        self.redis_ok = False
        self.kv_namespace: str | None = None
        self._task: asyncio.Task[None] | None = None

    async def refresh(self) -> None:
        try:
            found = {r: await live_members(self.redis, self.keys, r) for r in ROLES}
        except (RedisError, OSError) as exc:
            if self.redis_ok:
                log.warning("Redis unreachable; routing to the last known instances: %s", exc)
            self.redis_ok = False
            return
        self.redis_ok = True
        for role, members in found.items():
            self.members[role] = [m for m in members if m.model == self.model]
        namespaces = {m.kv_namespace for ms in self.members.values() for m in ms}
        if len(namespaces) > 1:
            log.warning("workers disagree on the KV layout: %s", sorted(map(str, namespaces)))
        if self.members["prefill"]:
            self.kv_namespace = self.members["prefill"][0].kv_namespace

    async def _loop(self) -> None:
        while True:
            await self.refresh()
            await asyncio.sleep(self.refresh_s)

    async def start(self) -> None:
        await self.refresh()
        self._task = asyncio.create_task(self._loop(), name="router-refresh")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    def live(self, role: str) -> list[Member]:
        now = time.monotonic()
        out = [m for m in self.members[role] if self.benched.get(m.instance_id, 0.0) <= now]
        if role == "decode" and self.kv_namespace is not None:
            out = [m for m in out if m.kv_namespace == self.kv_namespace]
        return out

    def bench(self, member: Member) -> None:
        """Stop routing to ``member`` for a while (it refused a connection)."""
        self.benched[member.instance_id] = time.monotonic() + BENCH_S

    def score(self, member: Member, role: str) -> float:
        """Published load plus what this gateway sent there since."""
        return member.load.get(LOAD_KEYS[role], 0.0) + self.local[member.instance_id]

    def pick(self, role: str, cost: float, exclude: set[str] | None = None) -> Pick:
        """Prefill: fewest pending prompt tokens (JSQ), ``cost`` = this prompt's tokens.
        Decode: fewest running requests, ``cost`` = 1. Raises 503 when none is live."""
        excluded = exclude or set()
        members = [m for m in self.live(role) if m.instance_id not in excluded]
        if not members:
            raise ServiceError(
                503, f"no live {role} instance is available", code="no_live_instance"
            )
        best = min(members, key=lambda m: self.score(m, role))
        self.local[best.instance_id] += cost
        return Pick(best, float(cost), self)

    def queue_depths(self) -> dict[str, float]:
        out = {}
        for role, key in (
            ("prefill", "pending_tokens"),
            ("decode", "waiting_kv"),
            ("colocated", "pending_tokens"),
        ):
            out[role] = sum(m.load.get(key, 0.0) for m in self.members[role])
        return out
