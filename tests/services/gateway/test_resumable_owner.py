"""Producing and following resumable responses on a real redis-server, with a fake event
source (a fixed sequence, as a response's events are fixed by its tokens): the log
gets every event before the client, the client leaving does not stop it, a cancel
ends it with the source's cancelled event, and a follower takes over a response
whose owner stopped renewing, continuing the same sequence after the logged part."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
import redis.asyncio as aioredis

from services.gateway.resumable import Emitted, Resumables
from shared.cluster.event_log import EventLog, ResponseRecord
from shared.cluster.keys import Keys
from shared.procs import RedisProcess


class FakeSource:
    """Events e0..e{n-1}, each carrying token 100 + i, the last ending the response."""

    def __init__(self, n: int, gap_s: float = 0.0):
        self.n = n
        self.gap_s = gap_s
        self.closed = False

    async def _events(self) -> AsyncIterator[Emitted]:
        for i in range(self.n):
            await asyncio.sleep(self.gap_s)
            yield Emitted(f"e{i}", (100 + i,), status="completed" if i == self.n - 1 else None)

    def events(self) -> AsyncIterator[Emitted]:
        return self._events()

    def cancelled(self) -> Emitted:
        return Emitted("cancelled", status="cancelled")

    async def aclose(self) -> None:
        self.closed = True


@pytest.fixture
async def client(redis_server: RedisProcess) -> AsyncIterator[aioredis.Redis]:
    client = aioredis.from_url(redis_server.url)
    yield client
    await client.aclose()


@pytest.fixture
async def log(client: aioredis.Redis, request: pytest.FixtureRequest) -> EventLog:
    """Short leases: a take-over after a lapse takes a fraction of a second."""
    return EventLog(client, Keys(f"o-{request.node.name}"), lease_s=0.3)


async def test_every_event_is_logged_before_the_client_gets_it_and_goes_on_without_it(
    log: EventLog,
) -> None:
    here = Resumables(log, "gw-a", rebuild={})
    source = FakeSource(6, gap_s=0.02)
    owned = await here.start("r1", None, {"kind": "fake"}, source)
    assert owned is not None
    seen = []
    async for item in owned.delivered():
        logged = await log.read("r1", -1)
        assert item.seq is not None and logged[item.seq].data == item.data  # logged first
        seen.append(item.data)
        if len(seen) == 2:
            break  # the client goes away
    assert owned.task is not None
    await owned.task
    assert [e.data for e in await log.read("r1", -1)] == [f"e{i}" for i in range(6)]
    assert await log.tokens("r1") == list(range(100, 106)) and source.closed
    record = await log.record("r1")
    assert record is not None and record.status == "completed"


async def test_a_cancel_ends_the_response_with_the_cancelled_event(
    client: aioredis.Redis, request: pytest.FixtureRequest
) -> None:
    # a lease that outlasts a busy machine's stalls: this is about the cancel (with
    # 0.3 s, a loaded CI host once let it lapse before the cancelled event was logged)
    log = EventLog(client, Keys(f"o-{request.node.name}"), lease_s=5.0)
    here = Resumables(log, "gw-a", rebuild={})
    owned = await here.start("r2", None, {"kind": "fake"}, FakeSource(1000, gap_s=0.01))
    assert owned is not None and owned.task is not None
    await asyncio.sleep(0.05)
    await here.cancel("r2")
    await owned.task
    events = await log.read("r2", -1, count=10_000)
    assert events[-1].data == "cancelled" and events[-1].status == "cancelled"
    record = await log.record("r2")
    assert record is not None and record.status == "cancelled"


async def test_a_follower_takes_over_a_response_whose_owner_stopped(log: EventLog) -> None:
    # gateway A produced events 0-2 and died (its lease lapses: it renews no more)
    lease = await log.create("r3", "gw-a", None, {"kind": "fake"})
    for i in range(3):
        await log.append(lease, i, f"e{i}", (100 + i,))
    rebuilt: list[tuple[list[int], int]] = []

    async def rebuild(record: ResponseRecord, tokens: list[int], attempt: int) -> FakeSource:
        rebuilt.append((tokens, attempt))
        return FakeSource(8)  # the same sequence again, from its start

    b = Resumables(log, "gw-b", rebuild={"fake": rebuild})
    got = [e async for e in b.follow("r3", after=1)]
    assert [e.data for e in got] == [f"e{i}" for i in range(2, 8)]  # none missing or twice
    assert [e.seq for e in got] == list(range(2, 8))
    assert rebuilt == [([100, 101, 102], 2)]  # the logged tokens, take-over epoch 2
    assert await log.tokens("r3") == list(range(100, 108))
    record = await log.record("r3")
    assert record is not None and record.owner == "gw-b" and record.status == "completed"


async def test_an_owner_found_gone_is_taken_over_without_waiting_out_its_lease(
    client: aioredis.Redis, request: pytest.FixtureRequest
) -> None:
    """Gateway A was killed with a long lease left: B asks whether A's address is gone
    (a killed gateway refuses connections) and continues at once. An owner that is
    only slow (its address answers) keeps its response until the lease lapses."""
    log = EventLog(client, Keys(f"o-{request.node.name}"), lease_s=60)
    lease = await log.create("r4", "gw-a", None, {"kind": "fake"}, owner_url="http://a:8000")
    for i in range(3):
        await log.append(lease, i, f"e{i}", (100 + i,))
    asked: list[str] = []
    gone = {"http://a:8000": False}

    async def owner_gone(url: str, owner: str) -> bool:
        assert owner == "gw-a"
        asked.append(url)
        return gone[url]

    async def rebuild(record: ResponseRecord, tokens: list[int], attempt: int) -> FakeSource:
        return FakeSource(6)

    b = Resumables(
        log, "gw-b", rebuild={"fake": rebuild}, owner_url="http://b:8000", owner_gone=owner_gone
    )
    follower = b.follow("r4", after=2)
    # alive and slow: asked, not taken (the read waits for events meanwhile)
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(anext(follower), 0.8)
    assert asked and set(asked) == {"http://a:8000"}
    record = await log.record("r4")
    assert record is not None and record.owner == "gw-a"
    gone["http://a:8000"] = True  # killed: the next look takes it over, 60 s lease or not
    follower = b.follow("r4", after=2)
    got = [e async for e in follower]
    assert [e.data for e in got] == ["e3", "e4", "e5"]
    record = await log.record("r4")
    assert record is not None and (record.owner, record.owner_url) == ("gw-b", "http://b:8000")
    assert record.epoch == 2 and record.status == "completed"
