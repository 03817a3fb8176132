"""Reattaching to a resumable response, and continuing one whose gateway died.

``GET /v1/chat/completions/{id}/stream`` (and ``/v1/completions/{id}/stream``) sends
the events after the cursor: the ``Last-Event-ID`` header when given (it wins over
the query, as in Mercure), else ``starting_after`` (-1 or absent: from the first).
Unknown id, or another API key's: 404 (never leaked); a cursor past the log: 400;
a cursor the log no longer covers: 410.

A response whose owner died is continued by whichever gateway a client reattaches
to (:meth:`services.gateway.resumable.Resumables.take_over`): :func:`rebuild_run`
replays the logged token ids through a fresh response builder and then continues
with new tokens from a decode instance, which recomputes the prompt and the tokens
so far (sampling is keyed by seed and position: the same tokens).
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import replace

from fastapi import Request
from fastapi.responses import Response, StreamingResponse
from redis.exceptions import RedisError

from services.gateway.completion import Run, RunSource
from services.gateway.gateway import Gateway
from services.gateway.handoff import Generated
from services.gateway.responses import Choices, Prepared
from services.gateway.resumable import Resumables
from services.gateway.timeline import Timeline
from shared.cluster.event_log import ResponseRecord
from shared.serving.errors import ServiceError, error_response
from shared.serving.protocol import SamplingSpec, WireToken


def cursor(request: Request) -> int:
    """The last event the client has (-1: none)."""
    header = request.headers.get("last-event-id")
    raw, param = (
        (header, "Last-Event-ID") if header is not None else
        (request.query_params.get("starting_after"), "starting_after")
    )  # fmt: skip
    if raw is None or raw == "":
        return -1
    try:
        value = int(raw)
    except ValueError:
        raise ServiceError(
            400, f"{param} must be an event sequence number", code="invalid_request", param=param
        ) from None
    if value < -1:
        raise ServiceError(400, f"{param} must be >= -1", code="invalid_request", param=param)
    return value


async def checked_record(
    gw: Gateway, response_id: str, kinds: tuple[str, ...], api_key: str | None
) -> ResponseRecord:
    """The record of a response this caller may read; 404 otherwise."""
    try:
        record = await gw.resumables.log.record(response_id)
    except (RedisError, OSError) as exc:
        raise ServiceError(
            503, f"the event log is unreachable: {exc}", code="redis_unavailable"
        ) from exc
    if (
        record is None
        or record.request.get("kind") not in kinds
        or record.tenant != (gw.tenant(api_key) or "")
    ):
        raise ServiceError(404, f"No response found with id '{response_id}'", code="not_found")
    return record


async def check_cursor(
    resumables: Resumables, record: ResponseRecord, after: int, param: str
) -> None:
    if after > record.last_seq:
        raise ServiceError(
            400,
            f"{param} {after} is past the last event ({record.last_seq})",
            code="invalid_request",
            param=param,
        )
    first = await resumables.log.first_seq(record.response_id)
    expired = first is not None and after < first - 1
    if expired or (record.truncated and after >= record.last_seq):
        raise ServiceError(
            410,
            f"events after {after} of {record.response_id} are no longer kept",
            code="cursor_expired",
            param=param,
        )


async def reattach(
    gw: Gateway, kinds: tuple[str, ...], response_id: str, request: Request
) -> Response:
    try:
        api_key = gw.check_auth(request)
        after = cursor(request)
        record = await checked_record(gw, response_id, kinds, api_key)
        param = "Last-Event-ID" if "last-event-id" in request.headers else "starting_after"
        await check_cursor(gw.resumables, record, after, param)
    except ServiceError as exc:
        return error_response(exc)
    return StreamingResponse(
        _numbered(gw.resumables, response_id, after), media_type="text/event-stream"
    )


async def _numbered(resumables: Resumables, response_id: str, after: int) -> AsyncIterator[str]:
    async for ev in resumables.follow(response_id, after):
        yield f"id: {ev.seq}\n{ev.data}"


async def rebuild_run(
    gw: Gateway, record: ResponseRecord, tokens: list[int], attempt: int
) -> RunSource:
    """A chat or completions response again, from its record and logged tokens."""
    req = record.request
    prepared, spec = gw.prepare(req["kind"], req["body"].encode(), req["request_id"], None)
    spec = spec.model_copy(update={"seed": req["seed"]})
    prepared = replace(prepared, cache_salt=req["cache_salt"], created=req["created"])
    gens = regenerate(gw, prepared, spec, tokens, record.finish, attempt)
    first = await anext(gens)
    gw.in_flight += 1
    choices = Choices(prepared, gw.model.tokenizer)
    choices.cached_tokens = int(req.get("cached_tokens") or 0)  # as the first owner found it
    run = Run(gw, choices, [first], [gens], Timeline(gw.metrics, None))
    return RunSource(run)


async def regenerate(
    gw: Gateway,
    prepared: Prepared,
    spec: SamplingSpec,
    tokens: list[int],
    finish: str | None,
    attempt: int,
) -> AsyncGenerator[Generated, None]:
    """The logged tokens (replayed), then new ones from where they end."""
    for i, token in enumerate(tokens):
        yield Generated(WireToken(id=token), finish if i == len(tokens) - 1 else None)
    if finish is not None:
        return
    rid, prompt, salt = prepared.request_id, prepared.prompt, prepared.cache_salt
    more = (
        gw.handoff.resume(rid, prompt, spec, salt, tokens, attempt)
        if tokens
        else gw.handoff.generate(f"{rid}g{attempt}", prompt, spec, salt)
    )
    try:
        async for gen in more:
            yield gen
    finally:
        await more.aclose()
