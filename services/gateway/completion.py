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
from services.gateway.timeline import Timeline
from shared.logs import request_id_var
from shared.serving.errors import classify, error_body, error_response
from shared.serving.protocol import BATON_REQUEST_ID_HEADER, REQUEST_ID_HEADER

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
    headers = {REQUEST_ID_HEADER: client_id or request_id, BATON_REQUEST_ID_HEADER: request_id}
    try:
        api_key = gw.check_auth(request)
        prepared, spec = gw.prepare(kind, await gw.read_body(request), request_id, api_key)
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
    if prepared.stream:
        return StreamingResponse(run.stream(), media_type="text/event-stream", headers=headers)
    return await run.whole(headers)


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
        await _close_all(self.streams)
        self.gw.in_flight -= len(self.streams)
        self.timeline.end(outcome)

    async def stream(self) -> AsyncIterator[str]:
        outcome = "client_gone"
        builders = self.choices.builders
        try:
            try:
                async for index, step in self._all_steps():
                    chunk = builders[index].chunk(step)
                    if chunk:
                        yield chunk
                    if step.finish_reason is not None:
                        yield builders[index].final_chunk()
                if self.choices.p.include_usage:
                    yield self.choices.usage_chunk()
                outcome = "ok"
            except (Exception, StopAsyncIteration) as exc:
                err = classify(exc if isinstance(exc, Exception) else RuntimeError("stream ended"))
                log.warning("stream failed: %s", err)
                outcome = "error"
                yield sse(error_body(err.status, str(err), err.code))
            yield SSE_DONE
        finally:
            await self._finish(outcome)

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
