"""A worker's NDJSON event stream, read by a background task into a queue, so the
gateway can wait for the next event with a timeout (to notice a hung instance)
without ever cancelling a read halfway through a line."""

from __future__ import annotations

import asyncio
import contextlib
import json

import httpx

from shared.serving.errors import ServiceError
from shared.serving.protocol import REQUEST_ID_HEADER, ErrorEvent, Event, decode_event

LOST = "worker_lost"
DRAINING = "draining"
CLIENT_ERRORS = ("invalid_request", "context_length_exceeded")


class WorkerStream:
    """Events from one worker; ``aclose`` ends the connection (cancelling the work)."""

    def __init__(self, response: httpx.Response, who: str):
        self.response = response
        self.who = who
        self._events: asyncio.Queue[Event | ServiceError] = asyncio.Queue()
        self._reader = asyncio.create_task(self._read(), name=f"read:{who}")

    async def _read(self) -> None:
        try:
            async for line in self.response.aiter_lines():
                self._events.put_nowait(decode_event(line))
            end = ServiceError(502, f"{self.who} ended its stream early", code=LOST, who=self.who)
        except (httpx.HTTPError, httpx.StreamError) as exc:
            end = ServiceError(502, f"{self.who} connection lost: {exc}", code=LOST, who=self.who)
        except ValueError as exc:  # not an event: a broken worker
            end = ServiceError(502, f"{self.who} sent garbage: {exc}", code=LOST, who=self.who)
        self._events.put_nowait(end)

    async def next(self, timeout_s: float | None = None) -> Event:
        """The next event; raises ServiceError for an error event or a lost stream, and
        TimeoutError when none came within ``timeout_s`` (the stream stays usable)."""
        item = await asyncio.wait_for(self._events.get(), timeout_s)
        if isinstance(item, ServiceError):
            self._events.put_nowait(item)  # every later call sees the end too
            raise item
        if isinstance(item, ErrorEvent):
            status = 400 if item.code in CLIENT_ERRORS else 502
            raise ServiceError(status, f"{self.who}: {item.message}", code=item.code)
        return item

    async def ended(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` for the worker to end the stream (after its last
        event); whether it did. A response read to its end hands its connection back to
        the pool, where one closed halfway through is dropped: the next request would
        then open a new TCP connection, and the worker accept it, on its way in."""
        try:
            await asyncio.wait_for(asyncio.shield(self._reader), timeout_s)
        except TimeoutError:
            return False
        return True

    async def aclose(self) -> None:
        self._reader.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._reader
        await self.response.aclose()


async def open_stream(
    http: httpx.AsyncClient, url: str, body: str, request_id: str, who: str
) -> WorkerStream:
    """POST and wait for the response head; a refusal becomes a ServiceError with the
    worker's status, message and code."""
    request = http.build_request(
        "POST",
        url,
        content=body,
        headers={"content-type": "application/json", REQUEST_ID_HEADER: request_id},
    )
    response = await http.send(request, stream=True)
    if response.status_code != 200:
        raw = await response.aread()
        await response.aclose()
        try:
            err = json.loads(raw)["error"]
            message, code = str(err["message"]), err.get("code")
        except (ValueError, KeyError, TypeError):
            message, code = raw.decode(errors="replace")[:500], None
        status = response.status_code if response.status_code in (400, 413, 422, 429) else 503
        raise ServiceError(400 if status == 422 else status, f"{who}: {message}", code=code)
    return WorkerStream(response, who)
