"""The event log of resumable responses on a real redis-server: numbering, reading after
a cursor, fencing by lease and epoch, take-over, cancel, the length cap and expiry."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
import redis.asyncio as aioredis

from shared.cluster.event_log import (
    EventLog,
    EventLogError,
    LeaseLostError,
    LogFullError,
    LoggedEvent,
)
from shared.cluster.keys import Keys
from shared.procs import RedisProcess


@pytest.fixture
async def log(
    redis_server: RedisProcess, request: pytest.FixtureRequest
) -> AsyncIterator[EventLog]:
    client = aioredis.from_url(redis_server.url)
    yield EventLog(client, Keys(f"t-{request.node.name}"), lease_s=0.3, max_events=5)
    await client.aclose()


async def test_events_are_numbered_from_zero_and_read_after_any_cursor(log: EventLog) -> None:
    lease = await log.create("r1", "gw-a", "tenant", {"kind": "chat", "body": "{}"})
    for i in range(3):
        assert await log.append(lease, i, f"e{i}", tokens=[10 + i]) == i
    assert await log.read("r1", -1) == [
        LoggedEvent(0, "e0"),
        LoggedEvent(1, "e1"),
        LoggedEvent(2, "e2"),
    ]
    assert await log.read("r1", 1) == [LoggedEvent(2, "e2")]
    assert await log.read("r1", 2) == []
    assert await log.tokens("r1") == [10, 11, 12]
    record = await log.record("r1")
    assert record is not None and record.last_seq == 2 and not record.finished
    assert record.request == {"kind": "chat", "body": "{}"} and record.tenant == "tenant"
    assert await log.first_seq("r1") == 0
    assert await log.record("unknown") is None


async def test_a_reader_waiting_for_the_next_event_gets_it_when_it_is_appended(
    log: EventLog,
) -> None:
    lease = await log.create("r2", "gw-a", None, {})
    waiting = asyncio.ensure_future(log.read("r2", -1, block_ms=1000))
    await asyncio.sleep(0.05)
    await log.append(lease, 0, "first")
    assert await waiting == [LoggedEvent(0, "first")]


async def test_an_owner_whose_lease_expired_is_fenced_once_another_takes_over(
    log: EventLog,
) -> None:
    old = await log.create("r3", "gw-a", None, {})
    await log.append(old, 0, "e0")
    assert await log.take_over("r3", "gw-b") is None  # still held
    await asyncio.sleep(0.4)  # the owner paused past its lease
    new = await log.take_over("r3", "gw-b")
    assert new is not None and new.epoch == 2
    with pytest.raises(LeaseLostError):
        await log.append(old, 1, "stale")  # the paused owner wakes up: nothing lands
    with pytest.raises(LeaseLostError):
        await log.renew(old)
    assert await log.append(new, 1, "e1") == 1
    assert [e.data for e in await log.read("r3", -1)] == ["e0", "e1"]


async def test_an_owner_found_gone_is_taken_over_before_its_lease_lapses(
    log: EventLog,
) -> None:
    """A follower that found the owner dead (its address refuses connections) takes the
    lease at once, but only from that owner: one that already moved on (a newer epoch,
    another taker) is left alone. The old owner is fenced either way."""
    old = await log.create("r5", "gw-a", None, {}, owner_url="http://10.0.0.1:8000")
    await log.append(old, 0, "e0")
    record = await log.record("r5")
    assert record is not None and record.owner_url == "http://10.0.0.1:8000"
    assert record.lease == old
    assert await log.take_over("r5", "gw-b") is None  # the lease is still live
    new = await log.take_over("r5", "gw-b", "http://10.0.0.2:8000", gone=record.lease)
    assert new is not None and new.epoch == 2
    with pytest.raises(LeaseLostError):
        await log.append(old, 1, "late")
    taken = await log.record("r5")
    assert taken is not None and (taken.owner, taken.owner_url) == ("gw-b", "http://10.0.0.2:8000")
    # a third gateway that saw gw-a gone too, a moment later, gets nothing: gw-b holds it
    assert await log.take_over("r5", "gw-c", gone=old) is None
    assert await log.append(new, 1, "e1") == 1


async def test_the_reused_prompt_tokens_are_kept_with_the_record(log: EventLog) -> None:
    lease = await log.create("r6", "gw-a", None, {})
    await log.append(lease, 0, "created")
    record = await log.record("r6")
    assert record is not None and record.cached_tokens is None  # not known yet
    await log.append(lease, 1, "first delta", tokens=[7], cached_tokens=32)
    await log.append(lease, 2, "next delta", tokens=[8])
    record = await log.record("r6")
    assert record is not None and record.cached_tokens == 32


async def test_the_last_event_ends_the_response_and_a_finished_one_cannot_be_taken(
    log: EventLog,
) -> None:
    lease = await log.create("r4", "gw-a", None, {})
    await log.append(lease, 0, "done", status="completed")
    record = await log.record("r4")
    assert record is not None and record.finished and record.status == "completed"
    assert not await log.held("r4")
    assert await log.take_over("r4", "gw-b") is None


async def test_a_cancel_reaches_the_owner_with_its_next_renewal(log: EventLog) -> None:
    lease = await log.create("r5", "gw-a", None, {})
    assert await log.renew(lease) is False
    await log.cancel("r5")
    assert await log.renew(lease) is True


async def test_a_log_refuses_events_past_its_cap_and_everything_expires(log: EventLog) -> None:
    lease = await log.create("r6", "gw-a", None, {})
    for i in range(5):
        await log.append(lease, i, f"e{i}")
    with pytest.raises(LogFullError):
        await log.append(lease, 5, "e5")
    short = EventLog(log.redis, log.keys, retention_s=0.2)
    lease = await short.create("r7", "gw-a", None, {})
    await short.append(lease, 0, "e0")
    await asyncio.sleep(0.35)
    assert await short.record("r7") is None and await short.read("r7", -1) == []
    await log.delete("r6")
    assert await log.record("r6") is None


async def test_appending_an_event_again_is_a_no_op_and_a_gap_is_refused(log: EventLog) -> None:
    """An owner whose append's reply was lost retries it: the log keeps it once."""
    lease = await log.create("r8", "gw-a", None, {})
    await log.append(lease, 0, "e0", tokens=[7])
    assert await log.append(lease, 0, "e0", tokens=[7]) == 0  # the retry lands nothing
    assert [e.data for e in await log.read("r8", -1)] == ["e0"] and await log.tokens("r8") == [7]
    with pytest.raises(EventLogError):
        await log.append(lease, 2, "e2")  # e1 never made it
