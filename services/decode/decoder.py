"""Decode: take over a request prefilled elsewhere and stream its tokens.

Per request: the engine admits it when its KV pool has room, reuses the
prompt blocks its own pool still holds (an earlier turn of the conversation)
and the KV-store connector loads the rest while prefill is still writing
them -> ``accepted`` right away -> the first token arrives (prefill sampled
it; the gateway forwards it) -> the request joins the running batch once its
KV is in -> one ``token`` event per generated token. When it ends, the
connector writes the prompt+answer blocks decode computed to the store, so the
next turn reuses them. A load that fails (prefill revoked, store node lost) is
recomputed here: slower, same tokens.

The service talks to the engine only through its public API on the engine
thread; cancelling the request (client gone) aborts it there, which frees
whatever it holds once the connector lets go of its slots.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncGenerator
from typing import Any

from prometheus_client import Counter
from pydantic import BaseModel

from services.decode.settings import DecodeRoleSettings
from shared.cluster.watermarks import Watermarks
from shared.config import BatonSettings
from shared.engine.engine_loop import StreamInterrupted
from shared.engine.kv_cache_manager import cdiv
from shared.engine.request import RequestId
from shared.engine.step_pacer import PACE_MARGIN, OthersCpu, StepPacer
from shared.errors import InvalidRequestError
from shared.kvstore.connector import KVStoreConnector
from shared.serving.errors import ServiceError
from shared.serving.metrics import latency_histogram
from shared.serving.protocol import Accepted, DecodeRequest, MigrateEvent, WireToken
from shared.serving.token_stream import STEP_HANG_S, TokenStream
from shared.serving.worker import Worker
from shared.serving.worker_metrics import WorkerMetrics

log = logging.getLogger(__name__)


class DecodeMetrics:
    def __init__(self, base: WorkerMetrics):
        r = base.registry
        self.admission_s = latency_histogram(
            r, "baton_decode_admission_seconds", "Arrival to KV pool space reserved"
        )
        self.join_wait_s = latency_histogram(
            r,
            "baton_decode_join_wait_seconds",
            "Arrival to the first token decoded here (KV space, prompt load, first token)",
        )
        self.migrations = Counter(
            "baton_decode_migrations", "Streams handed to another instance (drain)", registry=r
        )


class Decoder(Worker):
    settings: DecodeRoleSettings
    role = "decode"

    def __init__(self, settings: DecodeRoleSettings, baton: BatonSettings):
        super().__init__(settings, baton)
        self.first_tokens: dict[str, asyncio.Future[WireToken]] = {}
        self.decode_metrics = DecodeMetrics(self.metrics)

    def make_connector(self) -> KVStoreConnector:
        connector = KVStoreConnector(
            self.kv,
            self.connector_metrics,
            caching=self.caching,
            replicate=self.settings.replicate,
            **self.put_options(),
        )
        if self.settings.replicate:
            connector.tasks.watermarks = Watermarks(self.redis, self.keys)
        connector.tasks.instance_id = self.instance_id
        return connector

    def step_pacer(self) -> StepPacer | None:
        """With a TPOT target (BATON_SLO_TPOT), steps are spaced toward it while another
        process wants this instance's cores (shared/engine/step_pacer.py)."""
        tpot = self.baton.slo_tpot
        if tpot is None or not OthersCpu.available():
            return None
        log.info("decode: steps paced to %.0f%% of TPOT %.3f s", PACE_MARGIN * 100, tpot)
        return StepPacer(tpot, OthersCpu().contended)

    def put_options(self) -> dict[str, Any]:
        """Connector options for prompts prefilled here (none: decode only reads them)."""
        return {}

    def release_requests(self) -> None:
        """Draining: every stream here ends with ``migrate`` (after the tokens already
        made) and continues on another decode instance from the stored KV."""
        for rid in list(self.in_flight):
            self.loop.interrupt(rid)

    def load(self) -> dict[str, float]:
        snap = self.loop.snapshot
        return {
            "running": float(snap.running + snap.loading + snap.parked),
            "waiting_kv": float(snap.waiting),
        }

    def deliver_first_token(self, request_id: str, token: WireToken) -> None:
        first = self.first_tokens.get(request_id)
        if first is None:
            raise ServiceError(404, f"no decode request {request_id} here", code="unknown_request")
        if first.done():
            raise ServiceError(409, f"request {request_id} already has its first token")
        first.set_result(token)

    async def run(self, body: DecodeRequest) -> AsyncGenerator[BaseModel, None]:
        self.admit()
        rid = body.request_id
        n = len(body.prompt_token_ids)
        bs = self.engine.layout.block_size
        if body.resumed:
            kv_tokens = len(body.kv_ids) * bs  # whole blocks up to the watermark
            if kv_tokens > n + len(body.generated):
                raise InvalidRequestError(f"{len(body.kv_ids)} KV ids cover more than the tokens")
        elif len(body.kv_ids) != cdiv(n, bs):
            raise InvalidRequestError(
                f"{n} prompt tokens need {cdiv(n, bs)} KV ids, got {len(body.kv_ids)}"
            )
        else:
            kv_tokens = n
        if rid in self.in_flight:
            raise InvalidRequestError(f"request id {rid} is already decoding")
        req = self.engine.new_request(
            body.prompt_token_ids,
            body.sampling.to_params(),
            request_id=rid,
            seed=body.sampling.seed,
            cache_salt=body.cache_salt,
        )
        plan = self.connector.plan_decode(body.kv_ids, kv_tokens, body.wait_s)
        first: asyncio.Future[WireToken] = asyncio.get_running_loop().create_future()
        if not body.resumed:
            self.first_tokens[rid] = first
        self.in_flight[rid] = req
        outputs = self.loop.subscribe(rid)
        arrival = time.perf_counter()
        finished = False
        try:
            await self.loop.call(
                lambda e: e.add(
                    req,
                    kv_transfer=plan,
                    awaiting_first_token=not body.resumed,
                    generated=body.generated,
                    detokenize=False,
                )
            )
            yield Accepted(instance_id=self.instance_id)
            if not body.resumed:
                token = await asyncio.wait_for(
                    asyncio.shield(first), self.settings.first_token_timeout_s
                )
                await self.loop.call(lambda e: e.supply_first_token(rid, token.sampled()))
            tokens = TokenStream()
            # the first token decoded here (prefill's comes first unless resumed); an
            # output may carry several tokens
            first_here = len(body.generated) + (1 if body.resumed else 2)
            joined = False
            try:
                async for event in tokens.events(
                    outputs, steps=self._steps, working=lambda: self._working(req.request_id)
                ):
                    if not joined and tokens.generated >= first_here:
                        joined = True
                        self.decode_metrics.join_wait_s.observe(time.perf_counter() - arrival)
                    yield event
            except StreamInterrupted:
                yield await self._migrate(rid)
                finished = True
                return
            finished = True
            timings = tokens.timings
            if timings is not None and timings.admitted is not None:
                self.decode_metrics.admission_s.observe(timings.admitted - timings.arrival)
            log.info(
                "decoded %d tokens after a %d-token prompt in %.3fs (%s)%s",
                tokens.generated - len(body.generated),
                n,
                time.perf_counter() - arrival,
                tokens.finish_reason,
                f", resumed after {len(body.generated)}" if body.resumed else "",
            )
        finally:
            self.loop.unsubscribe(rid)
            self.first_tokens.pop(rid, None)
            self.in_flight.pop(rid, None)
            if not finished:  # frees its slots once the connector lets go of them
                self.loop.post(lambda e: e.abort(rid))

    def _steps(self) -> int:
        return self.loop.stats.steps

    def _working(self, rid: RequestId) -> bool:
        """Progress for ``rid`` that no step count shows: inside a step that began
        recently (a long one), or ``rid``'s KV load in flight. With every request here
        loading (the streams that ran just finished) the engine steps no more until a
        load lands, which takes long for a long prompt or a store under load; that
        stream is not hung. The connector's timeouts bound the load."""
        if self.connector.loading(rid):
            return True
        since = self.loop.stats.step_since
        return since is not None and time.perf_counter() - since < STEP_HANG_S

    async def _migrate(self, rid: str) -> MigrateEvent:
        """End the request here; once its computed blocks are stored, say where."""
        await self.loop.call(lambda e: e.abort(rid))
        mark = await self.connector.final_watermark(rid)
        self.decode_metrics.migrations.inc()
        if mark is None:
            return MigrateEvent(tokens=0, kv_ids=[])
        log.info("migrating %s with %d tokens of KV stored", rid, mark.tokens)
        return MigrateEvent(tokens=mark.tokens, kv_ids=mark.block_ids)
