"""A worker stream over real HTTP (uvicorn serving a small Starlette app, httpx as the
gateway uses it): a stream read to its end gives its connection back to the pool, so
the next request does not open a new one."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import httpx
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.routing import Route

from services.gateway.worker_stream import open_stream
from shared.procs import free_port
from shared.serving.protocol import Accepted, Committed, encode_event


async def _events(linger_s: float) -> AsyncIterator[bytes]:
    yield encode_event(Accepted(instance_id="p"))
    yield encode_event(Committed(exposed_transfer_s=0.0))
    await asyncio.sleep(linger_s)  # a worker that keeps its stream open past its last event


def _app(connections: set[tuple[str, int]]) -> Starlette:
    async def prefill(request: Request) -> StreamingResponse:
        assert request.client is not None
        connections.add((request.client.host, request.client.port))
        linger = float(request.query_params.get("linger", "0"))
        return StreamingResponse(_events(linger), media_type="application/x-ndjson")

    return Starlette(routes=[Route("/v1/prefill", prefill, methods=["POST"])])


@contextlib.asynccontextmanager
async def serving(connections: set[tuple[str, int]]) -> AsyncIterator[str]:
    """The app on a free port for the block; yields its prefill URL."""
    config = uvicorn.Config(_app(connections), port=free_port(), log_level="warning")
    server = uvicorn.Server(config)
    task = asyncio.create_task(server.serve())
    try:
        while not server.started:
            await asyncio.sleep(0.01)
        yield f"http://127.0.0.1:{config.port}/v1/prefill"
    finally:
        server.should_exit = True
        await task


def test_a_stream_read_to_its_end_leaves_its_connection_for_the_next_request() -> None:
    async def main() -> None:
        connections: set[tuple[str, int]] = set()
        async with serving(connections) as url, httpx.AsyncClient() as http:
            for i in range(3):
                stream = await open_stream(http, url, "{}", f"r{i}", "prefill")
                assert (await stream.next()).event == "accepted"
                assert (await stream.next()).event == "committed"
                assert await stream.ended(5.0)
                await stream.aclose()
            assert len(connections) == 1
            # closed halfway (the worker still streaming): that connection is dropped
            stream = await open_stream(http, url + "?linger=30", "{}", "r3", "prefill")
            await stream.next()
            await stream.next()
            assert not await stream.ended(0.2)
            await stream.aclose()
            stream = await open_stream(http, url, "{}", "r4", "prefill")
            await stream.next()
            await stream.aclose()
            assert len(connections) == 2

    asyncio.run(main())


def test_ended_after_the_stream_ended_is_immediate() -> None:
    async def main() -> None:
        async with serving(set()) as url, httpx.AsyncClient() as http:
            stream = await open_stream(http, url, "{}", "r", "prefill")
            assert await stream.ended(5.0)
            assert await stream.ended(0.0)  # the reader is done: no wait
            await stream.aclose()

    asyncio.run(main())
