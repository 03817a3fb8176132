"""FCFS continuous-batching scheduler with chunked prefill, prefix caching and preemption.

Pure Python: it decides, per step, how many new tokens of which request are
computed, and owns the requests' block tables through the :class:`BlockPool`.
Running requests go first (decodes and unfinished prompt chunks), then waiting
requests in arrival order while the token budget, the sequence limit and free
blocks allow; with ``long_prefill_token_threshold`` no request's prompt chunk
exceeds it, which leaves budget for the prompts queued behind a long one. When
a running request needs a block and none is free, the latest-arrived running
request is preempted: its blocks go back to the pool (still findable by hash,
so resuming usually re-hits them) and it waits at the front of the queue.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass

from shared.config import SchedulerConfig
from shared.engine.request import (
    FinishReason,
    Request,
    RequestId,
    RequestStatus,
    SampledToken,
)
from shared.errors import RequestTooLongError
from shared.kv.block_hash import BlockHasher
from shared.kv.block_pool import BlockPool


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

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class Scheduler:
    def __init__(
        self,
        config: SchedulerConfig,
        pool: BlockPool,
        hasher: BlockHasher,
        *,
        max_model_len: int,
        eos_token_ids: tuple[int, ...],
    ):
        self.config = config
        self.pool = pool
        self.hasher = hasher
        self.block_size = hasher.block_size
        self.max_model_len = max_model_len
        self.eos_token_ids = eos_token_ids
        self.waiting: deque[Request] = deque()
        self.prefilled: deque[Request] = deque()  # KV already in their blocks; join to decode
        self.running: list[Request] = []
        self.requests: dict[RequestId, Request] = {}

    # -- admission -------------------------------------------------------
    def add(self, req: Request) -> None:
        self._check_fits(req)
        self.requests[req.request_id] = req
        self.waiting.append(req)

    def add_prefilled(self, req: Request) -> None:
        """Join a request whose prompt KV is already in ``req.block_ids`` (pulled from the
        KV store) and whose first token was sampled elsewhere; it decodes from the next step."""
        self._check_fits(req)
        if not req.output_token_ids:
            raise ValueError("a prefilled request carries its first token")
        if len(req.block_ids) < cdiv(req.num_prompt_tokens, self.block_size):
            raise ValueError("a prefilled request must own blocks for its whole prompt")
        if self._stop_reason(req, req.output_token_ids[-1]) is not None:
            raise ValueError("the first token already ends this request")
        req.num_computed_tokens = req.num_prompt_tokens
        self.requests[req.request_id] = req
        self.prefilled.append(req)

    def _check_fits(self, req: Request) -> None:
        total = req.num_prompt_tokens + req.params.max_tokens
        if req.num_prompt_tokens == 0:
            raise RequestTooLongError("the prompt is empty")
        if total > self.max_model_len:
            raise RequestTooLongError(
                f"prompt ({req.num_prompt_tokens} tokens) + max_tokens "
                f"({req.params.max_tokens}) = {total} exceeds the context length "
                f"{self.max_model_len}"
            )
        if cdiv(total, self.block_size) > self.pool.num_blocks:
            raise RequestTooLongError(
                f"{total} tokens need more KV blocks than this instance has "
                f"({self.pool.num_blocks} x {self.block_size} tokens)"
            )
        if req.request_id in self.requests:
            raise ValueError(f"request id {req.request_id} is already in use")

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.prefilled)

    # -- one step ----------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        budget = self.config.max_num_batched_tokens
        scheduled: list[ScheduledRequest] = []
        preempted: list[RequestId] = []
        while self.prefilled and len(self.running) < self.config.max_num_seqs:
            joining = self.prefilled.popleft()
            joining.status = RequestStatus.RUNNING
            self.running.append(joining)
        idx = 0
        while idx < len(self.running) and budget > 0:
            req = self.running[idx]
            num_new = self._chunk(req.num_tokens - req.num_computed_tokens, budget)
            need = cdiv(req.num_computed_tokens + num_new, self.block_size) - len(req.block_ids)
            while need > self.pool.num_free and self.running[-1] is not req:
                preempted.append(self._preempt(self.running.pop()))
            if need > self.pool.num_free:
                preempted.append(self._preempt(self.running.pop()))
                break
            req.block_ids.extend(self.pool.allocate(need))
            scheduled.append(ScheduledRequest(req, num_new))
            budget -= num_new
            idx += 1
        if not preempted:
            budget = self._admit(budget, scheduled)
        return SchedulerOutput(tuple(scheduled), tuple(preempted))

    def _admit(self, budget: int, scheduled: list[ScheduledRequest]) -> int:
        bs = self.block_size
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            req = self.waiting[0]
            tokens = req.all_token_ids
            if not req.block_hashes:
                req.block_hashes = self.hasher.hash_blocks(tokens, cache_salt=req.cache_salt)
            # always leave >= 1 token to compute: its logits give the next token
            usable = req.block_hashes[: (len(tokens) - 1) // bs]
            hits = self.pool.lookup(usable)
            computed = len(hits) * bs
            num_new = self._chunk(len(tokens) - computed, budget=None)
            if num_new > budget:
                if not self.config.enable_chunked_prefill and scheduled:
                    break
                num_new = budget
            need = cdiv(computed + num_new, bs) - len(hits)
            free_after_hits = self.pool.num_free - sum(self.pool.ref_count(b) == 0 for b in hits)
            if need > free_after_hits:
                break
            self.waiting.popleft()
            self.pool.acquire(hits)
            req.block_ids = hits + self.pool.allocate(need)
            req.num_computed_tokens = computed
            req.num_indexed_blocks = len(hits)
            if req.status is RequestStatus.WAITING:
                req.num_cached_tokens = computed
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            scheduled.append(ScheduledRequest(req, num_new))
            budget -= num_new
        return budget

    def _chunk(self, remaining: int, budget: int | None) -> int:
        """Tokens of a request to compute this step: at most ``budget``, and a prompt
        chunk at most ``long_prefill_token_threshold`` (so one long prompt does not
        hold every prompt queued behind it for its whole prefill)."""
        cap = self.config.long_prefill_token_threshold
        if cap and self.config.enable_chunked_prefill:
            remaining = min(remaining, cap)
        return remaining if budget is None else min(remaining, budget)

    def _preempt(self, req: Request) -> RequestId:
        self._free_blocks(req)
        req.num_computed_tokens = 0
        req.status = RequestStatus.PREEMPTED
        self.waiting.appendleft(req)
        return req.request_id

    # -- results -------------------------------------------------------------
    def update(
        self, out: SchedulerOutput, sampled: Mapping[RequestId, SampledToken]
    ) -> list[Request]:
        """Apply one executed step; returns the requests that got a new token."""
        changed: list[Request] = []
        for s in out.scheduled:
            req = s.request
            if req.is_finished:  # aborted while the step ran
                continue
            samples = s.samples
            req.num_computed_tokens += s.num_new_tokens
            self._cache_full_blocks(req)
            if not samples:
                continue
            tok = sampled[req.request_id]
            req.output_token_ids.append(tok.token_id)
            if tok.logprobs is not None:
                req.output_logprobs.append(tok.logprobs)
            reason = self._stop_reason(req, tok.token_id)
            if reason is not None:
                self.finish(req.request_id, reason)
            changed.append(req)
        return changed

    def _cache_full_blocks(self, req: Request) -> None:
        full = req.num_computed_tokens // self.block_size
        if len(req.block_hashes) < full:
            parent = req.block_hashes[-1] if req.block_hashes else None
            req.block_hashes.extend(
                self.hasher.hash_blocks(
                    req.all_token_ids[: full * self.block_size],
                    cache_salt=req.cache_salt,
                    parent=parent,
                    start_block=len(req.block_hashes),
                )
            )
        for i in range(req.num_indexed_blocks, full):
            self.pool.cache_full_block(req.block_ids[i], req.block_hashes[i])
        req.num_indexed_blocks = max(req.num_indexed_blocks, full)

    def _stop_reason(self, req: Request, token: int) -> FinishReason | None:
        p = req.params
        if not p.ignore_eos and token in self.eos_token_ids:
            return FinishReason.STOP
        if token in p.stop_token_ids:
            return FinishReason.STOP
        if len(req.output_token_ids) >= p.max_tokens or req.num_tokens >= self.max_model_len:
            return FinishReason.LENGTH
        return None

    # -- ending --------------------------------------------------------------
    def finish(self, request_id: RequestId, reason: FinishReason) -> Request | None:
        """Finish (or abort) a request and free its blocks; unknown ids return None."""
        req = self.requests.pop(request_id, None)
        if req is None:
            return None
        if req.status is RequestStatus.RUNNING:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        elif req in self.prefilled:
            self.prefilled.remove(req)
        self._free_blocks(req)
        req.status = RequestStatus.FINISHED
        req.finish_reason = reason
        return req

    def _free_blocks(self, req: Request) -> None:
        self.pool.release(reversed(req.block_ids))
        req.block_ids = []
        req.num_indexed_blocks = 0
