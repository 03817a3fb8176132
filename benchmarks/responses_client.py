"""The official OpenAI SDK reading a background Responses API stream across dead gateways:
what a client written against OpenAI's own API does, unchanged, against Baton.

It starts ``responses.create(background=True, stream=True)`` through the balancer
and reads the numbered events. When the connection breaks or ends before a terminal
event (its gateway died), it resumes with ``responses.stream(response_id=...,
starting_after=<last sequence number>)`` through the same balancer, retrying refused
connections and 502/503 answers until ``reconnect_s`` has passed. Recorded: the
text, the events' sequence numbers (each seen once, in order), the gateway that
started it and each break's gap (noticing it to the next event).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

import httpx
import openai
from openai import AsyncOpenAI

from shared.bench.resume_client import RETRY_S
from shared.serving.protocol import GATEWAY_HEADER

TERMINAL = ("response.completed", "response.incomplete", "response.failed")
RETRIED = (openai.APIConnectionError, openai.InternalServerError, httpx.HTTPError)


@dataclass(frozen=True)
class ResponsesCase:
    """One request: text in, greedy (``seed`` None) or seeded sampling."""

    input: str
    max_output_tokens: int
    seed: int | None

    def params(self) -> dict[str, Any]:
        sampling: dict[str, Any] = (
            {"temperature": 0.0}
            if self.seed is None
            else {"temperature": 0.8, "top_p": 0.95, "extra_body": {"seed": self.seed}}
        )
        return {"input": self.input, "max_output_tokens": self.max_output_tokens, **sampling}


@dataclass
class ResumedResponse:
    case: ResponsesCase
    response_id: str | None = None
    owner: str | None = None  # the gateway that started it
    text: str = ""
    seqs: list[int] = field(default_factory=list)
    status: str | None = None  # the terminal event's response status
    output_tokens: int | None = None
    gaps: list[float] = field(default_factory=list)
    error: str | None = None

    @property
    def last_seq(self) -> int:
        return self.seqs[-1] if self.seqs else -1


class _Broken(Exception):
    """The stream ended before its terminal event."""


async def read_response(
    client: AsyncOpenAI, model: str, out: ResumedResponse, *, reconnect_s: float = 30.0
) -> ResumedResponse:
    """``out.case`` streamed into ``out`` (others may watch it meanwhile) to its end."""
    broke_at: float | None = None
    try:
        raw = await client.responses.with_raw_response.create(
            model=model, background=True, stream=True, **out.case.params()
        )
        out.owner = raw.headers.get(GATEWAY_HEADER)
        if await _read(raw.parse(), out, None):
            return out
        raise _Broken("ended before its terminal event")
    except (*RETRIED, _Broken) as exc:
        if out.response_id is None:
            out.error = f"broken before its first event: {exc!r}"
            return out
        broke_at = time.perf_counter()
    while True:
        resumed = len(out.gaps)
        try:
            async with client.responses.stream(
                response_id=out.response_id, starting_after=out.last_seq
            ) as stream:
                if await _read(stream, out, broke_at):
                    return out
            raise _Broken("ended before its terminal event")
        except (*RETRIED, _Broken) as exc:
            now = time.perf_counter()
            if len(out.gaps) > resumed:  # it went on, then broke again: a new break
                broke_at = now
            elif now - broke_at > reconnect_s:
                out.error = f"could not resume within {reconnect_s:.0f} s: {exc!r}"
                return out
            await asyncio.sleep(RETRY_S)


async def _read(events: Any, out: ResumedResponse, broke_at: float | None) -> bool:
    """Events into ``out``; True at the terminal one. The first event after a break
    closes that break's gap."""
    async for event in events:
        seq = event.sequence_number
        if seq <= out.last_seq:
            out.error = f"event {seq} again after {out.last_seq}"
            return True
        if broke_at is not None:
            out.gaps.append(time.perf_counter() - broke_at)
            broke_at = None
        if seq != out.last_seq + 1:
            out.error = f"event {seq} after {out.last_seq}: events missing"
            return True
        out.seqs.append(seq)
        if event.type == "response.created":
            out.response_id = event.response.id
        elif event.type == "response.output_text.delta":
            out.text += event.delta
        elif event.type in TERMINAL:
            out.status = event.response.status
            usage = event.response.usage
            out.output_tokens = usage.output_tokens if usage is not None else None
            return True
    return False
