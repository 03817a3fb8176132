"""Prefill: compute a prompt on top of whatever KV can be reused, streaming each layer's
KV to the store as it is computed.

Per request: the KV-store connector leases the longest cached prefix the store
holds and opens the two-phase put of the prompt's blocks (its reservation
resolves while the prompt computes) -> ``accepted`` with the store ids (the
decode side starts pulling) -> the engine reuses the prefix
from its own pool, loads the rest of it from the store (layer by layer,
overlapped with computing the new tokens) and computes the rest (batched FCFS
under the token budget, chunked when long), while the connector writes every
block the store lacks as soon as its layer is final -> first token -> commit.
The service itself only talks to the engine's public API and the connector.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import AsyncGenerator
from dataclasses import replace

from pydantic import BaseModel

from services.prefill.settings import PrefillSettings
from shared.config import BatonSettings, EngineConfig
from shared.engine.engine_loop import next_output
from shared.engine.request import FinishReason
from shared.errors import InvalidRequestError
from shared.kvstore.connector import KVStoreConnector, StorePlan
from shared.serving.metrics import latency_histogram
from shared.serving.protocol import (
    Accepted,
    Committed,
    FirstTokenEvent,
    PrefillRequest,
    WireToken,
)
from shared.serving.worker import Worker
from shared.serving.worker_metrics import WorkerMetrics

log = logging.getLogger(__name__)

PREFILL_CHUNK_TOKENS = 256
PREFILL_STAGING_BLOCKS = 128


class PrefillMetrics:
    def __init__(self, base: WorkerMetrics):
        self.base = base
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

    def observe_first_token(self, queue_s: float, compute_s: float) -> None:
        """Baton's names and vLLM's (queue and prefill time)."""
        self.queue_s.observe(queue_s)
        self.compute_s.observe(compute_s)
        self.base.observe_prompt_phases(queue_s, compute_s)


class Prefiller(Worker):
    settings: PrefillSettings
    role = "prefill"

    def __init__(self, settings: PrefillSettings, baton: BatonSettings):
        super().__init__(settings, baton)
        self.prefill_metrics = PrefillMetrics(self.metrics)
        # the engine thread's cores (this thread's affinity may differ: it is asked from
        # the event loop's too)
        self._engine_cpus = len(baton.engine_cpu_set() or os.sched_getaffinity(0))

    def make_connector(self) -> KVStoreConnector:
        return KVStoreConnector(
            self.kv,
            self.connector_metrics,
            caching=self.caching,
            pull_policy=self.settings.pull_policy,
            put_ttl_s=self.settings.put_ttl_s,
            replicate=False,
            # staging for whole-block writes (a step on every core sends its blocks whole
            # at its end): a 2,048-token step's worth, so the step never waits for them
            staging_blocks=PREFILL_STAGING_BLOCKS,
            layerwise=self._core_left_for_transfers,
        )

    def _core_left_for_transfers(self) -> bool:
        """Stream a step's KV layer by layer only while the step leaves a core to the
        transfers: on every core (a lone prompt, elastic threads at their ceiling), the
        transfers' CPU slows the step more than their overlap saves (measured on 2
        cores: 512 tokens 274 vs 193 ms of compute), so the blocks go whole at its end.
        Asked as a prompt is accepted too (the latest step's threads foretell its own),
        so the gateway opens its decode only after the first token when no core is
        left: opened alongside, the decode's setup took ~7 ms of a 512-token prompt's
        155 ms of compute, and its load could not start before then anyway. A core
        another process keeps busy (a load generator beside the cluster) is no core left."""
        threads = self._loop.stats.threads if self._loop is not None else 0
        threads = threads or self.baton.num_threads or 0  # before its first step
        governor = self._loop.threads if self._loop is not None else None
        held = governor.held if governor is not None else 0
        return 0 < threads < self._engine_cpus - held

    def _kv_after_first_token(self, plan: StorePlan, whole: bool) -> bool:
        """Whether none of the prompt's KV can reach a decode before its first token:
        the store holds none of its blocks (the lease found no cached prefix), and they
        will be sent whole at the end (a short prompt, or steps on every core). A
        connector without the layer-by-layer choice (a mixed instance's) always
        streams."""
        if plan.put_job is None or plan.load_ids:
            return False  # a decode can pull the blocks the store already has
        return whole or (self.connector.layerwise is not None and not self.connector.layerwise())

    def engine_config(self) -> EngineConfig:
        """One prompt per step, the shortest first (its TTFT is its own compute, not that
        of every prompt sharing the steps), in chunks capped at
        :data:`PREFILL_CHUNK_TOKENS` unless ``BATON_LONG_PREFILL_TOKEN_THRESHOLD`` says
        otherwise: a long prompt then no longer holds the short prompts queued behind
        it (their TTFT) for its whole prefill, nor releases them to decode in one burst."""
        config = self.baton.engine_config()
        scheduler = replace(config.scheduler, shortest_prompt_first=True)
        if "long_prefill_token_threshold" not in self.baton.model_fields_set:
            scheduler = replace(scheduler, long_prefill_token_threshold=PREFILL_CHUNK_TOKENS)
        return replace(config, scheduler=scheduler)

    def load(self) -> dict[str, float]:
        snap = self.loop.snapshot
        return {"pending_tokens": float(snap.pending_tokens), "jobs": float(len(self.in_flight))}

    async def run(self, body: PrefillRequest) -> AsyncGenerator[BaseModel, None]:
        """Yields the events of one prefill (see :mod:`shared.serving.protocol`)."""
        self.admit()
        rid = body.request_id
        if rid in self.in_flight:
            raise InvalidRequestError(f"request id {rid} is already in prefill")
        req = self.engine.new_request(
            body.prompt_token_ids,
            body.sampling.to_params(max_tokens=1),
            request_id=rid,
            seed=body.sampling.seed,
            cache_salt=body.cache_salt,
        )
        whole = req.num_prompt_tokens < self.settings.layerwise_min_tokens
        # the first token leaves before the step's staged KV: it is what the client waits for
        plan = await self.connector.plan_prefill(
            req, whole_blocks=whole, hold_staged=True, indexed_tokens=body.store_tokens_indexed
        )
        late = self._kv_after_first_token(plan, whole)
        self.in_flight[rid] = req
        outputs = self.loop.subscribe(rid)
        added = sampled = False
        try:
            budget = body.sampling.max_tokens  # a json_object plans to close within it
            await self.loop.call(
                lambda e: e.add(req, kv_transfer=plan, detokenize=False, whole_max_tokens=budget)
            )
            added = True
            if plan.put_job is not None and not late:
                # a decode pulls as soon as it has the ids, and the store must know them
                # by then (the prompt computes meanwhile; a failed reservation fails
                # only the put, and that decode recomputes what it cannot load)
                await asyncio.wait([plan.put_job.reserved])
            yield Accepted(
                instance_id=self.instance_id, kv_ids=plan.put_ids, kv_after_first_token=late
            )
            out = await next_output(outputs)
            if out.timings is None:
                raise RuntimeError(f"prefill of {rid} ended without timings")
            sampled = True
            first_at = time.perf_counter()
            t = out.timings
            started = t.scheduled if t.scheduled is not None else t.arrival
            queue_s, compute_s = started - t.arrival, first_at - started
            self.prefill_metrics.observe_first_token(queue_s, compute_s)
            self.connector_metrics.observe_hit(req.num_prompt_tokens, out.cache_hit)
            lp = out.new_logprobs[0] if out.new_logprobs else None
            yield FirstTokenEvent(
                token=WireToken.of(out.new_token_ids[0], lp),
                finish_reason="stop" if out.finish_reason is FinishReason.STOP else None,
                queue_s=queue_s,
                compute_s=compute_s,
                cached_tokens=out.cache_hit.tokens,
                cached_from_store=out.cache_hit.external_tokens,
            )
            if plan.put_job is not None:
                plan.put_job.send_staged.set()
                await asyncio.shield(plan.put_job.committed)
            exposed = time.perf_counter() - first_at
            self.prefill_metrics.exposed_s.observe(exposed)
            log.info(
                "prefilled %d tokens (%d reused: %d local, %d from the store): queue %.3fs, "
                "compute %.3fs, exposed transfer %.4fs",
                req.num_prompt_tokens,
                out.cache_hit.tokens,
                out.cache_hit.local_tokens,
                out.cache_hit.external_tokens,
                queue_s,
                compute_s,
                exposed,
            )
            yield Committed(exposed_transfer_s=exposed)
        finally:
            if plan.put_job is not None:
                plan.put_job.send_staged.set()
            self.loop.unsubscribe(rid)
            self.in_flight.pop(rid, None)
            if not added:
                self.background.spawn(self.connector.abandon(plan), f"prefill-abandon:{rid}")
            elif not sampled:  # the engine ends it and the connector revokes its put
                self.loop.post(lambda e: e.abort(rid))
