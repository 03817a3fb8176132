"""FCFS continuous-batching scheduler with chunked prefill, prefix reuse and preemption.

Pure Python: it decides, per step, how many new tokens of which request are
computed. Slots come from the :class:`KVCacheManager`; KV from outside comes
through the :class:`KVConnector`. Running requests go first (decodes and
unfinished prompt chunks); then waiting requests holding loaded KV continue,
ahead of those that still need slots; then waiting requests are admitted in
arrival order (:class:`~shared.engine.admission.Admission`) while the token
budget, the sequence limit and free slots allow. With
``long_prefill_token_threshold`` no request's prompt chunk exceeds it, which
leaves budget for the prompts queued behind a long one. A request whose next
uncached block is being computed right now by a running request waits (it is
passed over, not blocking the queue) until that block is cached, rather than
computing a copy. A load that fails sends the request back to recompute: a stale
cache costs time, never tokens.

When a running request needs a slot and none is free, requests holding loaded
KV idle in the queue give theirs up first (the cheapest to load again), then
the latest-arrived running request is preempted and waits at the front of the
queue; a request preempts itself only when no other is left. When nothing runs
and the loaded requests in the queue cannot grow, the latest give their slots
up until the first can go on. Every preempted request's KV is handled alike
(:class:`~shared.engine.preemption.Preemption`): with a
:class:`~shared.engine.swap.Swapper` its blocks are copied to host memory when
the cost model finds that cheaper than recomputing them, and copied back when it
resumes; when the host space is full it spills: the connector keeps its KV (in
the KV store) and offers it as a load when the request is admitted again.
Otherwise its slots go back (still findable by key, so resuming may re-hit
them) and it recomputes.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Set

from shared.config import SchedulerConfig
from shared.engine.admission import Admission
from shared.engine.kv_cache_manager import KVCacheManager
from shared.engine.kv_connector import ConnectorEvents, KVConnector
from shared.engine.kv_loads import KVLoads
from shared.engine.limits import RequestLimits
from shared.engine.preemption import Preemption
from shared.engine.request import (
    CacheHit,
    FinishReason,
    Request,
    RequestId,
    RequestStatus,
    SampledToken,
)
from shared.engine.request_queues import RequestQueues
from shared.engine.scheduler_output import ScheduledRequest, SchedulerOutput
from shared.engine.swap import Swapper
from shared.errors import InvalidRequestError
from shared.kv.block_hash import BlockKey

log = logging.getLogger(__name__)


class Scheduler:
    def __init__(
        self,
        config: SchedulerConfig,
        kv: KVCacheManager,
        *,
        max_model_len: int,
        eos_token_ids: tuple[int, ...],
        connector: KVConnector | None = None,
        swapper: Swapper | None = None,
    ):
        self.config = config
        self.kv = kv
        self.connector = connector
        window_part = kv.window_part if kv.part_size else None
        self.preemption = Preemption(swapper, connector, kv.block_size, window_part)
        self.loads = KVLoads(connector, kv.block_size)  # asynchronous loads in flight
        chunk = config.max_num_batched_tokens
        self.limits = RequestLimits(
            max_model_len,
            kv.block_size,
            kv.num_slots,
            eos_token_ids,
            (lambda n: kv.max_slots(n, chunk)) if kv.part_size else None,
        )
        self.queues = RequestQueues()
        self.admission = Admission(config, kv, self.queues, self.loads, self.preemption)

    def set_threads(self, n: int) -> None:
        """The threads the next steps compute on (a lone prompt's chunks grow with them)."""
        self.admission.threads = n

    # -- arrivals ------------------------------------------------------------
    def add(self, req: Request) -> None:
        self.limits.check_fits(req.num_prompt_tokens, req.params.max_tokens)
        self.queues.add(req)

    def supply_first_token(self, request_id: RequestId, token: SampledToken) -> None:
        """The first token of a request prefilled elsewhere; it may compute from now on."""
        req = self.queues.requests.get(request_id)
        if req is None:
            raise InvalidRequestError(f"no request {request_id} here")
        if not req.awaiting_first_token:
            raise InvalidRequestError(f"request {request_id} already has its first token")
        if not req.append_output(token):
            raise InvalidRequestError("the first token breaks the request's output constraint")
        if self.limits.stop_reason(req, token.token_id) is not None:
            raise InvalidRequestError("the first token already ends this request")
        req.awaiting_first_token = False
        self.queues.unpark(request_id)

    def has_unfinished(self) -> bool:
        """Whether any request (or a finished one's slots) is still here: a step may
        compute or admit, or pick up what the connector finished."""
        return self.queues.has_unfinished()

    # -- one step ----------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        budget = self.config.max_num_batched_tokens
        if self.config.shortest_prompt_first:
            return self._schedule_shortest_prompt(budget)
        scheduled: list[ScheduledRequest] = []
        preempted: list[RequestId] = []
        running = self.queues.running
        idx = 0
        while idx < len(running) and budget > 0:
            req = running[idx]
            num_new = self.admission.chunk(req.num_tokens - req.num_computed_tokens, budget)
            if not self._make_room(req, req.num_computed_tokens + num_new, preempted):
                preempted.append(self._preempt(running.pop()))  # req itself
                break
            scheduled.append(ScheduledRequest(req, num_new))
            budget -= num_new
            idx += 1
        if not preempted:
            self._admit(budget, scheduled)
        return SchedulerOutput(tuple(scheduled), tuple(preempted), self.preemption.take_plan())

    def _schedule_shortest_prompt(self, budget: int) -> SchedulerOutput:
        """A prefill instance's step: one prompt, the one with the fewest tokens left
        among the running and the queue's head (shortest remaining first). Prompts that
        share steps all get their first token when the last of them ends; computed one
        at a time, each gets it when its own compute ends (8 prompts of 512 tokens at
        once: the first after an eighth of the time, the median after half). A prompt
        arriving behind a long one waits for at most one of its chunks."""
        scheduled: list[ScheduledRequest] = []
        preempted: list[RequestId] = []
        running = self.queues.running
        best = min(running, key=_tokens_left, default=None)
        waiting = self.queues.waiting
        shorter = bool(waiting) and (best is None or _tokens_left(waiting[0]) < _tokens_left(best))
        if shorter or self.queues.idle_holders():
            self._admit(budget, scheduled, limit=1)
        if not scheduled and best is not None:
            num_new = self.admission.chunk(_tokens_left(best), budget)
            if self._make_room(best, best.num_computed_tokens + num_new, preempted):
                scheduled.append(ScheduledRequest(best, num_new))
            else:
                preempted.append(self._preempt(running.pop()))  # best itself
        return SchedulerOutput(tuple(scheduled), tuple(preempted), self.preemption.take_plan())

    def _make_room(self, req: Request, end: int, preempted: list[RequestId]) -> bool:
        """Grow running ``req`` to ``end`` tokens. Slots come first from requests holding
        them idle in the queue (loaded KV, the cheapest to give up), then from the latest
        running requests; False when only ``req`` itself is left to preempt."""
        while not self.kv.grow(req, end):
            idle = self.queues.idle_holders()
            if idle:
                preempted.append(self._release(idle[-1]))
            elif self.queues.running[-1] is not req:
                preempted.append(self._preempt(self.queues.running.pop()))
            else:
                return False
        return True

    def _admit(
        self, budget: int, scheduled: list[ScheduledRequest], limit: int | None = None
    ) -> None:
        """Start queued requests while the budget allows (at most ``limit`` computing)."""
        # holding slots (their KV was loaded asynchronously), they only need to grow: they
        # go first, so a request that waits for slots never holds up those that have them
        stuck: list[Request] = []
        for req in self.queues.idle_holders():
            if limit is not None and len(scheduled) >= limit:
                return
            taken = self.admission.continue_held(req, budget)
            if taken is None:
                stuck.append(req)
                continue
            scheduled.append(ScheduledRequest(req, taken))
            budget -= taken
        if stuck:
            if not scheduled:
                self._unwedge(stuck, budget, scheduled)
            return
        waiting = self.queues.waiting
        computing = self._blocks_being_computed()
        deferred: list[Request] = []
        while waiting and len(self.queues.running) < self.config.max_num_seqs:
            if limit is not None and len(scheduled) >= limit:
                break
            req = waiting[0]
            fresh = req.swapped is None
            if fresh and self.kv.waits_for_computing(req, computing):
                deferred.append(waiting.popleft())
                continue
            taken = self.admission.start(req, budget)
            if taken is None:
                break
            if taken:
                scheduled.append(ScheduledRequest(req, taken))
                budget -= taken
                computing |= self.kv.uncached_prompt_blocks(req)
        waiting.extendleft(reversed(deferred))

    def _blocks_being_computed(self) -> set[BlockKey]:
        """Keys of the prompt blocks running requests compute and have not cached yet."""
        return {k for r in self.queues.running for k in self.kv.uncached_prompt_blocks(r)}

    def _unwedge(
        self, stuck: list[Request], budget: int, scheduled: list[ScheduledRequest]
    ) -> None:
        """Nothing runs and the requests holding slots in the queue cannot grow (their
        tails outgrew what is free): preempt the latest of them, one by one, until the
        first can go on. Without room even then, wait for the loads, first tokens and
        releases that free slots (each wakes the engine)."""
        first, rest = stuck[0], stuck[1:]
        blocks = self.kv.blocks_for(first.num_tokens) - len(first.slots)
        need = blocks * (1 + self.kv.part_size)
        if need > self.kv.num_free + sum(self.kv.slots_held(r) for r in rest):
            return
        while rest:
            self._release(rest.pop())
            taken = self.admission.continue_held(first, budget)
            if taken is not None:
                scheduled.append(ScheduledRequest(first, taken))
                return

    def _release(self, req: Request) -> RequestId:
        """Preempt a request holding slots in the queue; it keeps its place there."""
        self.preemption.evict(req)
        self.kv.free(req)
        req.status = RequestStatus.PREEMPTED
        return req.request_id

    def _preempt(self, req: Request) -> RequestId:
        """Preempt a running request; it waits at the front of the queue."""
        self.queues.waiting.appendleft(req)
        return self._release(req)

    # -- results -------------------------------------------------------------
    def update(
        self,
        out: SchedulerOutput,
        sampled: Mapping[RequestId, SampledToken],
        failed_loads: Set[RequestId] = frozenset(),
    ) -> list[Request]:
        """Apply one executed step; returns the requests that got a new token. Requests
        in ``failed_loads`` computed over garbage: they start over without loading."""
        changed: list[Request] = []
        for s in out.scheduled:
            req = s.request
            if req.is_finished:  # aborted while the step ran
                continue
            if req.request_id in failed_loads:
                self.queues.running.remove(req)
                self._recompute(req)
                continue
            samples = s.samples
            req.num_computed_tokens += s.num_new_tokens
            self.kv.cache_blocks(req)
            if not samples:
                continue
            tok = sampled[req.request_id]
            accepted = req.append_output(tok)
            reason = self.limits.stop_reason(req, tok.token_id)
            if not accepted:  # sampled under its mask: never, short of a bug
                log.error("%s: token %d breaks its output constraint", req.request_id, tok.token_id)
                reason = FinishReason.STOP
            if reason is not None:
                self.finish(req.request_id, reason)
            changed.append(req)
        return changed

    def on_connector_events(self, events: ConnectorEvents) -> None:
        """Asynchronous loads that ended and finished requests the connector let go."""
        for rid in events.loaded:
            req = self.loads.landed(rid)
            if req is not None:
                self.kv.cache_blocks(req)
                self.preemption.load_ended(rid, ok=True)
                self.queues.requeue(req)
        for rid in events.failed:
            req = self.loads.failed(rid)
            if req is not None:
                self.preemption.load_ended(rid, ok=False)
                self._recompute(req)
        for rid in events.released:
            req = self.queues.releasing.pop(rid, None)
            if req is not None:
                self.kv.free(req)

    def _recompute(self, req: Request) -> None:
        """A load failed: free what it filled and queue the request to compute instead."""
        self.kv.free(req)
        req.num_computed_tokens = 0
        req.load_external = False
        req.spilled = False
        req.cache_hit = CacheHit()
        self.queues.requeue(req)

    # -- ending --------------------------------------------------------------
    def finish(self, request_id: RequestId, reason: FinishReason) -> Request | None:
        """Finish (or abort) a request and free its slots (once the connector lets go of
        them); unknown ids return None."""
        req = self.queues.remove(request_id)
        if req is None:
            return None
        self.preemption.discard(req)
        self.loads.discard(request_id)
        req.status = RequestStatus.FINISHED
        req.finish_reason = reason
        if self.connector is not None and self.connector.request_finished(req):
            self.queues.releasing[request_id] = req
        else:
            self.kv.free(req)
        return req


def _tokens_left(req: Request) -> int:
    return req.num_tokens - req.num_computed_tokens
