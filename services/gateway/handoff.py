"""One request through the cluster: prefill -> KV store -> decode, as a stream of tokens.

1. Look the prompt's blocks up in the prompt index, then pick a prefill (lowest
   estimated cost: queued work plus the tokens it would compute) and a decode
   instance (least load) together.
2. Prefill reserves the prompt's KV in the store and answers ``accepted`` with
   the transfer ids; decode is told at once and starts pulling while prefill
   computes (and streams layers into the store).
3. Prefill's first token goes to the client and to decode; decode joins its
   running batch and streams the rest (:class:`DecodeSession`, which moves the
   request to another decode instance when this one dies, hangs or drains).
4. The prefill stream is read to its end (``committed``) in the background: a
   prefill whose caller vanishes before the commit revokes the KV.

Closing the generator (client gone, stop string, error) closes every worker
stream, which cancels the request there and frees its KV. A prefill that cannot
be reached, refuses (draining) or is lost before the first token is replaced by
another before anything was sent to the client.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncGenerator
from dataclasses import dataclass
from typing import TypeVar

import httpx

from services.gateway.decode_session import RETRY_S, DecodeSession, FailoverPolicy
from services.gateway.metrics import GatewayMetrics
from services.gateway.prefix_locator import PrefixHits, PrefixLocator
from services.gateway.router import Pick, Router
from services.gateway.worker_stream import DRAINING, LOST, WorkerStream, open_stream
from shared.cluster.watermarks import Watermarks
from shared.serving.background import Background
from shared.serving.errors import ServiceError
from shared.serving.protocol import (
    REQUEST_ID_HEADER,
    Accepted,
    DecodeRequest,
    FirstToken,
    FirstTokenEvent,
    PrefillRequest,
    SamplingSpec,
    TokenEvent,
    WireToken,
)

log = logging.getLogger(__name__)
T = TypeVar("T")
DRAIN_S = 60.0
# a worker ends its stream right after its last event
STREAM_END_S = 1.0


@dataclass(frozen=True)
class CacheReport:
    """Prompt tokens the router expected to be reused, and those that were."""

    predicted: int
    actual: int


@dataclass(frozen=True)
class Generated:
    token: WireToken
    finish_reason: str | None  # set on the last token
    cache: CacheReport | None = None  # on the first token


@dataclass
class Started:
    """A request with its worker streams open and (once set) its first token."""

    prefill_pick: Pick
    prefill: WorkerStream
    accepted: Accepted
    hits: PrefixHits
    decode_pick: Pick | None = None
    decode: WorkerStream | None = None
    first: FirstTokenEvent | None = None
    drain: asyncio.Task[None] | None = None
    session: DecodeSession | None = None
    accepted_id: str = ""  # the request's id on its decode instance, once opened


class Handoff:
    def __init__(
        self,
        http: httpx.AsyncClient,
        router: Router,
        locator: PrefixLocator,
        watermarks: Watermarks,
        metrics: GatewayMetrics,
        *,
        attempts: int,
        failover: FailoverPolicy,
        colocated: bool = False,
    ):
        self.http = http
        self.router = router
        self.locator = locator
        self.watermarks = watermarks
        self.metrics = metrics
        self.attempts = attempts
        self.failover = failover
        self.colocated = colocated
        self.background = Background()

    async def _open(
        self,
        role: str,
        path: str,
        payload: str,
        request_id: str,
        cost: int,
        hits: PrefixHits,
        exclude: set[str] | None = None,
        alongside: Pick | None = None,
    ) -> tuple[Pick, WorkerStream, Accepted]:
        """Open ``path`` on an instance of ``role`` and wait for ``accepted``. An instance
        that refuses the connection or is draining is benched and another tried (nothing
        was sent to the client yet); :meth:`Router.pick` raises 503 once none is left."""
        tried: set[str] = set(exclude or ())
        dropped: set[str] = set()  # instances that dropped a reused connection once
        for attempt in range(self.attempts):
            await self.router.catch_up(role, tried)
            pick = self.router.pick(role, cost, tried, hits, alongside)
            instance = pick.member.instance_id
            try:
                await self.router.share(pick)  # before it is sent: other gateways see it
                stream = await open_stream(self.http, pick.url + path, payload, request_id, role)
            except (httpx.TransportError, ServiceError) as exc:
                pick.done()
                unreachable = isinstance(exc, httpx.TransportError)
                if not unreachable and getattr(exc, "code", None) != DRAINING:
                    raise
                if _dropped_connection(exc) and instance not in dropped:
                    # a kept-alive connection the instance closed as it was reused: the
                    # instance is fine, try it again on a fresh connection
                    dropped.add(instance)
                    log.info("%s %s dropped a kept-alive connection (%r)", role, instance, exc)
                    continue
                self.router.bench(pick.member)
                tried.add(instance)
                log.warning("%s %s refused the request (%r)", role, instance, exc)
                if attempt + 1 < self.attempts:
                    continue
                raise ServiceError(
                    503, f"no {role} instance could be reached", code="no_live_instance"
                ) from exc
            except BaseException:
                pick.done()
                raise
            try:
                first = await stream.next()
                if not isinstance(first, Accepted):
                    raise ServiceError(502, f"{role} sent {first.event} before accepted")
            except BaseException:
                pick.done()
                await stream.aclose()
                raise
            return pick, stream, first
        raise ServiceError(503, f"no {role} instance could be reached", code="no_live_instance")

    async def _start(self, request_id: str, prefill_body: PrefillRequest) -> Started:
        """Open prefill, then decode (it pulls while prefill computes; unless prefill says
        the KV comes only after the first token: then :meth:`generate` opens it), and
        wait for the first token. On failure, whatever was opened is closed (the work
        cancelled)."""
        prompt, sampling = prefill_body.prompt_token_ids, prefill_body.sampling
        hits = await self.locate(prompt, prefill_body.cache_salt)
        payload = prefill_body.model_copy(update={"store_tokens_indexed": hits.store})
        prefill_pick, prefill, accepted = await self._open(
            "prefill", "/v1/prefill", payload.model_dump_json(), request_id, len(prompt), hits
        )
        started = Started(prefill_pick, prefill, accepted, hits)
        try:
            if sampling.max_tokens > 1 and not accepted.kv_after_first_token:
                await self._open_decode(request_id, prefill_body, started, alongside=True)
            first = await prefill.next()
            if not isinstance(first, FirstTokenEvent):
                raise ServiceError(502, f"prefill sent {first.event} instead of the first token")
        except BaseException as exc:
            if isinstance(exc, ServiceError) and exc.code == LOST:
                lost = started.decode_pick if exc.who == "decode" else prefill_pick
                if lost is not None:
                    self.router.bench(lost.member)
            self._release(started, request_id)
            raise
        prefill_pick.done()
        started.first = first
        started.drain = asyncio.create_task(self._drain(prefill), name=f"drain:{request_id}")
        return started

    async def _hand_first(self, started: Started, token: WireToken) -> asyncio.Task[None]:
        """Start sending the first token to the request's decode (its delivery is the
        session's to watch: it may fail like the instance itself)."""
        pick = started.decode_pick
        if pick is None:
            raise ServiceError(502, "no decode stream was opened")
        worker_id = started.accepted_id
        send = self._send_first(pick, worker_id, token)
        return _retrieved(asyncio.create_task(send, name=f"send-first:{worker_id}"))

    async def _open_late(
        self, request_id: str, body: PrefillRequest, started: Started, token: WireToken
    ) -> asyncio.Task[None]:
        """Open the decode of a request whose first token is out, retried as a resume is
        (none live, or the one picked lost or silent before it accepted) until
        ``failover_timeout_s``; then start handing it the first token."""
        deadline = time.monotonic() + self.failover.failover_timeout_s
        while True:
            try:
                await asyncio.wait_for(
                    self._open_decode(request_id, body, started, alongside=False),
                    self.failover.progress_timeout_s,
                )
                return await self._hand_first(started, token)
            except (ServiceError, TimeoutError) as exc:
                retry = not isinstance(exc, ServiceError) or exc.status == 503 or exc.code == LOST
                if not retry or time.monotonic() > deadline:
                    raise
                log.warning("no decode instance took %s yet; retrying: %s", request_id, exc)
                await asyncio.sleep(RETRY_S)

    async def _open_decode(
        self, request_id: str, prefill_body: PrefillRequest, started: Started, *, alongside: bool
    ) -> None:
        """Open the request's decode: it reserves KV pool space and pulls from the store.
        ``alongside``: the prefill pick still counts (it has not given the first token)."""
        body = DecodeRequest(**prefill_body.decode_fields(), kv_ids=started.accepted.kv_ids)
        started.decode_pick, started.decode, _ = await self._open(
            "decode",
            "/v1/decode",
            body.model_dump_json(),
            request_id,
            1,
            started.hits,
            alongside=started.prefill_pick if alongside else None,
        )
        started.accepted_id = body.request_id
        self.metrics.decode_opens.labels("alongside" if alongside else "after_first_token").inc()

    async def locate(self, prompt: list[int], cache_salt: str | None) -> PrefixHits:
        return await self.locator.locate(
            prompt,
            cache_salt,
            namespace=self.router.kv_namespace,
            block_size=self.router.block_size,
            live=self.router.live_roles(),
            windows=self.router.kv_windows(),
        )

    def _release(self, started: Started, request_id: str) -> None:
        started.prefill_pick.done()
        decode = started.decode
        if started.session is not None:
            started.session.pick.done()
            decode = started.session.stream
        elif started.decode_pick is not None:
            started.decode_pick.done()
        self.background.spawn(
            self._close(started.prefill, decode, started.drain), f"close:{request_id}"
        )

    async def generate(
        self,
        request_id: str,
        prompt: list[int],
        sampling: SamplingSpec,
        cache_salt: str | None,
    ) -> AsyncGenerator[Generated, None]:
        """Tokens of one request. A prefill instance lost before the first token (nothing
        was sent to the client yet) is benched and the request starts over elsewhere."""
        body = PrefillRequest(
            request_id=request_id,
            prompt_token_ids=prompt,
            sampling=sampling,
            cache_salt=cache_salt,
        )
        if self.colocated:
            async for gen in self._generate_colocated(body):
                yield gen
            return
        attempt = 0
        while True:
            worker_id = request_id if attempt == 0 else f"{request_id}.{attempt}"
            try:
                started = await self._start(
                    request_id, body.model_copy(update={"request_id": worker_id})
                )
                break
            except ServiceError as exc:
                lost = exc.code == LOST and exc.who == "prefill"
                attempt += 1
                if not lost or attempt >= self.attempts:
                    raise
                log.warning("prefill lost before the first token; retrying: %s", exc)
        try:
            first = started.first
            if first is None:
                raise ServiceError(502, "prefill gave no first token")
            reason = first.finish_reason or ("length" if sampling.max_tokens == 1 else None)
            cache = CacheReport(started.prefill_pick.predicted_cached, first.cached_tokens)
            if reason is not None:
                yield Generated(first.token, reason, cache)
                return
            worker_body = body.model_copy(update={"request_id": worker_id})
            # the client gets the first token before it goes on to decode: handing it
            # over (and opening a decode not opened yet, its KV coming only now) runs on
            # this event loop, and begun first it held the token's write up by 2-5 ms.
            # Decode's stream is read only once it has it.
            yield Generated(first.token, None, cache)
            if started.decode is None:
                send = await self._open_late(request_id, worker_body, started, first.token)
            else:
                send = await self._hand_first(started, first.token)
            decode, decode_pick = started.decode, started.decode_pick
            if decode is None or decode_pick is None:
                raise ServiceError(502, "no decode stream was opened")
            session = started.session = self._session(
                request_id, worker_body, started, decode_pick, decode
            )
            async for token in session.tokens(first.token, send):
                yield Generated(token.token, token.finish_reason)
        finally:
            self._release(started, request_id)

    async def resume(
        self,
        request_id: str,
        prompt: list[int],
        sampling: SamplingSpec,
        cache_salt: str | None,
        generated: list[int],
        attempt: int,
    ) -> AsyncGenerator[Generated, None]:
        """The tokens after ``generated`` of a request another gateway started and can no
        longer carry (it died): a decode instance recomputes the prompt and the tokens
        so far and goes on (sampling is keyed by seed and position: the same tokens), with
        mid-stream failover as for any request. ``attempt`` numbers the take-overs."""
        worker_id = f"{request_id}.g{attempt}"
        body = DecodeRequest(
            request_id=worker_id,
            prompt_token_ids=prompt,
            sampling=sampling,
            cache_salt=cache_salt,
            generated=list(generated),
        )
        hits = await self.locate(prompt, cache_salt)
        pick, stream, _ = await self._open(
            "decode", "/v1/decode", body.model_dump_json(), worker_id, 1, hits
        )
        session = self._decode_session(worker_id, body, pick, stream, hits)
        try:
            async for token in session.continued(generated):
                yield Generated(token.token, token.finish_reason)
        finally:
            session.pick.done()
            self.background.spawn(session.stream.aclose(), f"close:{worker_id}")

    def _session(
        self,
        request_id: str,
        body: PrefillRequest,
        started: Started,
        pick: Pick,
        stream: WorkerStream,
    ) -> DecodeSession:
        decode_body = DecodeRequest(**body.decode_fields(), kv_ids=started.accepted.kv_ids)
        return self._decode_session(request_id, decode_body, pick, stream, started.hits)

    def _decode_session(
        self,
        request_id: str,
        decode_body: DecodeRequest,
        pick: Pick,
        stream: WorkerStream,
        hits: PrefixHits,
    ) -> DecodeSession:
        async def open_decode(
            resumed: DecodeRequest, exclude: set[str]
        ) -> tuple[Pick, WorkerStream]:
            pick, stream, _ = await self._open(
                "decode",
                "/v1/decode",
                resumed.model_dump_json(),
                resumed.request_id,
                1,
                hits,
                exclude,
            )
            return pick, stream

        return DecodeSession(
            request_id,
            decode_body,
            pick,
            stream,
            open_decode,
            self.router,
            self.watermarks,
            self.metrics,
            self.background,
            self.failover,
        )

    async def _generate_colocated(self, body: PrefillRequest) -> AsyncGenerator[Generated, None]:
        """The baseline: the whole request on one engine that does both phases."""
        rid = body.request_id
        prompt = body.prompt_token_ids
        hits = await self.locate(prompt, body.cache_salt)
        pick, stream, _ = await self._open(
            "colocated", "/v1/generate", body.model_dump_json(), rid, len(prompt), hits
        )
        try:
            while True:
                event = await stream.next()
                if not isinstance(event, TokenEvent):
                    raise ServiceError(502, f"colocated sent {event.event} instead of a token")
                yield Generated(event.token, event.finish_reason)
                if event.finish_reason is not None:
                    return
        finally:
            pick.done()
            self.background.spawn(stream.aclose(), f"close:{rid}")

    async def _close(
        self, prefill: WorkerStream, decode: WorkerStream | None, drain: asyncio.Task[None] | None
    ) -> None:
        """Closing a worker stream cancels the request there and frees its KV. After the
        first token, prefill's commit may still finish (the KV stays useful as cache)."""
        if decode is not None:
            await decode.aclose()
        if drain is None:
            await prefill.aclose()
        elif not drain.done():
            try:
                await asyncio.wait_for(drain, DRAIN_S)
            except TimeoutError:
                log.warning("prefill did not commit within %.0fs; abandoning it", DRAIN_S)

    async def _send_first(self, pick: Pick, request_id: str, token: WireToken) -> None:
        url = f"{pick.url}/v1/decode/{request_id}/first_token"
        body = FirstToken(token=token).model_dump_json()
        try:
            response = await self.http.post(
                url,
                content=body,
                headers={"content-type": "application/json", REQUEST_ID_HEADER: request_id},
            )
        except httpx.HTTPError as exc:
            raise ServiceError(502, f"decode unreachable: {exc}", code=LOST) from exc
        if response.status_code != 200:
            raise ServiceError(
                502, f"decode refused the first token: {response.text[:300]}", code=LOST
            )

    async def _drain(self, prefill: WorkerStream) -> None:
        """Read prefill's stream to ``committed`` so it does not revoke the KV, then to
        its end (which follows at once) so its connection serves the next request."""
        try:
            with contextlib.suppress(ServiceError):
                await prefill.next()
                await prefill.ended(STREAM_END_S)
        finally:
            await prefill.aclose()


def _dropped_connection(exc: BaseException) -> bool:
    """The connection broke after it was made (not refused, not timed out connecting)."""
    return isinstance(exc, httpx.TransportError) and not isinstance(
        exc, (httpx.ConnectError, httpx.ConnectTimeout, httpx.TimeoutException)
    )


def _retrieved(task: asyncio.Task[T]) -> asyncio.Task[T]:
    """``task``, whose exception is taken even if nobody awaits it (the request ended)."""
    task.add_done_callback(lambda t: t.cancelled() or t.exception())
    return task
