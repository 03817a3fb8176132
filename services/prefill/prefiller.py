"""Prefill: compute a prompt and stream each layer's KV to the store as it is computed.

Per request: reserve the prompt's blocks in the KV store (two-phase put) ->
announce the transfer ids (the decode side starts pulling) -> the engine
computes the prompt (batched FCFS under the token budget, chunked when long,
on top of any locally cached prefix) and samples the first token -> commit.

Layer-wise streaming: the engine calls :meth:`Prefiller.on_layer` on its own
thread once a layer's K/V of the step are in the pool. At layer 0 of a step it
plans, per request, which blocks become final in this step (every block whose
last token is computed now, and the partial tail on the prompt's last chunk)
and pins them, so neither a finishing nor a preempted request lets the pool
reuse them while a transfer reads them. Each layer is then handed to the
request's writer task on the event loop, which writes that layer of those
blocks to the store while the engine computes the next layer; after the last
layer the pins are dropped (on the engine thread, between steps).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field, replace

from pydantic import BaseModel

from services.prefill.settings import PrefillSettings
from shared.config import BatonSettings, EngineConfig
from shared.engine.engine import Engine
from shared.engine.model_runner import LayerHook
from shared.engine.request import FinishReason
from shared.engine.scheduler import SchedulerOutput, cdiv
from shared.errors import InvalidRequestError, KVStoreError, TransportError
from shared.kv.block_pool import BlockId
from shared.kvstore.client import PutHandle
from shared.serving.metrics import latency_histogram
from shared.serving.protocol import (
    Accepted,
    Committed,
    FirstTokenEvent,
    PrefillRequest,
    WireToken,
)
from shared.serving.worker import Worker, WorkerMetrics

log = logging.getLogger(__name__)

PREFILL_CHUNK_TOKENS = 256

LayerBatch = tuple[int, list[int], list[BlockId]]  # layer, transfer indices, pool blocks


@dataclass(eq=False)
class PrefillJob:
    request_id: str
    kv_ids: list[str]
    num_prompt_tokens: int
    put: PutHandle
    layers: asyncio.Queue[LayerBatch] = field(default_factory=asyncio.Queue)
    whole_blocks: bool = False  # send each block once, after its last layer
    arrival: float = field(default_factory=time.perf_counter)
    started: float | None = None  # first layer of its first step (engine thread)
    # engine-thread state
    next_block: int = 0  # transfer blocks planned so far
    pins: list[list[BlockId]] = field(default_factory=list)


StepPlan = list[tuple[PrefillJob, list[int], list[BlockId]]]  # per job: transfer idxs, blocks


class PrefillMetrics:
    def __init__(self, base: WorkerMetrics):
        r = base.registry
        self.compute_s = latency_histogram(
            r, "baton_prefill_compute_seconds", "Start of compute to first token"
        )
        self.queue_s = latency_histogram(
            r, "baton_prefill_queue_seconds", "Arrival to start of compute"
        )
        self.exposed_s = latency_histogram(
            r,
            "baton_prefill_exposed_transfer_seconds",
            "First token to KV committed in the store (transfer not hidden by compute)",
        )


class Prefiller(Worker):
    settings: PrefillSettings
    role = "prefill"

    def __init__(self, settings: PrefillSettings, baton: BatonSettings):
        super().__init__(settings, baton)
        self.jobs: dict[str, PrefillJob] = {}
        self.prefill_metrics = PrefillMetrics(self.metrics)
        self._plan: StepPlan = []

    def engine_config(self) -> EngineConfig:
        """Prompt chunks capped at :data:`PREFILL_CHUNK_TOKENS` unless
        ``BATON_LONG_PREFILL_TOKEN_THRESHOLD`` says otherwise: a long prompt then
        no longer holds the short prompts queued behind it (their TTFT) for its
        whole prefill, nor releases them to decode in one burst."""
        config = self.baton.engine_config()
        if "long_prefill_token_threshold" in self.baton.model_fields_set:
            return config
        scheduler = replace(config.scheduler, long_prefill_token_threshold=PREFILL_CHUNK_TOKENS)
        return replace(config, scheduler=scheduler)

    def load(self) -> dict[str, float]:
        pending = sum(j.num_prompt_tokens for j in self.jobs.values() if j.started is None)
        return {"pending_tokens": float(pending), "jobs": float(len(self.jobs))}

    # -- engine thread ---------------------------------------------------------------
    def layer_hook(self) -> LayerHook:
        return self.on_layer

    def on_layer(self, layer: int, step: SchedulerOutput) -> None:
        if layer == 0:
            self._plan = self._plan_step(step)
        if self._plan:
            self.loop.to_event_loop(self._dispatch, layer, self._plan)

    def _plan_step(self, step: SchedulerOutput) -> StepPlan:
        engine = self.engine
        bs = engine.layout.block_size
        now = time.perf_counter()
        plan = []
        for s in step.scheduled:
            job = self.jobs.get(s.request.request_id)
            if job is None:
                continue
            end = s.request.num_computed_tokens + s.num_new_tokens
            last = end // bs
            if end == job.num_prompt_tokens:
                last = cdiv(end, bs)  # the prompt's last chunk: the partial tail too
            if job.started is None:
                job.started = now
            if last <= job.next_block:
                continue
            idxs = list(range(job.next_block, last))
            blocks = [s.request.block_ids[i] for i in idxs]
            engine.pin_blocks(blocks)
            job.pins.append(blocks)
            job.next_block = last
            plan.append((job, idxs, blocks))
        return plan

    def _unpin(self, job: PrefillJob, blocks: list[BlockId]) -> None:
        def run(engine: Engine) -> None:
            if blocks in job.pins:
                job.pins.remove(blocks)
                engine.free_blocks(blocks)

        self.loop.post(run)

    def _forget(self, job: PrefillJob) -> None:
        """Drop the job and every pin it still holds, on the engine thread (after the step
        that may still be dispatching its layers)."""

        def run(engine: Engine) -> None:
            self.jobs.pop(job.request_id, None)
            for blocks in job.pins:
                engine.free_blocks(blocks)
            job.pins.clear()

        self.loop.post(run)

    # -- event loop ------------------------------------------------------------------
    def _dispatch(self, layer: int, plan: StepPlan) -> None:
        for job, idxs, blocks in plan:
            job.layers.put_nowait((layer, idxs, blocks))

    async def _writer(self, job: PrefillJob) -> None:
        """Write each announced layer of each final block; commit once all are written."""
        num_layers = self.engine.layout.num_layers
        pool = self.engine.kv_cache.pool
        written = 0
        while written < len(job.kv_ids):
            layer, idxs, blocks = await job.layers.get()
            ids = [job.kv_ids[i] for i in idxs]
            if not job.whole_blocks:
                segments = [pool[b, layer] for b in blocks]
                await job.put.write(ids, segments, layers=(layer, layer + 1))
            elif layer == num_layers - 1:
                await job.put.write(ids, [pool[b] for b in blocks])
            if layer == num_layers - 1:
                written += len(idxs)
                self._unpin(job, blocks)
        await job.put.commit()

    def transfer_ids(self, req: PrefillRequest) -> list[str]:
        """Store ids of the prompt's blocks: content hashes for full blocks (shared across
        requests and instances), a request-scoped id for the partial tail."""
        engine = self.engine
        hashes = engine.hasher.hash_blocks(req.prompt_token_ids, cache_salt=req.cache_salt)
        ids = [h.hex() for h in hashes]
        if len(req.prompt_token_ids) % engine.layout.block_size:
            ids.append(uuid.uuid4().hex)  # store ids are hex; random = request-scoped
        return ids

    async def run(self, req: PrefillRequest) -> AsyncGenerator[BaseModel, None]:
        """Yields the events of one prefill (see :mod:`shared.serving.protocol`)."""
        engine = self.engine
        params = req.sampling.to_params(max_tokens=1)
        engine.validate(req.prompt_token_ids, req.sampling.max_tokens)
        if req.request_id in self.jobs:
            raise InvalidRequestError(f"request id {req.request_id} is already in prefill")
        kv_ids = self.transfer_ids(req)
        layout = engine.layout
        put = await self.kv.begin_put(
            kv_ids,
            [layout.block_bytes] * len(kv_ids),
            num_layers=layout.num_layers,
            ttl_s=self.settings.put_ttl_s,
        )
        job = PrefillJob(req.request_id, kv_ids, len(req.prompt_token_ids), put)
        job.whole_blocks = job.num_prompt_tokens < self.settings.layerwise_min_tokens
        self.jobs[req.request_id] = job
        self.in_flight[req.request_id] = job
        outputs = self.loop.subscribe(req.request_id)
        writer = asyncio.create_task(self._writer(job), name=f"prefill-put:{req.request_id}")
        committed = False
        try:
            await self.loop.call(
                lambda e: e.add_request(
                    req.prompt_token_ids,
                    params,
                    request_id=req.request_id,
                    cache_salt=req.cache_salt,
                    detokenize=False,
                )
            )
            yield Accepted(instance_id=self.instance_id, kv_ids=kv_ids)
            out = await outputs.get()
            if out is None:
                raise RuntimeError("the engine stopped")
            first_at = time.perf_counter()
            started = job.started or job.arrival
            queue_s, compute_s = started - job.arrival, first_at - started
            self.prefill_metrics.queue_s.observe(queue_s)
            self.prefill_metrics.compute_s.observe(compute_s)
            lp = out.new_logprobs[0] if out.new_logprobs else None
            yield FirstTokenEvent(
                token=WireToken.of(out.new_token_ids[0], lp),
                finish_reason="stop" if out.finish_reason is FinishReason.STOP else None,
                queue_s=queue_s,
                compute_s=compute_s,
            )
            await writer
            committed = True
            exposed = time.perf_counter() - first_at
            self.prefill_metrics.exposed_s.observe(exposed)
            log.info(
                "prefilled %d tokens (%d KV blocks): queue %.3fs, compute %.3fs, "
                "exposed transfer %.4fs",
                job.num_prompt_tokens,
                len(kv_ids),
                queue_s,
                compute_s,
                exposed,
            )
            yield Committed(exposed_transfer_s=exposed)
        finally:
            self.loop.unsubscribe(req.request_id)
            self.in_flight.pop(req.request_id, None)
            self.background.spawn(
                self._cleanup(job, writer, committed), f"prefill-cleanup:{req.request_id}"
            )

    async def _cleanup(self, job: PrefillJob, writer: asyncio.Task[None], committed: bool) -> None:
        """Stop the writer (nothing reads the pool after this), abort, revoke, unpin."""
        if not committed:
            writer.cancel()
            with contextlib.suppress(BaseException):
                await writer
            self.loop.post(lambda e: e.abort(job.request_id))
            try:
                await job.put.revoke()
            except (KVStoreError, TransportError) as exc:  # its reservation TTL frees it
                log.warning("revoking the KV put of %s failed: %s", job.request_id, exc)
        self._forget(job)
