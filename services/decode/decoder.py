"""Decode: reserve KV pool space, pull the prompt's KV from the store while prefill is
still writing it, join the running batch, stream tokens back.

Per request: ``accepted`` right away -> wait for KV pool space (admission by
free blocks: requests queue, in arrival order, until finishing ones free
enough) -> pull every layer of every prompt block straight into the reserved
pool blocks (the store serves layers as prefill writes them) -> wait for the
first token (prefill sampled it; the gateway forwards it) -> join the engine's
continuous batch at its next step -> one ``token`` event per generated token.

Ownership: a reserved block belongs to the request's pull until the request
joins the engine, then to the engine's scheduler. Every change to the pending
queue or to who owns the blocks happens on the engine thread, so a request
that is cancelled at any point frees exactly what it holds: the pull is
cancelled (the transport guarantees nothing writes into the blocks after
that), then the blocks go back or the engine aborts the request.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel

from services.decode.settings import DecodeSettings
from shared.config import BatonSettings
from shared.engine.engine import Engine
from shared.engine.scheduler import cdiv
from shared.errors import InvalidRequestError, UnknownRequestError
from shared.kv.block_pool import BlockId
from shared.serving.errors import ServiceError
from shared.serving.metrics import latency_histogram
from shared.serving.protocol import Accepted, DecodeRequest, WireToken
from shared.serving.worker import TokenStream, Worker, WorkerMetrics

log = logging.getLogger(__name__)


@dataclass(eq=False)
class DecodeJob:
    req: DecodeRequest
    num_blocks: int
    reserved: asyncio.Future[list[BlockId]]
    first: asyncio.Future[WireToken]
    arrival: float = field(default_factory=time.perf_counter)
    # engine-thread state
    blocks: list[BlockId] | None = None
    joined: bool = False
    cancelled: bool = False


class DecodeMetrics:
    def __init__(self, base: WorkerMetrics):
        r = base.registry
        self.admission_s = latency_histogram(
            r, "baton_decode_admission_seconds", "Arrival to KV pool space reserved"
        )
        self.pull_s = latency_histogram(
            r, "baton_decode_pull_seconds", "KV pool space reserved to every prompt block pulled"
        )
        self.join_wait_s = latency_histogram(
            r, "baton_decode_join_wait_seconds", "Arrival to joining the running batch"
        )


class Decoder(Worker):
    settings: DecodeSettings
    role = "decode"

    def __init__(self, settings: DecodeSettings, baton: BatonSettings):
        super().__init__(settings, baton)
        self.jobs: dict[str, DecodeJob] = {}
        self.decode_metrics = DecodeMetrics(self.metrics)
        self._pending: deque[DecodeJob] = deque()  # engine thread only

    async def start(self) -> None:
        await super().start()
        self.loop.watch(self._admit)

    def load(self) -> dict[str, float]:
        sched = self.engine.scheduler
        return {
            "running": float(len(sched.running) + len(sched.prefilled)),
            "waiting_kv": float(len(self._pending)),
        }

    # -- engine thread -----------------------------------------------------------------
    def _admit(self) -> None:
        """Give queued requests their blocks, in arrival order, while memory allows."""
        engine = self.engine
        while self._pending:
            job = self._pending[0]
            blocks = engine.reserve_blocks(job.num_blocks)
            if blocks is None:
                return
            self._pending.popleft()
            job.blocks = blocks
            self.loop.to_event_loop(_settle, job.reserved, blocks)

    def _release(self, job: DecodeJob) -> None:
        """Cancelled: leave the queue, give back blocks not yet handed to the engine, or
        abort the request in the engine (which frees its blocks)."""

        def run(engine: Engine) -> None:
            job.cancelled = True
            if job in self._pending:
                self._pending.remove(job)
            elif job.joined:
                engine.abort(job.req.request_id)
            elif job.blocks is not None:
                engine.free_blocks(job.blocks)
            job.blocks = None

        self.loop.post(run)

    def _join(self, job: DecodeJob, first: WireToken) -> Callable[[Engine], None]:
        def run(engine: Engine) -> None:
            if job.cancelled or job.blocks is None:
                raise UnknownRequestError(f"request {job.req.request_id} was cancelled")
            r = job.req
            engine.add_prefilled(
                r.prompt_token_ids,
                r.sampling.to_params(),
                first.sampled(),
                job.blocks,
                request_id=r.request_id,
                seed=r.sampling.seed,
                cache_salt=r.cache_salt,
            )
            job.joined = True

        return run

    # -- event loop --------------------------------------------------------------------
    def deliver_first_token(self, request_id: str, token: WireToken) -> None:
        job = self.jobs.get(request_id)
        if job is None:
            raise ServiceError(404, f"no decode request {request_id} here", code="unknown_request")
        if job.first.done():
            raise ServiceError(409, f"request {request_id} already has its first token")
        job.first.set_result(token)

    async def _pull(self, job: DecodeJob, blocks: list[BlockId]) -> None:
        engine = self.engine
        t0 = time.perf_counter()
        into = [engine.kv_cache.block(b) for b in blocks[: len(job.req.kv_ids)]]
        async for _layer in self.kv.stream(
            job.req.kv_ids, into, num_layers=engine.layout.num_layers, wait_s=job.req.wait_s
        ):
            pass
        self.decode_metrics.pull_s.observe(time.perf_counter() - t0)

    async def run(self, req: DecodeRequest) -> AsyncGenerator[BaseModel, None]:
        engine = self.engine
        n = len(req.prompt_token_ids)
        engine.validate(req.prompt_token_ids, req.sampling.max_tokens)
        bs = engine.layout.block_size
        if len(req.kv_ids) != cdiv(n, bs):
            raise InvalidRequestError(
                f"{n} prompt tokens need {cdiv(n, bs)} KV ids, got {len(req.kv_ids)}"
            )
        if req.request_id in self.jobs:
            raise InvalidRequestError(f"request id {req.request_id} is already decoding")
        aio = asyncio.get_running_loop()
        job = DecodeJob(req, cdiv(n + 1, bs), aio.create_future(), aio.create_future())
        self.jobs[req.request_id] = job
        self.in_flight[req.request_id] = job
        outputs = self.loop.subscribe(req.request_id)
        pull: asyncio.Task[None] | None = None
        finished = False
        try:
            self.loop.post(lambda e: self._pending.append(job))
            yield Accepted(instance_id=self.instance_id)
            blocks = await job.reserved
            self.decode_metrics.admission_s.observe(time.perf_counter() - job.arrival)
            pull = asyncio.create_task(self._pull(job, blocks), name=f"pull:{req.request_id}")
            timeout = self.settings.first_token_timeout_s
            # a failed pull ends the request at once, not when the first token arrives
            both = asyncio.gather(pull, asyncio.shield(job.first))
            both.add_done_callback(_retrieved)
            _, first = await asyncio.wait_for(both, timeout)
            await self.loop.call(self._join(job, first))
            self.decode_metrics.join_wait_s.observe(time.perf_counter() - job.arrival)
            tokens = TokenStream()
            async for event in tokens.events(outputs):
                yield event
            finished = True
            log.info(
                "decoded %d tokens after a %d-token prompt in %.3fs (%s)",
                tokens.generated,
                n,
                time.perf_counter() - job.arrival,
                tokens.finish_reason,
            )
        finally:
            self.loop.unsubscribe(req.request_id)
            self.jobs.pop(req.request_id, None)
            self.in_flight.pop(req.request_id, None)
            if not finished:
                self.background.spawn(self._cleanup(job, pull), f"decode-cleanup:{req.request_id}")

    async def _cleanup(self, job: DecodeJob, pull: asyncio.Task[None] | None) -> None:
        """Stop the pull (nothing writes into the blocks after this), then free them."""
        if pull is not None and not pull.done():
            pull.cancel()
            with contextlib.suppress(BaseException):
                await pull
        self._release(job)


def _settle(fut: asyncio.Future[list[BlockId]], blocks: list[BlockId]) -> None:
    if not fut.done():
        fut.set_result(blocks)


def _retrieved(fut: asyncio.Future[Any]) -> None:
    """Mark a gather's outcome as seen: when the request is cancelled the gather ends
    with CancelledError, which asyncio would otherwise log as an unretrieved error."""
    if not fut.cancelled():
        fut.exception()
