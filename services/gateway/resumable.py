"""Resumable responses: produced by one gateway into the event log, read by any.

A resumable response (the Responses API; a chat or completions stream opened with
``stream_options.resumable``) is produced by a task this gateway owns
(:class:`Owned`), not by the client's connection: each event is appended to the log
(:mod:`shared.cluster.event_log`) and only then handed to the client that started
it, so a client that reconnects, to this gateway or another, reads what it has not
seen from the log (:meth:`Resumables.follow`). The task goes on while no client is
attached, until the response ends, is cancelled (``cancel``: seen with the next
lease renewal) or its lease is lost (another gateway took it over: fencing).

When a follower finds the response unfinished and nobody holding its lease (its
owner died and the lease lapsed), or its owner gone though the lease has not lapsed
yet (the owner's address refuses connections, or another gateway answers there: a
killed gateway, restarted or not, so a client that reconnects at once does not wait
out the lease), it takes the lease and continues the response here: the kind's
``rebuild`` regenerates the same event sequence from the request and the token ids
already logged (replayed, not computed), then from new tokens a decode instance
computes from there, and the events the log already holds are skipped, so the
sequence goes on exactly where it stopped. Events are deterministic given the
tokens (every timestamp comes from the record), sampling is keyed by seed and
position: no event is missing, repeated or different.

Redis down: a response that cannot be logged is served as an ordinary stream
(a ``resumable`` false notice first); one whose log fails midway goes on for the
attached client only.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Protocol

from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError
from redis.exceptions import TimeoutError as RedisTimeoutError

from shared.cluster.event_log import (
    EventLog,
    EventLogError,
    Lease,
    LeaseLostError,
    LoggedEvent,
    ResponseRecord,
)

log = logging.getLogger(__name__)
READ_BLOCK_MS = 250  # a follower's wait for the next event before it checks the owner
# ... the first time: a client reattaching often does so because its owner just died
FIRST_READ_BLOCK_MS = 50
APPEND_ATTEMPTS = 4  # a broken connection is retried (Redis restarted, a network blip)
RETRY_S = 0.1  # times the attempt number, between attempts


@dataclass(frozen=True)
class Emitted:
    """One event of a response, as its producer made it."""

    data: str  # the event as the client receives it (less the SSE ``id:`` line)
    tokens: tuple[int, ...] = ()  # token ids generated since the previous event
    finish: str | None = None  # generation ended with the last of ``tokens``, so
    status: str | None = None  # on the last event: the response's final status
    cached_tokens: int | None = None  # prompt tokens whose KV was reused, once known


class EventSource(Protocol):
    """A response's events, in order; deterministic given the request and the tokens."""

    def events(self) -> AsyncIterator[Emitted]: ...

    def cancelled(self) -> Emitted:
        """The last event of a response cancelled before its end."""
        ...

    async def aclose(self) -> None:
        """Release what generates the tokens (worker streams)."""
        ...


# (the record, the token ids logged, which take-over this is) -> its events again
Rebuild = Callable[[ResponseRecord, list[int], int], Awaitable[EventSource]]
# (an owner's address, its id) -> whether it is certainly gone (the address refuses
# connections, or another gateway answers there: it was restarted)
OwnerGone = Callable[[str, str], Awaitable[bool]]


@dataclass(frozen=True)
class Delivered:
    """An event for the attached client: ``seq`` None once the log stopped taking them."""

    seq: int | None
    data: str
    status: str | None


class Owned:
    """One response this gateway produces: its events go to the log, then to the client
    attached here (if any)."""

    def __init__(
        self,
        log_: EventLog,
        lease: Lease,
        source: EventSource,
        *,
        skip: int = 0,
        renew_s: float,
    ):
        self.log = log_
        self.lease = lease
        self.source = source
        self.skip = skip  # events of the sequence already in the log (a take-over)
        self.next_seq = skip  # the number of the next event this owner appends
        self.renew_s = renew_s
        self.local: asyncio.Queue[Delivered | None] = asyncio.Queue()
        self.attached = True  # the client that started it still reads self.local
        self.logging = True
        self.cancel_asked = False
        self.task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self.task = asyncio.create_task(self._run(), name=f"resumable:{self.lease.response_id}")

    async def _run(self) -> None:
        renew = asyncio.create_task(self._renew(), name=f"lease:{self.lease.response_id}")
        try:
            await self._produce()
        except asyncio.CancelledError:
            if not self.cancel_asked:
                raise
            await self._emit(self.source.cancelled())
        except LeaseLostError:
            log.info("%s: taken over elsewhere; stopping here", self.lease.response_id)
        finally:
            renew.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await renew
            await self.source.aclose()
            self.local.put_nowait(None)

    async def _produce(self) -> None:
        index = 0
        async for ev in self.source.events():
            if index < self.skip:
                index += 1
                continue
            index += 1
            await self._emit(ev)
            if ev.status is not None:
                return

    async def _emit(self, ev: Emitted) -> None:
        seq: int | None = None
        if self.logging:
            try:
                seq = await self._append(ev)
            except (EventLogError, RedisError, OSError) as exc:
                if isinstance(exc, LeaseLostError):
                    raise
                log.warning("%s: no longer logged (%s)", self.lease.response_id, exc)
                self.logging = False
        if self.attached:
            self.local.put_nowait(Delivered(seq, ev.data, ev.status))

    async def _append(self, ev: Emitted) -> int:
        """Appends the next event, retrying a broken connection (a Redis restart or a
        blip: the client reconnects; a retry of an append that landed is a no-op)."""
        attempt = 0
        while True:
            try:
                seq = await self.log.append(
                    self.lease, self.next_seq, ev.data, ev.tokens, ev.status, ev.finish,
                    ev.cached_tokens,
                )  # fmt: skip
                self.next_seq = seq + 1
                return seq
            except (RedisConnectionError, RedisTimeoutError, OSError):
                attempt += 1
                if attempt == APPEND_ATTEMPTS:
                    raise
                await asyncio.sleep(RETRY_S * attempt)

    async def _renew(self) -> None:
        while True:
            await asyncio.sleep(self.renew_s)
            if not self.logging:
                return
            try:
                if await self.log.renew(self.lease):
                    self.cancel_asked = True
                    if self.task is not None:
                        self.task.cancel()
                    return
            except LeaseLostError:
                if self.task is not None:
                    self.task.cancel()  # another gateway produces it now
                return
            except (RedisError, OSError) as exc:  # transient: the next round tries again
                log.warning("%s: lease renewal failed: %s", self.lease.response_id, exc)

    def cancel(self) -> None:
        self.cancel_asked = True
        if self.task is not None:
            self.task.cancel()

    async def delivered(self) -> AsyncIterator[Delivered]:
        """The events for the client that started the response, as they are made; once
        it stops reading (gone, or never there: background), none are kept for it."""
        try:
            while (item := await self.local.get()) is not None:
                yield item
        finally:
            self.detach()

    def detach(self) -> None:
        self.attached = False
        while not self.local.empty():
            self.local.get_nowait()


class Resumables:
    """This gateway's resumable responses, and reading any response from the log."""

    def __init__(
        self,
        log_: EventLog,
        owner_id: str,
        rebuild: dict[str, Rebuild],
        *,
        owner_url: str = "",
        owner_gone: OwnerGone | None = None,
    ):
        self.log = log_
        self.owner_id = owner_id
        self.owner_url = owner_url  # where this gateway serves, for followers to check
        self.owner_gone = owner_gone
        self.rebuild = rebuild  # per kind ("chat", "completion", "response")
        self.owned: dict[str, Owned] = {}
        self.renew_s = log_.lease_ms / 1000 / 3

    async def start(
        self, response_id: str, tenant: str | None, request: dict[str, object], source: EventSource
    ) -> Owned | None:
        """Produce a new response here; None when it cannot be logged (Redis down)."""
        try:
            lease = await self.log.create(
                response_id, self.owner_id, tenant, request, self.owner_url
            )
        except (RedisError, OSError) as exc:
            log.warning("%s: not resumable, the log is unreachable: %s", response_id, exc)
            return None
        return self._own(lease, source, skip=0)

    def _own(self, lease: Lease, source: EventSource, skip: int) -> Owned:
        owned = Owned(self.log, lease, source, skip=skip, renew_s=self.renew_s)
        self.owned[lease.response_id] = owned
        owned.start()
        if owned.task is not None:
            owned.task.add_done_callback(lambda _: self._forget(owned))
        return owned

    def _forget(self, owned: Owned) -> None:
        if self.owned.get(owned.lease.response_id) is owned:
            del self.owned[owned.lease.response_id]

    async def take_over(self, record: ResponseRecord, *, gone: bool = False) -> bool:
        """Continue ``record``'s response here if its owner is gone (``gone``: found dead
        though its lease has not lapsed; False: someone holds it, or it ended
        meanwhile)."""
        rebuild = self.rebuild.get(str(record.request.get("kind")))
        if rebuild is None:
            return False
        lease = await self.log.take_over(
            record.response_id,
            self.owner_id,
            self.owner_url,
            gone=record.lease if gone else None,
        )
        if lease is None:
            return False
        log.warning(
            "%s: owner %s is gone; continuing it here after event %d",
            record.response_id, record.owner, record.last_seq,
        )  # fmt: skip
        try:
            fresh = await self.log.record(record.response_id)
            tokens = await self.log.tokens(record.response_id)
            if fresh is None:
                return False
            source = await rebuild(fresh, tokens, lease.epoch)
        except BaseException:
            # nobody produces it: let the next follower try at once
            with contextlib.suppress(RedisError, OSError):
                await self.log.release(lease)
            raise
        self._own(lease, source, skip=fresh.last_seq + 1).detach()
        return True

    async def follow(self, response_id: str, after: int) -> AsyncIterator[LoggedEvent]:
        """The events after ``after`` until the response's last, taking the response
        over when its owner is gone."""
        cursor = after
        broken = 0
        block_ms = FIRST_READ_BLOCK_MS
        while True:
            try:
                events = await self.log.read(response_id, cursor, block_ms=block_ms)
            except (RedisConnectionError, RedisTimeoutError):
                broken += 1  # a broken connection is retried (Redis restarted, a blip)
                if broken == APPEND_ATTEMPTS:
                    raise
                await asyncio.sleep(RETRY_S * broken)
                continue
            broken = 0
            block_ms = READ_BLOCK_MS
            for ev in events:
                yield ev
                cursor = ev.seq
                if ev.status is not None:
                    return
            if events:
                continue
            record = await self.log.record(response_id)
            if record is None:
                return  # expired meanwhile
            if (record.finished or record.truncated) and record.last_seq <= cursor:
                return  # its end, or the end of what the log kept
            if record.finished:
                continue
            if not await self.log.held(response_id):
                await self.take_over(record)
            elif await self._owner_gone(record):
                await self.take_over(record, gone=True)

    async def _owner_gone(self, record: ResponseRecord) -> bool:
        """Whether the response's owner, another gateway, is certainly gone."""
        if self.owner_gone is None or not record.owner_url or record.owner == self.owner_id:
            return False
        gone = await self.owner_gone(record.owner_url, record.owner)
        if gone:
            log.warning(
                "%s: owner %s at %s is gone; taking it over before its lease lapses",
                record.response_id, record.owner, record.owner_url,
            )  # fmt: skip
        return gone

    async def cancel(self, response_id: str) -> None:
        """Stop it wherever it is produced (here at once; elsewhere at its owner's next
        renewal)."""
        owned = self.owned.get(response_id)
        if owned is not None:
            owned.cancel()
        await self.log.cancel(response_id)

    async def stop(self) -> None:
        """Shutdown: stop producing here and give the leases up, so that a follower
        elsewhere takes each response over at once."""
        owned = list(self.owned.values())
        for o in owned:
            if o.task is not None:
                o.task.cancel()
        await asyncio.gather(*(o.task for o in owned if o.task is not None), return_exceptions=True)
        for o in owned:  # a follower elsewhere need not wait for the leases to lapse
            with contextlib.suppress(RedisError, OSError):
                await self.log.release(o.lease)
