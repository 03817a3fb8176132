"""Serving the Responses API: ``POST /v1/responses`` (streamed or whole, in the
background or not), ``GET /v1/responses/{id}`` (poll; ``stream=true`` with
``starting_after``), ``POST /v1/responses/{id}/cancel`` and ``DELETE``.

A stored response (``store``, the default) is produced by a task of this gateway into
the event log (:mod:`services.gateway.resumable`): the client that created it reads
it as it is made, any gateway can serve it afterwards, and a gateway that finds its
producer dead continues it (:func:`rebuild_response`). ``store: false`` serves it
like a chat request, tied to the connection, and keeps nothing.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import replace
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from redis.exceptions import RedisError

from services.gateway.gateway import Gateway
from services.gateway.handoff import Generated
from services.gateway.reattach import check_cursor, checked_record, cursor, regenerate
from services.gateway.responses import Prepared, ResponseBuilder
from services.gateway.responses_api import (
    ResponseEvents,
    ResponsesRequest,
    fold,
    response_events,
    responses_param,
)
from services.gateway.resumable import Emitted, Owned
from services.gateway.timeline import Timeline
from shared.cluster.event_log import ResponseRecord
from shared.logs import request_id_var
from shared.serving.errors import ServiceError, error_response
from shared.serving.protocol import GATEWAY_HEADER, SamplingSpec

KINDS = ("response",)


class ResponseSource:
    """One response's events, from new tokens or (a take-over) the logged ones first."""

    def __init__(
        self,
        gw: Gateway,
        body: ResponsesRequest,
        prepared: Prepared,
        spec: SamplingSpec,
        *,
        tokens: list[int] | None = None,
        finish: str | None = None,
        attempt: int = 0,
    ):
        self.gw = gw
        self.prepared = prepared
        self.spec = spec
        self.tokens = tokens or []
        self.finish = finish
        self.attempt = attempt
        self.ev = ResponseEvents(
            body, "resp_" + prepared.request_id, prepared.created, len(prepared.prompt)
        )
        self._events: AsyncGenerator[Emitted, None] | None = None

    def events(self) -> AsyncIterator[Emitted]:
        self._events = response_events(self.ev, self._steps())
        return self._events

    def cancelled(self) -> Emitted:
        return self.ev.cancelled()

    async def aclose(self) -> None:
        if self._events is not None:
            await self._events.aclose()

    async def _steps(self) -> AsyncIterator[tuple[str, int, str | None]]:
        p, gw = self.prepared, self.gw
        builder = ResponseBuilder(p, gw.model.tokenizer)
        gens: AsyncGenerator[Generated, None] = (
            regenerate(gw, p, self.spec, self.tokens, self.finish, self.attempt)
            if self.attempt
            else gw.handoff.generate(p.request_id, p.prompt, self.spec, p.cache_salt)
        )
        gw.in_flight += 1
        timeline = Timeline(gw.metrics, None)
        outcome = "client_gone"
        try:
            async for gen in gens:
                if gen.cache is not None:
                    self.ev.cached_tokens = gen.cache.actual
                timeline.token(0, gen.finish_reason)
                step = builder.add(gen)
                yield step.text, step.token, step.finish_reason
                if step.finish_reason is not None:
                    outcome = "ok"
                    return
        except BaseException:
            outcome = "error"
            raise
        finally:
            await gens.aclose()
            gw.in_flight -= 1
            timeline.end(outcome)


def _parse(gw: Gateway, raw: bytes) -> ResponsesRequest:
    return gw.parse(ResponsesRequest, raw)


def _prepare(
    gw: Gateway, body: ResponsesRequest, request_id: str, api_key: str | None
) -> tuple[Prepared, SamplingSpec]:
    try:
        return gw.prepare("chat", json.dumps(body.chat_body()).encode(), request_id, api_key)
    except ServiceError as exc:
        raise responses_param(exc) from exc


async def create(gw: Gateway, request: Request) -> Response:
    request_id = uuid.uuid4().hex
    request_id_var.set(request_id)
    served_by = {GATEWAY_HEADER: gw.instance_id}  # which replica produces it
    try:
        api_key = gw.check_auth(request)
        raw = await gw.read_body(request)
        body = _parse(gw, raw)
        prepared, spec = _prepare(gw, body, request_id, api_key)
        await gw.check_constraint(spec)
        await gw.admit(prepared)
    except Exception as exc:
        gw.metrics.requests.labels("rejected").inc()
        return error_response(responses_param(exc) if isinstance(exc, ServiceError) else exc)
    gw.metrics.prompt_tokens.inc(len(prepared.prompt))
    source = ResponseSource(gw, body, prepared, spec)
    owned: Owned | None = None
    if body.store:
        recipe = {
            "kind": "response",
            "body": raw.decode(),
            "request_id": request_id,
            "seed": spec.seed,
            "cache_salt": prepared.cache_salt,
            "created": prepared.created,
        }
        response_id = source.ev.id
        owned = await gw.resumables.start(response_id, gw.tenant(api_key), recipe, source)
    if owned is None and body.background:
        return error_response(
            ServiceError(
                503, "background responses need the event log (Redis)", code="redis_unavailable"
            )
        )
    if body.background and not body.stream:
        if owned is not None:
            await owned.local.get()  # response.created is logged: a poll finds it
            owned.detach()  # nobody reads it here: the log holds it
        return JSONResponse(source.ev.response("in_progress"), headers=served_by)
    # background and streamed: the events as they are made, and when the client goes
    # away the response goes on (it resumes with ``starting_after``), as OpenAI's does
    if body.stream:
        events = _delivered(owned) if owned is not None else _direct(source)
        return StreamingResponse(events, media_type="text/event-stream", headers=served_by)
    last: str | None = None
    async for data in _delivered(owned) if owned is not None else _direct(source):
        last = data
    final = fold([last]) if last is not None else None
    if final is None:
        return error_response(ServiceError(502, "the response ended without an answer"))
    return JSONResponse(final, headers=served_by)


async def _delivered(owned: Owned) -> AsyncIterator[str]:
    async for item in owned.delivered():
        yield item.data if item.seq is None else f"id: {item.seq}\n{item.data}"


async def _direct(source: ResponseSource) -> AsyncIterator[str]:
    """A response kept nowhere (``store: false``): its events, tied to the connection."""
    events = source.events()
    try:
        async for ev in events:
            yield ev.data
    finally:
        await source.aclose()


async def retrieve(gw: Gateway, response_id: str, request: Request) -> Response:
    try:
        api_key = gw.check_auth(request)
        record = await checked_record(gw, response_id, KINDS, api_key)
        stream = request.query_params.get("stream", "false").lower()
        if stream not in ("true", "false"):
            raise ServiceError(
                400, "stream must be true or false", code="invalid_request", param="stream"
            )
        after = cursor(request)
        if stream == "true":
            await check_cursor(gw.resumables, record, after, "starting_after")
            return StreamingResponse(
                _followed(gw, response_id, after),
                media_type="text/event-stream",
                headers={GATEWAY_HEADER: gw.instance_id},
            )
        events = await _all_events(gw, response_id)
    except ServiceError as exc:
        return error_response(exc)
    except (RedisError, OSError) as exc:
        return error_response(
            ServiceError(503, f"the event log is unreachable: {exc}", code="redis_unavailable")
        )
    snapshot = fold(events)
    if snapshot is None:
        return error_response(
            ServiceError(404, f"No response found with id '{response_id}'", code="not_found")
        )
    if not record.finished and not await gw.resumables.log.held(response_id):
        await gw.resumables.take_over(record)  # a poll also revives an orphan
    return JSONResponse(snapshot)


async def _followed(gw: Gateway, response_id: str, after: int) -> AsyncIterator[str]:
    async for ev in gw.resumables.follow(response_id, after):
        yield f"id: {ev.seq}\n{ev.data}"


async def _all_events(gw: Gateway, response_id: str) -> list[str]:
    out: list[str] = []
    after = -1
    while batch := await gw.resumables.log.read(response_id, after, count=4096):
        out += [e.data for e in batch]
        after = batch[-1].seq
    return out


async def cancel(gw: Gateway, response_id: str, request: Request) -> Response:
    """Idempotent: cancelling a finished response returns it as it ended."""
    try:
        api_key = gw.check_auth(request)
        record = await checked_record(gw, response_id, KINDS, api_key)
        if not json.loads(record.request["body"]).get("background"):
            raise ServiceError(
                400, "only background responses can be cancelled", code="invalid_request"
            )
        if not record.finished:
            await gw.resumables.cancel(response_id)
            await _wait_finished(gw, response_id)
        snapshot = fold(await _all_events(gw, response_id))
    except ServiceError as exc:
        return error_response(exc)
    except (RedisError, OSError) as exc:
        return error_response(
            ServiceError(503, f"the event log is unreachable: {exc}", code="redis_unavailable")
        )
    if snapshot is None:
        return error_response(
            ServiceError(404, f"No response found with id '{response_id}'", code="not_found")
        )
    return JSONResponse(snapshot)


async def _wait_finished(gw: Gateway, response_id: str, timeout_s: float = 10.0) -> None:
    """Until the owner has logged the end (at its next lease renewal, or at once here);
    an orphan (no owner) is taken over, which then sees the cancel."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        record = await gw.resumables.log.record(response_id)
        if record is None or record.finished:
            return
        if not await gw.resumables.log.held(response_id):
            await gw.resumables.take_over(record)
        await gw.resumables.log.read(response_id, record.last_seq, block_ms=250)


async def delete(gw: Gateway, response_id: str, request: Request) -> Response:
    try:
        api_key = gw.check_auth(request)
        record = await checked_record(gw, response_id, KINDS, api_key)
        if not record.finished:
            await gw.resumables.cancel(response_id)
        await gw.resumables.log.delete(response_id)
    except ServiceError as exc:
        return error_response(exc)
    except (RedisError, OSError) as exc:
        return error_response(
            ServiceError(503, f"the event log is unreachable: {exc}", code="redis_unavailable")
        )
    return JSONResponse({"id": response_id, "object": "response", "deleted": True})


async def rebuild_response(
    gw: Gateway, record: ResponseRecord, tokens: list[int], attempt: int
) -> ResponseSource:
    """A stored response again, from its record and logged tokens (a take-over)."""
    req: dict[str, Any] = record.request
    body = _parse(gw, req["body"].encode())
    prepared, spec = _prepare(gw, body, req["request_id"], None)
    spec = spec.model_copy(update={"seed": req["seed"]})
    prepared = replace(prepared, cache_salt=req["cache_salt"], created=req["created"])
    source = ResponseSource(
        gw, body, prepared, spec, tokens=tokens, finish=record.finish, attempt=attempt
    )
    source.ev.cached_tokens = record.cached_tokens or 0  # as its first owner found it
    return source
