"""Which prefill and which decode instance serve a request.

Live instances come from Redis membership, polled every ``refresh_s`` (half a
heartbeat), so a new replica takes traffic within one heartbeat interval and
a stopped one (deregistered) or a dead one (key expired) stops getting any.
An instance that refuses connections is benched locally for a few seconds
before its key expires. While Redis is down the last known set is kept
(degraded, not dead), and so it is for a member TTL after Redis comes back
empty, until the instances' heartbeats re-register them. Every ``reap_s``
the router also clears the prompt index entries of instances that are no
longer live.

Prefill: the lowest estimated cost, counted in prompt tokens: the instance's
queued work (its published ``pending_tokens`` plus what this gateway sent it
since) plus the prompt tokens it would have to compute (those neither in its
own pool nor in the store), plus a small charge for tokens it would pull from
the store. Only instances whose queued work is within ``balance_tokens`` of
the least loaded one compete, so one hot prefix cannot pile everything on one
instance (Splitwise JSQ, with cache locality as in SGLang's cache-aware router
and llm-d's prefix scorer). Decode: least loaded (published running + queued
requests plus this gateway's requests there), ties broken by the blocks an
instance already holds. Only instances of the gateway's model and KV
namespace qualify (a decode cannot read a prefill's KV otherwise).
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

from services.gateway.lending import LendPolicy, other_role, serving
from services.gateway.prefix_locator import NO_HITS, STORE_ROLE, PrefixHits
from shared.cluster.block_index import BlockIndex
from shared.cluster.in_flight import InFlightIndex
from shared.cluster.keys import Keys
from shared.cluster.membership import Endpoint, LastKnown, Member, live_members
from shared.serving.background import Background
from shared.serving.errors import ServiceError

log = logging.getLogger(__name__)
ROUTED = ("prefill", "decode", "colocated")
ROLES = (*ROUTED, STORE_ROLE)
LENDING_ROLES = ("prefill", "decode")  # mixed instances serve either
# what the queues count per role
LOAD_KEYS = {"prefill": "pending_tokens", "decode": "running", "colocated": "pending_tokens"}
BENCH_S = 5.0
PULL_TOKEN_COST = 0.02  # a token pulled from the store costs about 1/50 of computing it
# a prompt sent to a prefill counts as held there while it computes and this long after
# (its blocks reach the index within a publish interval)
IN_FLIGHT_GRACE_S = 2.0


@dataclass
class Pick:
    """One routing choice; ``done`` returns this gateway's share of the load."""

    member: Member
    role: str  # the role it serves this request in (a mixed instance may be lent)
    cost: float
    router: Router
    predicted_cached: int = 0  # prompt tokens the instance should not have to compute
    keys: tuple[str, ...] = ()  # the prompt's block keys (prefill picks)
    finished_at: float | None = None

    @property
    def url(self) -> str:
        return self.member.http_url

    def done(self) -> None:
        if self.cost:
            self.router.local[(self.role, self.member.instance_id)] -= self.cost
            self.cost = 0.0
        if self.finished_at is None:
            self.finished_at = time.monotonic()
            self.router.ended(self)


class Router:
    def __init__(
        self,
        redis: aioredis.Redis,
        keys: Keys,
        *,
        model: str,
        refresh_s: float,
        balance_tokens: float = 4096.0,
        index: BlockIndex | None = None,
        reap_s: float = 10.0,
        lend: LendPolicy | None = None,
        member_ttl_s: float = 5.0,
        in_flight: InFlightIndex | None = None,
    ):
        self.redis = redis
        self.keys = keys
        self.model = model
        self.refresh_s = refresh_s
        self.balance_tokens = balance_tokens
        self.index = index
        self.reap_s = reap_s
        self.members: dict[str, list[Member]] = {r: [] for r in ROLES}
        self._registered = {r: LastKnown(member_ttl_s) for r in ROLES}  # Redis restarted empty
        self.lend = lend or LendPolicy()
        # (role, instance id) -> what this gateway sent there since its last report
        self.local: defaultdict[tuple[str, str], float] = defaultdict(float)
        self.picked: defaultdict[str, int] = defaultdict(int)  # ties go to the least picked
        self.in_flight: defaultdict[str, list[Pick]] = defaultdict(list)  # prefill picks
        self.shared = in_flight  # the same, of every gateway, in Redis
        self._marks = Background()
        # instance id -> (the process benched, until when): a restart ends the bench
        self.benched: dict[str, tuple[Endpoint, float]] = {}
        self.redis_ok = False
        self.kv_namespace: str | None = None
        self.block_size: int | None = None
        self._task: asyncio.Task[None] | None = None
        self._catch_up = asyncio.Lock()
        self._read_at = -float("inf")  # when the latest membership read began

    async def refresh(self) -> None:
        self._read_at = time.monotonic()  # tried, answered or not: catch_up waits no more
        try:
            found = {r: await live_members(self.redis, self.keys, r) for r in ROLES}
        except (RedisError, OSError) as exc:
            if self.redis_ok:
                log.warning("Redis unreachable; routing to the last known instances: %s", exc)
            self.redis_ok = False
            return
        self.redis_ok = True
        for role, members in found.items():
            known = self._registered[role].update(members)
            self.members[role] = [m for m in known if role == STORE_ROLE or m.model == self.model]
        workers = [m for r in ROUTED for m in self.members[r]]
        namespaces = {m.kv_namespace for m in workers}
        if len(namespaces) > 1:
            log.warning("workers disagree on the KV layout: %s", sorted(map(str, namespaces)))
        prompt_role = self.members["prefill"] or self.members["colocated"] or self.members["decode"]
        if prompt_role:
            self.kv_namespace = prompt_role[0].kv_namespace
            self.block_size = prompt_role[0].block_size

    async def reap(self) -> list[str]:
        """Clear the index entries of every instance that is no longer live."""
        if self.index is None:
            return []
        registered = await self.index.instances()  # before membership: see instances()
        await self.refresh()
        if not self.redis_ok:
            return []
        dead = sorted(registered - set(self.live_roles()))
        for instance_id in dead:
            removed = await self.index.clear(instance_id)
            log.info("cleared %d index entries of %s (no longer live)", removed, instance_id)
        return dead

    async def _loop(self) -> None:
        last_reap = time.monotonic()
        while True:
            await self.refresh()
            if time.monotonic() - last_reap >= self.reap_s:
                last_reap = time.monotonic()
                try:
                    await self.reap()
                except (RedisError, OSError) as exc:
                    log.warning("clearing dead instances' index entries failed: %s", exc)
            await asyncio.sleep(self.refresh_s)

    async def start(self) -> None:
        await self.refresh()
        self._task = asyncio.create_task(self._loop(), name="router-refresh")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        await self._marks.drain(1.0)

    async def share(self, pick: Pick) -> None:
        """Tell the other gateways that ``pick``'s instance is computing its prompt
        (before the prompt is sent, so no later prompt misses it)."""
        if self.shared is None or not pick.keys:
            return
        try:
            await self.shared.started(pick.member.instance_id, pick.keys)
        except (RedisError, OSError) as exc:  # degraded: the other gateways route blind
            log.debug("could not share an in-flight prompt: %s", exc)

    def ended(self, pick: Pick) -> None:
        if self.shared is None or not pick.keys:
            return
        shared = self.shared

        async def lapse() -> None:
            try:
                await shared.ended(pick.member.instance_id, pick.keys)
            except (RedisError, OSError) as exc:  # its entries lapse on their own
                log.debug("could not end an in-flight prompt: %s", exc)

        self._marks.spawn(lapse(), "in-flight-ended")

    def live(self, role: str) -> list[Member]:
        now = time.monotonic()
        out = [
            m
            for m in self.members[role]
            if not self._benched(m, now) and not m.load.get("draining")
        ]
        if role == "decode" and self.kv_namespace is not None:
            out = [m for m in out if m.kv_namespace == self.kv_namespace]
        return out

    def registered(self, role: str, instance_id: str) -> bool:
        """Whether ``instance_id`` is in membership now (its heartbeat key is alive), benched
        here or not: a bench says it refused a connection, not that it is gone."""
        return any(m.instance_id == instance_id for m in self.members[role])

    def step_s(self, member: Member) -> float:
        """How long ``member``'s engine steps take lately, as it last published."""
        current = next(
            (m for m in self.members.get(member.role, ()) if m.instance_id == member.instance_id),
            member,
        )
        return current.load.get("step_s", 0.0)

    def live_roles(self) -> dict[str, str]:
        """Instance id -> role of every live instance (stores included)."""
        return {m.instance_id: role for role in ROLES for m in self.members[role]}

    def kv_windows(self) -> dict[str, int]:
        """Instance id -> the tokens its sliding layers read back, of every live worker
        whose pool keeps only their window's KV."""
        return {
            m.instance_id: m.kv_window
            for role in ROUTED
            for m in self.members[role]
            if m.kv_window is not None
        }

    def bench(self, member: Member) -> None:
        """Stop routing to ``member``'s process for a while (it refused a connection);
        a new process under its id (restarted, ready and registered) is not benched."""
        self.benched[member.instance_id] = (member.endpoint, time.monotonic() + BENCH_S)

    def _benched(self, member: Member, now: float) -> bool:
        bench = self.benched.get(member.instance_id)
        return bench is not None and bench[0] == member.endpoint and now < bench[1]

    def score(self, member: Member, role: str) -> float:
        """Published load plus what this gateway sent there since."""
        return member.load.get(LOAD_KEYS[role], 0.0) + self.local[(role, member.instance_id)]

    def candidates(self, role: str, alongside: Pick | None = None) -> list[Member]:
        """``role``'s live instances, plus the other role's mixed instances the lending
        policy lets take this request (see :mod:`services.gateway.lending`);
        ``alongside``: this request's own pick in the other role, which does not count
        against that instance's own queue."""
        own = self.live(role)
        if role not in LENDING_ROLES:
            return own

        def score(member: Member, r: str) -> float:
            s = self.score(member, r)
            if alongside and (alongside.role, alongside.member.instance_id) == (
                r,
                member.instance_id,
            ):
                s -= alongside.cost
            return s

        others = self.live(other_role(role))
        if role == "decode" and self.kv_namespace is not None:  # as live() does for decode
            others = [m for m in others if m.kv_namespace == self.kv_namespace]
        return own + self.lend.lendable(role, own, others, score)

    def lent(self) -> dict[str, int]:
        """Per role: the other role's instances serving it at the moment."""
        return {r: serving(self.live(other_role(r)), r) for r in LENDING_ROLES}

    async def catch_up(self, role: str, exclude: set[str] | None = None) -> None:
        """When no instance of ``role`` outside ``exclude`` qualifies, read membership
        now, out of turn: the view lags up to ``refresh_s``, and a replacement may have
        registered since (a rolling restart drains the next instance as soon as this
        one is ready). Callers that find none at once share one read, and with Redis
        down one failed try (each would wait out the socket timeout in turn otherwise)."""
        if any(m.instance_id not in (exclude or ()) for m in self.candidates(role)):
            return
        asked = time.monotonic()
        async with self._catch_up:
            if self._read_at < asked:
                await self.refresh()

    def pick(
        self,
        role: str,
        cost: int,
        exclude: set[str] | None = None,
        hits: PrefixHits = NO_HITS,
        alongside: Pick | None = None,
    ) -> Pick:
        """Prefill (and colocated): ``cost`` is the prompt's length; the cheapest instance
        within the balance bound. Decode: ``cost`` = 1; the least loaded. Raises 503
        when none is live."""
        excluded = exclude or set()
        members = [m for m in self.candidates(role, alongside) if m.instance_id not in excluded]
        if not members:
            raise ServiceError(
                503, f"no live {role} instance is available", code="no_live_instance"
            )
        if role == "decode":
            best = min(
                members,
                key=lambda m: (
                    self.score(m, role),
                    -hits.local.get(m.instance_id, 0),
                    self.picked[m.instance_id],
                ),
            )
            self.local[(role, best.instance_id)] += cost
            self.picked[best.instance_id] += 1
            return Pick(best, role, float(cost), self)
        return self._pick_prompt(role, members, cost, hits)

    def _pick_prompt(self, role: str, members: list[Member], n: int, hits: PrefixHits) -> Pick:
        usable = (n - 1) // self.block_size * self.block_size if self.block_size else 0
        shared = hits.computing  # what every gateway routed, as read with the index
        in_flight = {
            m.instance_id: max(self._in_flight_prefix(m, hits), shared.get(m.instance_id, 0))
            for m in members
        }
        hits = hits.with_local({iid: min(t, usable) for iid, t in in_flight.items()})
        queued = {m.instance_id: self.score(m, role) for m in members}
        bound = min(queued.values()) + self.balance_tokens
        candidates = [m for m in members if queued[m.instance_id] <= bound]

        def estimate(m: Member) -> tuple[float, float, int]:
            iid = m.instance_id
            uncached = n - hits.cached(iid)
            pulled = max(0, hits.store - hits.local.get(iid, 0))
            cost = queued[iid] + uncached + PULL_TOKEN_COST * pulled
            return (cost, queued[iid], self.picked[iid])

        best = min(candidates, key=estimate)
        cached = min(hits.cached(best.instance_id), n - 1)
        if self.block_size:  # reuse comes in whole blocks
            cached = cached // self.block_size * self.block_size
        work = n - cached
        self.local[(role, best.instance_id)] += work
        self.picked[best.instance_id] += 1
        pick = Pick(best, role, float(work), self, predicted_cached=cached, keys=hits.keys)
        self.in_flight[best.instance_id].append(pick)
        return pick

    def _in_flight_prefix(self, member: Member, hits: PrefixHits) -> int:
        """Tokens of this prompt that prompts this gateway sent to ``member`` will have
        computed there (it waits for them rather than computing a copy), like SGLang's
        router, which inserts a prompt into its tree when it routes it."""
        picks = self.in_flight.get(member.instance_id)
        if not picks or not hits.keys or not self.block_size:
            return 0
        now = time.monotonic()
        picks[:] = [
            p for p in picks if p.finished_at is None or now - p.finished_at < IN_FLIGHT_GRACE_S
        ]
        best = 0
        for p in picks:
            shared = 0
            for a, b in zip(hits.keys, p.keys, strict=False):
                if a != b:
                    break
                shared += 1
            best = max(best, shared)
        return best * self.block_size

    def queue_depths(self) -> dict[str, float]:
        out = {}
        for role, key in (
            ("prefill", "pending_tokens"),
            ("decode", "waiting_kv"),
            ("colocated", "pending_tokens"),
        ):
            out[role] = sum(m.load.get(key, 0.0) for m in self.members[role])
        return out
