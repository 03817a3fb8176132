"""What the scheduler decided for one step: the model runner, the KV connector and
the swapper read it; only the scheduler makes it."""

from __future__ import annotations

from dataclasses import dataclass, field

from shared.engine.request import Request, RequestId
from shared.engine.swap import SwapPlan


@dataclass(frozen=True)
class ScheduledRequest:
    request: Request
    num_new_tokens: int  # computed this step, from request.num_computed_tokens on

    @property
    def samples(self) -> bool:
        """Whether this step reaches the request's last known token (so it samples)."""
        return self.request.num_computed_tokens + self.num_new_tokens == self.request.num_tokens


@dataclass(frozen=True)
class SchedulerOutput:
    scheduled: tuple[ScheduledRequest, ...]
    preempted: tuple[RequestId, ...]
    swaps: SwapPlan = field(default_factory=SwapPlan)  # run before the forward

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled
