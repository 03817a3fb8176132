"""A reference client for resumable streams: what a client of Baton does so that a dead
gateway costs it nothing but a pause.

It opens a completion stream with ``stream_options.resumable`` and reads its numbered
events (``id: N``). When the connection breaks or ends before ``[DONE]`` (its gateway
died or drained), it reconnects through the same URL (the balancer in front of every
gateway) with ``Last-Event-ID`` set to the last event it read, retrying refused
connections and 502/503 answers until ``reconnect_s`` has passed, and goes on from
the events it had not seen. Recorded: the tokens, when each arrived, and each
break's resume gap (from noticing the break to the next event).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import httpx

from shared.bench.chaos import ChaosRequest
from shared.serving.protocol import GATEWAY_HEADER

RETRY_S = 0.05  # between reconnection attempts
RETRIED_STATUS = frozenset({502, 503})  # the balancer had no live gateway for a moment


@dataclass
class ResumedStream:
    request: ChaosRequest
    started: float
    response_id: str | None = None
    owner: str | None = None  # the gateway that started it
    tokens: list[int] = field(default_factory=list)
    stamps: list[float] = field(default_factory=list)  # perf_counter of each token
    last_seq: int = -1
    gaps: list[float] = field(default_factory=list)  # per break: to the next event
    error: str | None = None
    ended: float = 0.0


class _Broken(Exception):
    """The stream ended before its last event."""


async def resumable_stream(
    http: httpx.AsyncClient,
    url: str,
    model: str,
    req: ChaosRequest,
    *,
    reconnect_s: float = 30.0,
) -> ResumedStream:
    """``req`` streamed to its end across any number of broken connections."""
    return await read_resumable(
        http, url, model, ResumedStream(req, time.perf_counter()), reconnect_s=reconnect_s
    )


async def read_resumable(
    http: httpx.AsyncClient,
    url: str,
    model: str,
    out: ResumedStream,
    *,
    reconnect_s: float = 30.0,
) -> ResumedStream:
    """``out.request`` streamed into ``out`` (which others may watch meanwhile) to its
    end, across any number of broken connections."""
    body = out.request.body(model) | {"stream_options": {"resumable": True}}
    broke_at: float | None = None
    try:
        async with http.stream("POST", url + "/v1/completions", json=body) as r:
            if r.status_code != 200:
                out.error = f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
                return out
            out.owner = r.headers.get(GATEWAY_HEADER)
            if await _read(r, out, None):
                return out
            raise _Broken
    except (httpx.HTTPError, _Broken) as exc:
        if out.response_id is None:
            out.error = f"broken before its first event: {exc!r}"
            return out
        broke_at = time.perf_counter()
    finally:
        out.ended = time.perf_counter()
    while True:
        resumed = len(out.gaps)
        try:
            await _reattach(http, url, out, broke_at)
        except (httpx.HTTPError, _Broken) as exc:
            now = time.perf_counter()
            if len(out.gaps) > resumed:  # it went on, then broke again: a new break
                broke_at = now
            elif now - broke_at > reconnect_s:
                out.error = f"could not resume within {reconnect_s:.0f} s: {exc!r}"
                out.ended = now
                return out
            await asyncio.sleep(RETRY_S)
            continue
        out.ended = time.perf_counter()
        return out


async def _reattach(http: httpx.AsyncClient, url: str, out: ResumedStream, broke_at: float) -> None:
    """One reconnection, read to the stream's last event (raises where it breaks)."""
    path = f"{url}/v1/completions/{out.response_id}/stream"
    headers = {"Last-Event-ID": str(out.last_seq)}
    async with http.stream("GET", path, headers=headers) as r:
        if r.status_code in RETRIED_STATUS:
            raise _Broken(f"HTTP {r.status_code}")
        if r.status_code != 200:
            text = (await r.aread())[:200]
            raise httpx.HTTPStatusError(f"HTTP {r.status_code}: {text!r}", request=r.request,
                                        response=r)  # fmt: skip
        if await _read(r, out, broke_at):
            return
    raise _Broken("ended before its last event")


async def _read(r: httpx.Response, out: ResumedStream, broke_at: float | None) -> bool:
    """Events of ``r`` into ``out``; True at ``[DONE]``. The first event after a break
    closes that break's gap."""
    async for seq, data in _events(r.aiter_lines()):
        if seq is not None and seq <= out.last_seq:
            continue  # the log's copy of an event already read (never expected)
        if broke_at is not None:
            out.gaps.append(time.perf_counter() - broke_at)
            broke_at = None
        if seq is not None:
            out.last_seq = seq
        if data == "[DONE]":
            return True
        chunk = json.loads(data)
        if "error" in chunk:
            raise _Broken(str(chunk["error"]))
        out.response_id = out.response_id or chunk.get("id")
        now = time.perf_counter()
        for choice in chunk.get("choices", []):
            ids = choice.get("token_ids") or []
            out.tokens += ids
            out.stamps += [now] * len(ids)
    return False


async def _events(lines: AsyncIterator[str]) -> AsyncIterator[tuple[int | None, str]]:
    seq: int | None = None
    data: list[str] = []
    async for line in lines:
        if line.startswith("id: "):
            seq = int(line[4:])
        elif line.startswith("data: "):
            data.append(line[6:])
        elif line == "" and data:
            yield seq, "\n".join(data)
            seq, data = None, []
