"""What the engine hands back: a step's output per request, and a finished request.

Plain values, safe to pass to other threads: nothing here refers to the engine's
live state.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from shared.engine.request import CacheHit, FinishReason, RequestId, TokenLogprobs


@dataclass
class RequestTimings:
    arrival: float
    admitted: float | None = None  # it first got KV slots
    scheduled: float | None = None  # its first step began
    first_token: float | None = None
    finished: float | None = None


@dataclass(frozen=True)
class RequestOutput:
    """What one step produced for one request."""

    request_id: RequestId
    new_token_ids: list[int]
    new_text: str
    new_logprobs: list[TokenLogprobs]
    finished: bool
    finish_reason: FinishReason | None
    num_prompt_tokens: int
    num_output_tokens: int
    cache_hit: CacheHit
    timings: RequestTimings | None = None  # set on the finishing output

    @property
    def num_cached_tokens(self) -> int:
        return self.cache_hit.tokens


@dataclass(frozen=True)
class Completion:
    """A finished request, as :meth:`Engine.generate` returns it."""

    request_id: RequestId
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    logprobs: list[TokenLogprobs]
    finish_reason: FinishReason
    num_cached_tokens: int
    timings: RequestTimings = field(compare=False)
