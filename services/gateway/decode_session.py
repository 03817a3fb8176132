"""The decode phase of one request, across decode instances (mid-stream failover).

Tokens come from the current decode instance. When it dies (its stream breaks),
hangs (it left membership: missed heartbeats; or no progress for ``silence_s``:
neither a token nor a ``waiting`` event, which a decode instance sends every
0.25 s while its engine makes progress without a token for this request, or
while the request's KV loads),
fails (an internal error event) or drains (it ends the stream with ``migrate``), the
request resumes on another instance: it loads the KV stored up to the
request's replication watermark, recomputes the few tokens past it, and goes
on from the last token the client got. Sampling is keyed by request seed and
token position, so the client sees no duplicated, no missing and no different
token. Only when no decode instance is left for ``failover_timeout_s`` does the
request end with an error.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncGenerator, Awaitable, Callable
from dataclasses import dataclass, field

from services.gateway.metrics import GatewayMetrics
from services.gateway.router import Pick, Router
from services.gateway.worker_stream import LOST, WorkerStream
from shared.cluster.membership import Member
from shared.cluster.watermarks import Watermark, Watermarks
from shared.serving.background import Background
from shared.serving.errors import ServiceError
from shared.serving.protocol import (
    DecodeRequest,
    MigrateEvent,
    TokenEvent,
    WaitingEvent,
    WireToken,
)

log = logging.getLogger(__name__)
HANG_CHECK_S = 0.25  # how often a silent stream's instance is checked for liveness
RETRY_S = 0.5  # between attempts to find a decode instance to resume on
STEPS_OF_SILENCE = 3.0  # a stream silent for this many of its instance's steps is hung


@dataclass(frozen=True)
class Token:
    token: WireToken
    finish_reason: str | None


OpenDecode = Callable[[DecodeRequest, set[str]], Awaitable[tuple[Pick, WorkerStream]]]


@dataclass(frozen=True)
class FailoverPolicy:
    progress_timeout_s: float = 60.0  # bound on handing over the first token, and on a resume
    # a stream that sends nothing this long (no token, no keepalive: a decode instance
    # sends one every 0.25 s while its engine makes progress or the request's KV
    # loads), nor for 3 of its instance's recent steps, is hung: stopped (SIGSTOP), or
    # its engine thread stuck; it is resumed elsewhere
    silence_s: float = 0.75
    failover_timeout_s: float = 60.0  # give up when no instance took the request for this long
    max_resumes: int = 16  # a request that keeps failing everywhere is not a failover


def _excluded(dead: Member, stop: _Interrupted) -> set[str]:
    """Where a resume's retries must not go: the instance that failed, unless it only
    stalled (silent, but still registered: a long swap or load kept its event loop
    busy). With no other instance left, that one takes the request back once its bench
    ends, instead of the request failing for want of a second decode instance."""
    return set() if stop.reason == "stalled" else {dead.instance_id}


class _Interrupted(Exception):
    def __init__(self, reason: str, migrate: MigrateEvent | None = None):
        super().__init__(reason)
        self.reason = reason
        self.migrate = migrate


@dataclass
class DecodeSession:
    request_id: str
    body: DecodeRequest  # what the first instance got (prompt, sampling, prompt KV ids)
    pick: Pick
    stream: WorkerStream
    open_decode: OpenDecode
    router: Router
    watermarks: Watermarks
    metrics: GatewayMetrics
    background: Background
    policy: FailoverPolicy = FailoverPolicy()
    generated: list[int] = field(default_factory=list)  # what the client has
    resumes: int = 0
    best: Watermark | None = None  # the furthest stored KV known (kept across resumes)

    @property
    def worker_id(self) -> str:
        """The request's id on the current instance (its watermark's key)."""
        return self.body.request_id if not self.resumes else f"{self.request_id}.d{self.resumes}"

    async def tokens(
        self, first: WireToken, sent: asyncio.Task[None] | None
    ) -> AsyncGenerator[Token, None]:
        """The tokens after ``first`` (already with the client; ``sent``: its delivery
        to the first instance, which may fail like the instance itself)."""
        self.generated = [first.id]
        async for token in self._tokens(sent):
            yield token

    async def continued(self, generated: list[int]) -> AsyncGenerator[Token, None]:
        """The tokens after ``generated``, for a session opened on a request another
        gateway started (its first instance was sent ``generated`` to go on from)."""
        self.generated = list(generated)
        async for token in self._tokens(None):
            yield token

    async def _tokens(self, sent: asyncio.Task[None] | None) -> AsyncGenerator[Token, None]:
        lost_at: float | None = None
        while True:
            try:
                if sent is not None:
                    await self._first_delivered(sent)
                    sent = None
                async for token in self._read():
                    if lost_at is not None:
                        self.metrics.resume_gap.observe(time.perf_counter() - lost_at)
                        lost_at = None
                    self.generated.append(token.token.id)
                    yield token
                    if token.finish_reason is not None:
                        return
            except _Interrupted as stop:
                sent = None
                lost_at = lost_at or time.perf_counter()
                await self._resume(stop)

    async def _first_delivered(self, sent: asyncio.Task[None]) -> None:
        """The first token reached the instance; a hung one is given up like in _read."""
        started = time.monotonic()
        checks = 0
        while not sent.done():
            await asyncio.wait({sent}, timeout=HANG_CHECK_S)
            if sent.done():
                break
            # the instance's event loop answers at once (it only hands the token over)
            checks += 1
            stalled = self._stalled(time.monotonic() - started, checks)
            if stalled or not self._alive():
                sent.cancel()
                raise _Interrupted("stalled" if stalled else "hung")
        try:
            sent.result()
        except ServiceError as exc:
            if exc.code != LOST:
                raise
            raise _Interrupted("lost") from exc

    async def _read(self) -> AsyncGenerator[Token, None]:
        last = time.monotonic()
        empty = 0  # checks in a row that found nothing
        while True:
            try:
                event = await self.stream.next(HANG_CHECK_S)
            except TimeoutError:
                if not self._alive():
                    raise _Interrupted("hung") from None
                empty += 1
                if self._stalled(time.monotonic() - last, empty):
                    raise _Interrupted("stalled") from None
                continue
            except ServiceError as exc:
                if exc.code == LOST:
                    raise _Interrupted("lost") from exc
                if exc.status >= 500:  # the instance failed the request (engine error)
                    raise _Interrupted("failed") from exc
                raise
            last, empty = time.monotonic(), 0
            if isinstance(event, WaitingEvent):
                continue  # queued or preempted there, and its engine is stepping
            if isinstance(event, MigrateEvent):
                raise _Interrupted("migrated", event)
            if not isinstance(event, TokenEvent):
                raise ServiceError(502, f"decode sent {event.event} instead of a token")
            yield Token(event.token, event.finish_reason)

    def _stalled(self, silent_s: float, empty: int) -> bool:
        """Whether a stream silent this long, found empty by this many checks in a row,
        is hung: silent past the bound (the policy's, or a few of its instance's recent
        step times where those are longer: a step that long between tokens is progress),
        counted in checks too, so that a stall of this gateway's own event loop (one late
        check, with the events waiting in the socket) is not taken for the instance's."""
        step_s = self.router.step_s(self.pick.member)
        bound = max(self.policy.silence_s, STEPS_OF_SILENCE * step_s)
        return silent_s > bound and empty * HANG_CHECK_S >= bound

    def _alive(self) -> bool:
        return self.router.registered(self.pick.member.role, self.pick.member.instance_id)

    async def _resume(self, stop: _Interrupted) -> None:
        """Continue on another decode instance from the stored KV."""
        dead = self.pick.member
        if self.resumes >= self.policy.max_resumes:
            raise ServiceError(
                503, f"decode failed {self.resumes + 1} times on this request; giving up",
                code="no_live_instance",
            )  # fmt: skip
        self.metrics.failovers.labels(stop.reason).inc()
        self.pick.done()
        if stop.reason != "migrated":
            self.router.bench(dead)
        self.background.spawn(self.stream.aclose(), f"close:{self.body.request_id}")
        mark = await self._watermark(stop)
        body = self._resumed(mark)
        log.warning(
            "decode %s %s after %d tokens; resuming with %d tokens of KV stored",
            dead.instance_id,
            stop.reason,
            len(self.generated),
            len(body.kv_ids) * self._block_size(),
        )
        deadline = time.monotonic() + self.policy.failover_timeout_s
        tried = {dead.instance_id}
        while True:
            try:
                self.pick, self.stream = await asyncio.wait_for(
                    self.open_decode(body, tried), self.policy.progress_timeout_s
                )
                return
            except (ServiceError, TimeoutError) as exc:
                # none live (503), the new one lost or hung before it accepted: try again
                retry = not isinstance(exc, ServiceError) or exc.status == 503 or exc.code == LOST
                if not retry or time.monotonic() > deadline:
                    raise ServiceError(
                        503,
                        f"decode {dead.instance_id} {stop.reason} and no decode instance took "
                        f"the request over: {exc}",
                        code="no_live_instance",
                    ) from exc
                await asyncio.sleep(RETRY_S)
                tried = _excluded(dead, stop)  # others may have come back meanwhile

    async def _watermark(self, stop: _Interrupted) -> Watermark | None:
        """The furthest stored KV: the instance's last word (drain), its watermark in
        Redis, or one an earlier instance of this request reached."""
        if stop.migrate is not None:
            m = stop.migrate
            mark: Watermark | None = Watermark(instance_id="", tokens=m.tokens, block_ids=m.kv_ids)
        else:
            mark = await self.watermarks.read(self.worker_id)
        if mark is not None and (self.best is None or mark.tokens > self.best.tokens):
            self.best = mark
        return self.best

    def _block_size(self) -> int:
        return self.router.block_size or 16

    def _resumed(self, mark: Watermark | None) -> DecodeRequest:
        """The request for the next instance: the tokens the client has, and the blocks
        stored up to the watermark (else the prompt's blocks prefill stored)."""
        bs = self._block_size()
        total = len(self.body.prompt_token_ids) + len(self.generated)
        if mark is not None and mark.block_ids:
            ids, tokens = mark.block_ids, mark.tokens
        else:
            prompt_blocks = len(self.body.prompt_token_ids) // bs
            ids, tokens = self.body.kv_ids[:prompt_blocks], prompt_blocks * bs
        usable = min(tokens, total - 1, len(ids) * bs) // bs
        self.metrics.recomputed_tokens.inc(total - usable * bs)
        self.resumes += 1
        return self.body.model_copy(
            update={
                "request_id": self.worker_id,
                "kv_ids": list(ids[:usable]),
                "generated": list(self.generated),
            }
        )
