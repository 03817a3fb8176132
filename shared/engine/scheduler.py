"""FCFS continuous-batching scheduler with chunked prefill, prefix reuse and preemption.

Pure Python: it decides, per step, how many new tokens of which request are
computed. Slots come from the :class:`KVCacheManager`; KV from outside comes
through the :class:`KVConnector`. Running requests go first (decodes and
unfinished prompt chunks), then waiting requests in arrival order while the
token budget, the sequence limit and free slots allow; with
``long_prefill_token_threshold`` no request's prompt chunk exceeds it, which
leaves budget for the prompts queued behind a long one.

Admission reuses the longest prefix held in the local pool, then asks the
connector how many more tokens it can load. A request whose next uncached block
is being computed right now by a running request waits (it is passed over, not
blocking the queue) until that block is cached, rather than computing a copy.
An in-step load runs inside the request's first step (layer by layer,
overlapped with computing the rest); an asynchronous load parks the request
(``WAITING_FOR_KV``) until the connector reports it, and the request then
computes whatever is left, ahead of the requests that still need slots. A
request holds slots from its load on without computing (a decode instance's
prompt KV arrives before its first token), so an asynchronous load is admitted
only while every request holding slots keeps one free for its next token:
loads cannot fill the pool with requests none of which can go on. A load that
fails sends the request back to recompute: a stale cache costs time, never
tokens.

When a running request needs a slot and none is free, requests holding loaded
KV idle in the queue give theirs up first (the cheapest to load again), then
the latest-arrived running request is preempted and waits at the front of the
queue; a request preempts itself only when no other is left. When nothing runs
and the loaded requests in the queue cannot grow, the latest give their slots
up until the first can go on. Every preempted request's KV is handled alike:
with a :class:`~shared.engine.swap.Swapper` its blocks are copied to host memory
when the cost model finds that cheaper than recomputing them, and copied back
when it resumes; when the host space is full it spills: the connector keeps its KV (in
the KV store) and offers it as a load when the request is admitted again.
Otherwise its slots go back (still findable by key, so resuming may re-hit
them) and it recomputes.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Mapping, Set

from shared.config import SchedulerConfig
from shared.engine.kv_cache_manager import KVCacheManager, Slot
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
from shared.engine.scheduler_output import ScheduledRequest, SchedulerOutput
from shared.engine.swap import Swapper
from shared.errors import InvalidRequestError
from shared.kv.block_hash import BlockKey


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
        self.preemption = Preemption(swapper, connector, kv.block_size)
        self.kv = kv
        self.connector = connector
        self.loads = KVLoads(connector, kv.block_size)  # asynchronous loads in flight
        self.block_size = kv.block_size
        self.limits = RequestLimits(max_model_len, kv.block_size, kv.num_slots, eos_token_ids)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.parked: dict[RequestId, Request] = {}  # waiting for their first token
        self.releasing: dict[RequestId, Request] = {}  # finished; the connector holds slots
        self.requests: dict[RequestId, Request] = {}

    # -- admission -------------------------------------------------------
    def add(self, req: Request) -> None:
        self.limits.check_fits(req.num_prompt_tokens, req.params.max_tokens)
        if req.request_id in self.requests:
            raise InvalidRequestError(f"request id {req.request_id} is already in use")
        self.requests[req.request_id] = req
        self.waiting.append(req)

    def supply_first_token(self, request_id: RequestId, token: SampledToken) -> None:
        """The first token of a request prefilled elsewhere; it may compute from now on."""
        req = self.requests.get(request_id)
        if req is None:
            raise InvalidRequestError(f"no request {request_id} here")
        if not req.awaiting_first_token:
            raise InvalidRequestError(f"request {request_id} already has its first token")
        if self.limits.stop_reason(req, token.token_id, num_outputs=1) is not None:
            raise InvalidRequestError("the first token already ends this request")
        req.output_token_ids.append(token.token_id)
        if token.logprobs is not None:
            req.output_logprobs.append(token.logprobs)
        req.awaiting_first_token = False
        if self.parked.pop(request_id, None) is not None:
            self.waiting.appendleft(req)

    def has_unfinished(self) -> bool:
        """Whether any request (or a finished one's slots) is still here: a step may
        compute or admit, or pick up what the connector finished."""
        return bool(self.requests or self.releasing)

    # -- one step ----------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        budget = self.config.max_num_batched_tokens
        scheduled: list[ScheduledRequest] = []
        preempted: list[RequestId] = []
        idx = 0
        while idx < len(self.running) and budget > 0:
            req = self.running[idx]
            num_new = self._chunk(req.num_tokens - req.num_computed_tokens, budget)
            if not self._make_room(req, req.num_computed_tokens + num_new, preempted):
                preempted.append(self._preempt(self.running.pop()))  # req itself
                break
            scheduled.append(ScheduledRequest(req, num_new))
            budget -= num_new
            idx += 1
        if not preempted:
            self._admit(budget, scheduled)
        return SchedulerOutput(tuple(scheduled), tuple(preempted), self.preemption.take_plan())

    def _make_room(self, req: Request, end: int, preempted: list[RequestId]) -> bool:
        """Grow running ``req`` to ``end`` tokens. Slots come first from requests holding
        them idle in the queue (loaded KV, the cheapest to give up), then from the latest
        running requests; False when only ``req`` itself is left to preempt."""
        while not self.kv.grow(req, end):
            idle = [r for r in self.waiting if r.slots]
            if idle:
                preempted.append(self._release(idle[-1]))
            elif self.running[-1] is not req:
                preempted.append(self._preempt(self.running.pop()))
            else:
                return False
        return True

    def _admit(self, budget: int, scheduled: list[ScheduledRequest]) -> None:
        # holding slots (their KV was loaded asynchronously), they only need to grow: they
        # go first, so a request that waits for slots never holds up those that have them
        stuck: list[Request] = []
        for req in [r for r in self.waiting if r.slots]:
            taken = self._continue(req, budget)
            if taken is None:
                stuck.append(req)
                continue
            scheduled.append(ScheduledRequest(req, taken))
            budget -= taken
        if stuck:
            if not scheduled:
                self._unwedge(stuck, budget, scheduled)
            return
        computing = self._blocks_being_computed()
        deferred: list[Request] = []
        while self.waiting and len(self.running) < self.config.max_num_seqs:
            req = self.waiting[0]
            fresh = req.swapped is None
            if fresh and self.kv.waits_for_computing(req, computing):
                deferred.append(self.waiting.popleft())
                continue
            taken = self._start(req, budget)
            if taken is None:
                break
            if taken:
                scheduled.append(ScheduledRequest(req, taken))
                budget -= taken
                computing |= self.kv.uncached_prompt_blocks(req)
        self.waiting.extendleft(reversed(deferred))

    def _blocks_being_computed(self) -> set[BlockKey]:
        """Keys of the prompt blocks running requests compute and have not cached yet."""
        return {k for req in self.running for k in self.kv.uncached_prompt_blocks(req)}

    def _start(self, req: Request, budget: int) -> int | None:
        """Admit a request holding no slots; returns the tokens it computes this step (0:
        none, it left the queue to load or wait), or None when it must wait in the queue."""
        if req.swapped is not None:
            return self._swap_in(req, budget)
        bs = self.block_size
        # always leave >= 1 token to compute: its logits give the next token
        hits = self.kv.local_hit(req, (req.num_tokens - 1) // bs)
        local = len(hits) * bs
        ext = self.loads.offer(req, local)
        computed = local + ext.num_tokens
        if ext.asynchronous and ext.num_tokens:
            # it holds slots from now on without computing: leave room for its next token
            # and a slot for every other holder's, or loads could take the pool with none
            # able to go on (_unwedge is the backstop)
            own = self.kv.blocks_for(computed + 1) - self.kv.blocks_for(computed)
            if not self.kv.can_admit(hits, computed, headroom=self._holders() + own):
                return None
            self._take(req, hits, computed, CacheHit(local, ext.num_tokens))
            self.preemption.resumed(req, local, computed, pending=True)
            req.status = RequestStatus.WAITING_FOR_KV
            self.loads.start_async(req, len(hits), req.slots[len(hits) :], computed)
            return 0
        if req.awaiting_first_token:  # nothing can be computed before it arrives
            self.waiting.popleft()
            self.parked[req.request_id] = req
            return 0
        if budget <= 0:
            return None
        num_new = self._chunk(req.num_tokens - computed, budget=None)
        if num_new > budget:
            if not self.config.enable_chunked_prefill and self.running:
                return None
            num_new = budget
        if not self.kv.can_admit(hits, computed + num_new):
            return None
        self._take(req, hits, computed + num_new, CacheHit(local, ext.num_tokens))
        self.preemption.resumed(req, local, computed, pending=False)
        req.num_computed_tokens = computed
        if ext.num_tokens:
            self.loads.start(req, len(hits), req.slots[len(hits) : computed // bs])
        req.status = RequestStatus.RUNNING
        self.running.append(req)
        return num_new

    def _take(self, req: Request, hits: list[Slot], num_tokens: int, hit: CacheHit) -> None:
        self.waiting.popleft()
        self.kv.admit(req, hits, num_tokens)
        if req.admitted is None:
            req.admitted = time.perf_counter()
        if req.status is RequestStatus.WAITING:  # first admission (not a resumed preemption)
            req.cache_hit = hit

    def _unwedge(
        self, stuck: list[Request], budget: int, scheduled: list[ScheduledRequest]
    ) -> None:
        """Nothing runs and the requests holding slots in the queue cannot grow (their
        tails outgrew what is free): preempt the latest of them, one by one, until the
        first can go on. Without room even then, wait for the loads, first tokens and
        releases that free slots (each wakes the engine)."""
        first, rest = stuck[0], stuck[1:]
        need = self.kv.blocks_for(first.num_tokens) - len(first.slots)
        if need > self.kv.num_free + sum(len(r.slots) for r in rest):
            return
        while rest:
            self._release(rest.pop())
            taken = self._continue(first, budget)
            if taken is not None:
                scheduled.append(ScheduledRequest(first, taken))
                return

    def _holders(self) -> int:
        """Requests holding slots (running, loading, or loaded and waiting)."""
        return sum(1 for r in self.requests.values() if r.slots)

    def _continue(self, req: Request, budget: int) -> int | None:
        """Run a request holding slots (what is left to compute); None when it must wait."""
        if budget <= 0 or len(self.running) >= self.config.max_num_seqs:
            return None
        num_new = min(self._chunk(req.num_tokens - req.num_computed_tokens, None), budget)
        if not self.kv.grow(req, req.num_computed_tokens + num_new):
            return None
        self.waiting.remove(req)
        req.status = RequestStatus.RUNNING
        self.running.append(req)
        return num_new

    def _chunk(self, remaining: int, budget: int | None) -> int:
        """Tokens of a request to compute this step: at most ``budget``, and a prompt
        chunk at most ``long_prefill_token_threshold`` (so one long prompt does not
        hold every prompt queued behind it for its whole prefill)."""
        cap = self.config.long_prefill_token_threshold
        if cap and self.config.enable_chunked_prefill:
            remaining = min(remaining, cap)
        return remaining if budget is None else min(remaining, budget)

    def _release(self, req: Request) -> RequestId:
        """Preempt a request holding slots in the queue; it keeps its place there."""
        self.preemption.evict(req)
        self.kv.free(req)
        req.status = RequestStatus.PREEMPTED
        return req.request_id

    def _preempt(self, req: Request) -> RequestId:
        """Preempt a running request; it waits at the front of the queue."""
        self.waiting.appendleft(req)
        return self._release(req)

    def _swap_in(self, req: Request, budget: int) -> int | None:
        """Resume a swapped-out request: fresh slots, its blocks copied back, then compute
        what it had not (at least its last token, whose logits give the next one)."""
        swapped = req.swapped
        if swapped is None:
            raise RuntimeError(f"{req.request_id} has nothing swapped out")
        if budget <= 0:
            return None
        computed = min(swapped.num_tokens, req.num_tokens - 1)
        num_new = min(self._chunk(req.num_tokens - computed, None), budget)
        if not self.kv.can_admit([], computed + num_new):
            return None
        self._take(req, [], computed + num_new, req.cache_hit)
        self.preemption.swap_in(req, req.slots)
        req.num_computed_tokens = computed
        req.status = RequestStatus.RUNNING
        self.running.append(req)
        return num_new

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
                self.running.remove(req)
                self._recompute(req)
                continue
            samples = s.samples
            req.num_computed_tokens += s.num_new_tokens
            self.kv.cache_blocks(req)
            if not samples:
                continue
            tok = sampled[req.request_id]
            req.output_token_ids.append(tok.token_id)
            if tok.logprobs is not None:
                req.output_logprobs.append(tok.logprobs)
            reason = self.limits.stop_reason(req, tok.token_id)
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
                self._requeue(req)
        for rid in events.failed:
            req = self.loads.failed(rid)
            if req is not None:
                self.preemption.load_ended(rid, ok=False)
                self._recompute(req)
        for rid in events.released:
            req = self.releasing.pop(rid, None)
            if req is not None:
                self.kv.free(req)

    def _recompute(self, req: Request) -> None:
        """A load failed: free what it filled and queue the request to compute instead."""
        self.kv.free(req)
        req.num_computed_tokens = 0
        req.load_external = False
        req.spilled = False
        req.cache_hit = CacheHit()
        req.status = RequestStatus.WAITING
        self._requeue(req)

    def _requeue(self, req: Request) -> None:
        req.status = RequestStatus.WAITING
        if req.awaiting_first_token:
            self.parked[req.request_id] = req
        else:
            self.waiting.appendleft(req)

    # -- ending --------------------------------------------------------------
    def finish(self, request_id: RequestId, reason: FinishReason) -> Request | None:
        """Finish (or abort) a request and free its slots (once the connector lets go of
        them); unknown ids return None."""
        req = self.requests.pop(request_id, None)
        if req is None:
            return None
        if req.status is RequestStatus.RUNNING:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self.preemption.discard(req)
        self.loads.discard(request_id)
        self.parked.pop(request_id, None)
        req.status = RequestStatus.FINISHED
        req.finish_reason = reason
        if self.connector is not None and self.connector.request_finished(req):
            self.releasing[request_id] = req
        else:
            self.kv.free(req)
        return req
