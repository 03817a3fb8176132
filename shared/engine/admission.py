"""Admission: whether a queued request gets slots this step, and how much it computes.

A request holding no slots is admitted from the head of the queue. A fresh one
reuses the longest prefix held in the local pool, then asks the connector how
many more tokens it can load. An in-step load runs inside the request's first
step (layer by layer, overlapped with computing the rest); an asynchronous load
parks the request (``WAITING_FOR_KV``) until the connector reports it, and the
request then continues from the queue holding its slots. It holds them without
computing (a decode instance's prompt KV arrives before its first token), so an
asynchronous load is admitted only while every request holding slots keeps one
free for its next token: loads cannot fill the pool with requests none of which
can go on. A swapped-out request gets fresh slots and its blocks copied back.

Pure Python, like the scheduler: slots come from the :class:`KVCacheManager`,
loads from :class:`KVLoads`, and every move between queues is made on the shared
:class:`RequestQueues`.
"""

from __future__ import annotations

import time

from shared.config import SchedulerConfig
from shared.engine.kv_cache_manager import KVCacheManager, Slot
from shared.engine.kv_loads import KVLoads
from shared.engine.preemption import Preemption
from shared.engine.request import CacheHit, Request, RequestStatus
from shared.engine.request_queues import RequestQueues

# a prompt alone in the engine is chunked at this multiple of the usual cap, times the
# threads its step computes on (see Admission.chunk)
ALONE_CHUNK_FACTOR = 4


class Admission:
    def __init__(
        self,
        config: SchedulerConfig,
        kv: KVCacheManager,
        queues: RequestQueues,
        loads: KVLoads,
        preemption: Preemption,
    ):
        self.config = config
        self.kv = kv
        self.queues = queues
        self.loads = loads
        self.preemption = preemption
        # the threads the next step computes on (Engine.set_num_threads): a lone
        # prompt's chunk grows with them, so its step lasts about as long on any count
        self.threads = 1

    def start(self, req: Request, budget: int) -> int | None:
        """Admit the request at the head of the queue, holding no slots; returns the
        tokens it computes this step (0: none, it left the queue to load or wait), or
        None when it must wait in the queue."""
        if req.swapped is not None:
            return self._swap_in(req, budget)
        bs = self.kv.block_size
        # always leave >= 1 token to compute: its logits give the next token
        hits = self.kv.local_hit(req, (req.num_tokens - 1) // bs)
        local = len(hits) * bs
        ext = self.loads.offer(req, local)
        computed = local + ext.num_tokens
        if ext.asynchronous and ext.num_tokens:
            # it holds slots from now on without computing: leave room for its next token
            # and a slot for every other holder's, or loads could take the pool with none
            # able to go on (the scheduler's unwedging is the backstop)
            own = self.kv.blocks_for(computed + 1) - self.kv.blocks_for(computed)
            holders = self.queues.holders() + own
            if not self.kv.can_admit(hits, computed, headroom=holders, start=computed, req=req):
                return None
            self._take(req, hits, computed, computed, CacheHit(local, ext.num_tokens))
            self.queues.waiting.popleft()
            self.preemption.resumed(req, local, computed, pending=True)
            req.status = RequestStatus.WAITING_FOR_KV
            self.loads.start_async(req, len(hits), req.slots[len(hits) :], computed)
            return 0
        if req.awaiting_first_token:  # nothing can be computed before it arrives
            self.queues.park(req)
            return 0
        if budget <= 0:
            return None
        num_new = self.chunk(req.num_tokens - computed, budget=None)
        if num_new > budget:
            if not self.config.enable_chunked_prefill and self.queues.running:
                return None
            num_new = budget
        if not self.kv.can_admit(hits, computed + num_new, start=computed, req=req):
            return None
        self._take(req, hits, computed + num_new, computed, CacheHit(local, ext.num_tokens))
        self.preemption.resumed(req, local, computed, pending=False)
        req.num_computed_tokens = computed
        if ext.num_tokens:
            self.loads.start(req, len(hits), req.slots[len(hits) : computed // bs])
        self.queues.run(req)
        return num_new

    def continue_held(self, req: Request, budget: int) -> int | None:
        """Run a waiting request holding slots (what is left to compute); None when it
        must wait."""
        if budget <= 0 or len(self.queues.running) >= self.config.max_num_seqs:
            return None
        num_new = min(self.chunk(req.num_tokens - req.num_computed_tokens, None), budget)
        if not self.kv.grow(req, req.num_computed_tokens + num_new):
            return None
        self.queues.run(req)
        return num_new

    def chunk(self, remaining: int, budget: int | None) -> int:
        """Tokens of a request to compute this step: at most ``budget``, and a prompt
        chunk at most ``long_prefill_token_threshold`` (so one long prompt does not
        hold every prompt queued behind it for its whole prefill). A request alone in
        the engine takes :data:`ALONE_CHUNK_FACTOR` times that for each thread the
        step computes on: nothing waits behind it, and each chunk boundary costs a
        lone prompt time (a 512-token prompt took 203 ms in two chunks against
        173-187 ms in one, bf16, 2 AMD EPYC cores; a 2,048-token one served 3-4%
        longer in two on 2 AMX cores). One arriving meanwhile waits for at most that
        larger chunk, which lasts about as long on every thread count (a prefill
        instance's elastic threads: on one core, beside a busy decode, its chunks
        stay as short as they were). So does every prompt under
        ``shortest_prompt_first``, where each step computes one."""
        cap = self.config.long_prefill_token_threshold
        if cap and self.config.enable_chunked_prefill:
            # one prompt per step: it computes alone whatever waits
            if len(self.queues.requests) <= 1 or self.config.shortest_prompt_first:
                cap *= ALONE_CHUNK_FACTOR * max(1, self.threads)
            remaining = min(remaining, cap)
        return remaining if budget is None else min(remaining, budget)

    def _take(
        self, req: Request, hits: list[Slot], num_tokens: int, start: int, hit: CacheHit
    ) -> None:
        self.kv.admit(req, hits, num_tokens, start=start)
        if req.admitted is None:
            req.admitted = time.perf_counter()
        if req.status is RequestStatus.WAITING:  # first admission (not a resumed preemption)
            req.cache_hit = hit

    def _swap_in(self, req: Request, budget: int) -> int | None:
        """Resume a swapped-out request: fresh slots, its blocks copied back, then compute
        what it had not (at least its last token, whose logits give the next one)."""
        swapped = req.swapped
        if swapped is None:
            raise RuntimeError(f"{req.request_id} has nothing swapped out")
        if budget <= 0:
            return None
        computed = min(swapped.num_tokens, req.num_tokens - 1)
        num_new = min(self.chunk(req.num_tokens - computed, None), budget)
        if not self.kv.can_admit([], computed + num_new, start=computed, req=req):
            return None
        self._take(req, [], computed + num_new, computed, req.cache_hit)
        self.preemption.swap_in(req, req.slots)
        req.num_computed_tokens = computed
        self.queues.run(req)
        return num_new
