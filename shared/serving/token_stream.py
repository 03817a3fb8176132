"""A request's engine outputs as the NDJSON events a worker streams."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from shared.engine.engine_loop import Output, next_output
from shared.engine.outputs import RequestTimings
from shared.engine.request import CacheHit, TokenLogprobs
from shared.serving.protocol import TokenEvent, WaitingEvent, WireToken

# a decode stream silent this long while its engine makes progress says so (a keepalive:
# the gateway takes a stream silent for a few of these as hung, and resumes it elsewhere)
WAITING_EVENT_S = 0.25
# a step running longer than this is not progress (a stuck engine thread)
STEP_HANG_S = 30.0


@dataclass
class TokenStream:
    """Turns a request's engine outputs into ``token`` events; remembers how it ended."""

    generated: int = 0
    finish_reason: str | None = None
    timings: RequestTimings | None = None  # the engine's, once finished
    cache_hit: CacheHit | None = None  # prompt tokens not computed here (first output)

    async def events(
        self,
        outputs: asyncio.Queue[Output],
        steps: Callable[[], int] | None = None,
        working: Callable[[], bool] | None = None,
    ) -> AsyncIterator[TokenEvent | WaitingEvent]:
        """Raises :class:`~shared.engine.engine_loop.StreamInterrupted` when the loop
        interrupted the request. With ``steps`` (the engine's step count), a request
        that gets no token for :data:`WAITING_EVENT_S` while the engine makes progress
        (its step count grew, or ``working``: progress no step shows yet, such as a
        step begun less than :data:`STEP_HANG_S` ago (a long prompt chunk) or this
        request's KV load in flight, which its connector's timeouts bound) yields a
        ``waiting`` event; a stuck engine yields none."""
        seen = steps() if steps is not None else 0
        while self.finish_reason is None:
            if steps is None:
                out = await next_output(outputs)
            else:
                try:
                    out = await asyncio.wait_for(next_output(outputs), WAITING_EVENT_S)
                except TimeoutError:
                    now = steps()
                    if now > seen or (working is not None and working()):
                        seen = now
                        yield WaitingEvent(steps=now)
                    continue
            self.generated = out.num_output_tokens
            if self.cache_hit is None:
                self.cache_hit = out.cache_hit
            lps: list[TokenLogprobs | None] = list(out.new_logprobs)
            lps += [None] * (len(out.new_token_ids) - len(lps))
            for i, (tid, lp) in enumerate(zip(out.new_token_ids, lps, strict=True)):
                last = out.finished and i == len(out.new_token_ids) - 1
                reason = out.finish_reason if last else None
                yield TokenEvent(
                    token=WireToken.of(tid, lp),
                    finish_reason=reason.value if reason is not None else None,
                )
            if out.finished:
                self.finish_reason = out.finish_reason.value if out.finish_reason else "abort"
                self.timings = out.timings
