"""An immutable picture of an engine between two steps, for other threads to read."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from shared.engine.request import RequestId
from shared.engine.swap import Swapper, SwapStats

if TYPE_CHECKING:
    from shared.engine.scheduler import Scheduler


@dataclass(frozen=True)
class EngineSnapshot:
    steps: int = 0  # steps that computed tokens
    waiting: int = 0  # queued for slots or for compute
    running: int = 0
    loading: int = 0  # asynchronous KV loads in flight
    parked: int = 0  # prefilled elsewhere, waiting for their first token
    pending_tokens: int = 0  # tokens of queued and running requests not yet computed
    free_slots: int = 0
    num_slots: int = 1
    cached_blocks: int = 0  # blocks findable by key in the local pool
    requests: frozenset[RequestId] = frozenset()
    preemptions: int = 0  # so far, swapped or recomputed
    swap: SwapStats = field(default_factory=SwapStats)  # a copy: how they were served
    # per queued or running request: tokens not yet computed (``pending_tokens`` split)
    pending_by_request: Mapping[RequestId, int] = field(default_factory=dict)
    waiting_ids: frozenset[RequestId] = frozenset()  # the ``waiting`` ones

    @classmethod
    def of(cls, s: Scheduler, swapper: Swapper | None, *, steps: int) -> EngineSnapshot:
        kv = s.kv
        queued = [*s.queues.waiting, *s.queues.running]
        pending = {r.request_id: r.num_tokens - r.num_computed_tokens for r in queued}
        return cls(
            steps=steps,
            waiting=len(s.queues.waiting),
            running=len(s.queues.running),
            loading=len(s.loads.loading),
            parked=len(s.queues.parked),
            pending_tokens=sum(pending.values()),
            free_slots=kv.num_free,
            num_slots=kv.num_slots,
            cached_blocks=kv.num_cached,
            requests=frozenset(s.queues.requests),
            preemptions=s.preemption.num_preemptions,
            swap=replace(swapper.stats) if swapper is not None else SwapStats(),
            pending_by_request=pending,
            waiting_ids=frozenset(r.request_id for r in s.queues.waiting),
        )

    @property
    def prompt_pending(self) -> bool:
        """Whether a prompt (or a recompute) is being computed here: a request with more
        than the one token a running stream feeds per step still to compute."""
        return any(n > 1 for n in self.pending_by_request.values())

    @property
    def usage(self) -> float:
        """Share of the KV pool's slots that requests hold."""
        return 1.0 - self.free_slots / self.num_slots
