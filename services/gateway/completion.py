"""Serving one chat or completions request: admit it, start its ``n`` choices, wait for
their first tokens (so that a failure before them is a proper HTTP status), then
stream the chunks or answer once, and release everything when the request ends or
its client goes away."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from services.gateway.gateway import Gateway
from services.gateway.handoff import Generated
from services.gateway.responses import SSE_DONE, Choices, Kind, Step, sse
from services.gateway.resumable import Emitted, Owned
from services.gateway.timeline import Timeline
from shared.logs import request_id_var
from shared.serving.errors import classify, error_body, error_response
from shared.serving.protocol import BATON_REQUEST_ID_HEADER, GATEWAY_HEADER, REQUEST_ID_HEADER

log = logging.getLogger(__name__)


async def _disconnected(request: Request) -> None:
    """Returns once the client has gone (the body was already read)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


def choice_seed(seed: int, index: int) -> int:
    """Choice ``index``'s seed: the request's own for the first, distinct ones after it."""
    return seed if index == 0 else (seed + index * 0x9E3779B97F4A7C15) % (1 << 64)


async def _close_all(streams: list[AsyncGenerator[Generated, None]]) -> None:
    for stream in streams:
        await stream.aclose()


async def serve(gw: Gateway, kind: Kind, request: Request) -> Response:
    # The gateway owns request ids; a client's X-Request-Id is only echoed and logged.
    request_id = uuid.uuid4().hex
    request_id_var.set(request_id)
    client_id = request.headers.get(REQUEST_ID_HEADER)
    headers = {
        REQUEST_ID_HEADER: client_id or request_id,
        BATON_REQUEST_ID_HEADER: request_id,
        GATEWAY_HEADER: gw.instance_id,  # which replica serves it (behind a balancer)
    }
    try:
        api_key = gw.check_auth(request)
        raw = await gw.read_body(request)
        prepared, spec = gw.prepare(kind, raw, request_id, api_key)
        await gw.check_constraint(spec)
        await gw.admit(prepared)
    except Exception as exc:
        gw.metrics.requests.labels("rejected").inc()
        response = error_response(exc)
        response.headers.update(headers)
        return response
    gw.in_flight += prepared.n
    gw.metrics.prompt_tokens.inc(len(prepared.prompt))
    timeline = Timeline(gw.metrics, client_id)
    streams = [
        gw.handoff.generate(
            request_id if i == 0 else f"{request_id}n{i}",
            prepared.prompt,
            spec.model_copy(update={"seed": choice_seed(spec.seed, i)}),
            prepared.cache_salt,
        )
        for i in range(prepared.n)
    ]
    choices = Choices(prepared, gw.model.tokenizer)
    # Wait for the first tokens before answering, so that a failure before them (no
    # instance, refused prompt) is a proper HTTP status; stop if the client leaves.
    first_tasks = [asyncio.ensure_future(anext(s)) for s in streams]
    gone: asyncio.Future[Any] = asyncio.ensure_future(_disconnected(request))
    arrived: asyncio.Future[Any] = asyncio.gather(*first_tasks, return_exceptions=True)
    try:
        await asyncio.wait({gone, arrived}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
    if not all(t.done() for t in first_tasks):
        for task in first_tasks:
            task.cancel()
            with contextlib.suppress(BaseException):
                await task
        await _close_all(streams)
        gw.in_flight -= prepared.n
        timeline.end("client_gone")
        return Response(status_code=499, headers=headers)
    failed = next((t.exception() for t in first_tasks if t.exception() is not None), None)
    if failed is not None:
        await _close_all(streams)
        gw.in_flight -= prepared.n
        timeline.end("error")
        response = error_response(failed)
        response.headers.update(headers)
        return response
    firsts = [t.result() for t in first_tasks]
    for i in range(prepared.n):
        timeline.token(i, firsts[i].finish_reason)
    cache = firsts[0].cache
    if cache is not None:
        choices.cached_tokens = cache.actual
        gw.metrics.observe_cache(cache.predicted, cache.actual)
        timeline.cache = cache
    run = Run(gw, choices, firsts, streams, timeline)
    if prepared.stream and prepared.resumable:
        recipe = {
            "kind": kind,
            "body": raw.decode(),
            "request_id": request_id,
            "seed": spec.seed,
            "cache_salt": prepared.cache_salt,
            "created": prepared.created,
            # the usage a take-over reports: the prompt's KV reused here, not on its replay
            "cached_tokens": choices.cached_tokens,
        }
        owned = await gw.resumables.start(
            prepared.response_id, gw.tenant(api_key), recipe, RunSource(run)
        )
        return StreamingResponse(
            numbered(owned) if owned is not None else unlogged(run),
            media_type="text/event-stream",
            headers=headers,
        )
    if prepared.stream:
        return StreamingResponse(run.stream(), media_type="text/event-stream", headers=headers)
    return await run.whole(headers)


RESUMABLE_OFF = 'event: baton.resumable\ndata: {"resumable": false}\n\n'


async def numbered(owned: Owned) -> AsyncIterator[str]:
    """A resumable stream for the client that started it: each event with its number
    (SSE ``id``), which a reattach names (``Last-Event-ID`` or ``starting_after``).
    The client going away does not stop the response."""
    try:
        async for item in owned.delivered():
            if item.seq is None:
                yield RESUMABLE_OFF  # the log failed: what follows cannot be reattached
                yield item.data
                async for rest in owned.delivered():
                    yield rest.data
                return
            yield f"id: {item.seq}\n{item.data}"
    finally:
        owned.detach()  # gone or done: nothing more is kept for this client


async def unlogged(run: Run) -> AsyncIterator[str]:
    """A resumable stream whose log could not be opened (Redis down): an ordinary one,
    after an event that says so."""
    yield RESUMABLE_OFF
    chunks = run.stream()
    try:
        async for chunk in chunks:
            yield chunk
    finally:
        await chunks.aclose()


class RunSource:
    """A request's run as the source of a resumable response's events."""

    def __init__(self, run: Run):
        self.run = run
        self._events: AsyncGenerator[Emitted, None] | None = None

    def events(self) -> AsyncIterator[Emitted]:
        self._events = self.run.events()
        return self._events

    def cancelled(self) -> Emitted:
        body = sse(error_body(499, "the response was cancelled", "cancelled"))
        return Emitted(body + SSE_DONE, status="cancelled")

    async def aclose(self) -> None:
        if self._events is not None:
            await self._events.aclose()
        else:
            await self.run.close()


class Run:
    """One admitted request whose first tokens are in: its steps, streamed or whole."""

    def __init__(
        self,
        gw: Gateway,
        choices: Choices,
        firsts: list[Generated],
        streams: list[AsyncGenerator[Generated, None]],
        timeline: Timeline,
    ):
        self.gw = gw
        self.choices = choices
        self.firsts = firsts
        self.streams = streams
        self.timeline = timeline
        self._finished = False

    async def _steps(self, index: int) -> AsyncIterator[Step]:
        builder = self.choices.builders[index]
        step = builder.add(self.firsts[index])
        yield step
        while step.finish_reason is None:
            gen = await anext(self.streams[index])
            self.timeline.token(index, gen.finish_reason)
            step = builder.add(gen)
            yield step

    def _all_steps(self) -> AsyncIterator[tuple[int, Step]]:
        if len(self.streams) == 1:
            return _indexed(self._steps(0))
        return merge([self._steps(i) for i in range(len(self.streams))])

    async def _finish(self, outcome: str) -> None:
        if self._finished:
            return
        self._finished = True
        await _close_all(self.streams)
        self.gw.in_flight -= len(self.streams)
        self.timeline.end(outcome)

    async def close(self) -> None:
        """Ends a run whose events were never read."""
        await self._finish("client_gone")

    async def events(self) -> AsyncGenerator[Emitted, None]:
        """The stream's events, each with the token ids it is the first to show (a
        chunk held back, e.g. a possible stop string, passes its tokens on)."""
        outcome = "client_gone"
        builders = self.choices.builders
        pending: list[int] = []
        try:
            try:
                async for index, step in self._all_steps():
                    pending.append(step.token)
                    chunk = builders[index].chunk(step)
                    if chunk:
                        yield Emitted(chunk, tuple(pending), step.finish_reason)
                        pending = []
                    if step.finish_reason is not None:
                        finish = step.finish_reason if pending else None
                        yield Emitted(builders[index].final_chunk(), tuple(pending), finish)
                        pending = []
                if self.choices.p.include_usage:
                    yield Emitted(self.choices.usage_chunk())
                outcome = "ok"
                last = Emitted(SSE_DONE, status="completed")
            except (Exception, StopAsyncIteration) as exc:
                err = classify(exc if isinstance(exc, Exception) else RuntimeError("stream ended"))
                log.warning("stream failed: %s", err)
                outcome = "error"
                body = sse(error_body(err.status, str(err), err.code))
                last = Emitted(body + SSE_DONE, status="failed")
            yield last
        finally:
            await self._finish(outcome)

    async def stream(self) -> AsyncGenerator[str, None]:
        events = self.events()
        try:
            async for event in events:
                yield event.data
        finally:
            await events.aclose()  # now, not when collected: the workers stop at once

    async def whole(self, headers: dict[str, str]) -> Response:
        outcome = "error"
        steps: list[list[Step]] = [[] for _ in self.streams]
        try:
            async for index, step in self._all_steps():
                steps[index].append(step)
            outcome = "ok"
            return JSONResponse(self.choices.response(steps), headers=headers)
        except Exception as exc:
            response = error_response(exc)
            response.headers.update(headers)
            return response
        finally:
            await self._finish(outcome)


async def _indexed(steps: AsyncIterator[Step]) -> AsyncIterator[tuple[int, Step]]:
    async for step in steps:
        yield 0, step


async def merge(iterators: list[AsyncIterator[Step]]) -> AsyncIterator[tuple[int, Step]]:
    """Items of several iterators as they arrive, each with its iterator's index; an
    iterator's error ends the merge (the others are cancelled)."""
    pending: dict[asyncio.Future[Step], int] = {
        asyncio.ensure_future(anext(it)): i for i, it in enumerate(iterators)
    }
    try:
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in sorted(done, key=pending.__getitem__):
                index = pending.pop(task)
                try:
                    item = task.result()
                except StopAsyncIteration:
                    continue
                yield index, item
                pending[asyncio.ensure_future(anext(iterators[index]))] = index
    finally:
        for task in pending:
            task.cancel()
        for task in pending:
            with contextlib.suppress(BaseException):
                await task
