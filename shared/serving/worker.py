"""What a prefill and a decode instance share: the engine on its thread (with the
KV-store connector as its KV seam, for the roles that move KV), Redis membership
with load, the publisher of the local pool's holdings to the prompt index, the KV
store client, settings, and the HTTP basics.

Long-lived parts are created once in :meth:`Worker.start` (called from the
FastAPI lifespan) and torn down in reverse order by :meth:`Worker.stop`.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import redis.asyncio as aioredis
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest
from pydantic import BaseModel, Field
from pydantic_settings import BaseSettings

from shared.cluster.auth import AuthMetrics, ClusterSecret, protect
from shared.cluster.block_index import BlockIndex, IndexPublisher
from shared.cluster.keys import Keys
from shared.cluster.membership import Heartbeat, Member, default_advertise_host
from shared.config import BatonSettings, EngineConfig
from shared.engine.elastic_threads import ProcStatSource, ThreadGovernor
from shared.engine.engine import Engine
from shared.engine.engine_loop import EngineLoop, Output, next_output
from shared.engine.kv_cache_manager import KVEvents
from shared.engine.outputs import RequestTimings
from shared.engine.request import CacheHit, TokenLogprobs
from shared.engine.snapshot import EngineSnapshot
from shared.engine.swap import SwapStats
from shared.hardware import auto_dtype
from shared.kvstore.client import KVStoreClient
from shared.kvstore.connector import KVStoreConnector
from shared.kvstore.connector_metrics import ConnectorMetrics
from shared.logs import request_id_var
from shared.service import service_app
from shared.serving.background import Background
from shared.serving.errors import ServiceError, classify, error_response
from shared.serving.metrics import (
    MODEL_LABEL,
    VLLM_REQUEST_LATENCY_BUCKETS,
    latency_histogram,
    vllm_gauge,
    vllm_histogram,
)
from shared.serving.protocol import (
    REQUEST_ID_HEADER,
    ErrorEvent,
    TokenEvent,
    WaitingEvent,
    WireToken,
    encode_event,
)
from shared.transport import make_transport

log = logging.getLogger(__name__)


class WorkerSettings(BaseSettings):
    """Per-role settings; subclasses set the env prefix (``BATON_PREFILL_``, ...)."""

    host: str = "0.0.0.0"
    advertise_host: str = Field(default_factory=default_advertise_host)
    port: int = Field(default=0, ge=0, le=65535)
    instance_id: str = ""
    kv_wait_s: float = Field(default=120.0, gt=0)
    # SIGTERM: stop taking requests, finish (prefill) or move (decode) the ones here,
    # and exit once none is left or after this long
    drain_timeout_s: float = Field(default=30.0, gt=0)

    def resolved_id(self, role: str) -> str:
        return self.instance_id or f"{role}-{uuid.uuid4().hex[:8]}"


class WorkerMetrics:
    """One instance's series: Baton's, and vLLM's for its engine (the ``vllm:*`` ones,
    labelled with the model's name once it is loaded; see :mod:`shared.serving.metrics`)."""

    def __init__(self, role: str):
        self.role = role
        self.model_name = ""  # set by :meth:`bind` once the engine has loaded
        r = self.registry = CollectorRegistry()
        self.requests = Gauge(
            "baton_requests_in_flight", f"Requests in this {role} instance", registry=r
        )
        self.kv_usage = Gauge("baton_kv_pool_usage", "Share of KV pool blocks in use", registry=r)
        self.step_s = latency_histogram(
            r, "baton_engine_step_seconds", "Duration of one engine step"
        )
        self.step_tokens = Counter(
            "baton_engine_step_tokens", "Tokens computed by engine steps", registry=r
        )
        self.swaps = Counter(
            "baton_kv_swaps",
            "Preempted requests whose KV went out to host memory or stayed in the KV store "
            "(tier, when the host space was full), and came back in",
            ["direction", "tier"],
            registry=r,
        )
        self.swap_bytes = Counter(
            "baton_kv_swap_bytes", "KV bytes swapped, by direction", ["direction"], registry=r
        )
        self.spilled_tokens = Counter(
            "baton_kv_spill_resumed_tokens",
            "Generated tokens of preempted requests whose KV was loaded back from the KV "
            "store (spilled) rather than recomputed",
            registry=r,
        )
        self.recompute_preemptions = Counter(
            "baton_preemption_recomputes",
            "Preempted requests that recompute instead of swapping: recomputing measured "
            "cheaper (cost), or the host swap space was full and nothing spilled to the "
            "KV store (no_room)",
            ["reason"],
            registry=r,
        )
        self._swap_seen = SwapStats()
        self._preemptions_seen = 0
        self.preemptions = Counter(
            "baton_preemptions",
            "Running requests preempted for KV blocks (swapped or recomputed)",
            registry=r,
        )
        self.threads = Gauge(
            "baton_engine_threads", "Threads the last engine step ran on", registry=r
        )
        self.info = Gauge(
            "baton_instance_info",
            "This instance (always 1): join on it to split series by role",
            ["role", "instance_id", MODEL_LABEL],
            registry=r,
        )
        self.vllm_running = vllm_gauge(
            r, "vllm:num_requests_running", "Number of requests in model execution batches."
        )
        self.vllm_waiting = vllm_gauge(
            r,
            "vllm:num_requests_waiting",
            "Number of requests waiting to be processed (queued for KV slots or compute, "
            "loading KV, or waiting for their first token).",
        )
        self.vllm_kv_usage = vllm_gauge(
            r, "vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage."
        )
        self.vllm_queue_time = vllm_histogram(
            r,
            "vllm:request_queue_time_seconds",
            "Histogram of time spent in WAITING phase for request.",
            VLLM_REQUEST_LATENCY_BUCKETS,
        )
        self.vllm_prefill_time = vllm_histogram(
            r,
            "vllm:request_prefill_time_seconds",
            "Histogram of time spent in PREFILL phase for request.",
            VLLM_REQUEST_LATENCY_BUCKETS,
        )

    def bind(self, model_name: str, instance_id: str) -> None:
        """The engine has loaded ``model_name``: vLLM's series carry it (at 0 from now)."""
        self.model_name = model_name
        self.info.labels(self.role, instance_id, model_name).set(1)
        for family in (self.vllm_running, self.vllm_waiting, self.vllm_kv_usage):
            family.labels(model_name)
        self.vllm_queue_time.labels(model_name)
        self.vllm_prefill_time.labels(model_name)

    def observe_step(self, seconds: float, tokens: int) -> None:
        self.step_s.observe(seconds)
        self.step_tokens.inc(tokens)

    def observe_engine(self, snap: EngineSnapshot, in_flight: int) -> None:
        """The gauges, from the engine's latest snapshot."""
        self.requests.set(in_flight)
        self.kv_usage.set(snap.usage)
        m = self.model_name
        self.vllm_running.labels(m).set(snap.running)
        self.vllm_waiting.labels(m).set(snap.waiting + snap.loading + snap.parked)
        self.vllm_kv_usage.labels(m).set(snap.usage)
        self._observe_swaps(snap.swap)
        self.preemptions.inc(snap.preemptions - self._preemptions_seen)
        self._preemptions_seen = snap.preemptions

    def _observe_swaps(self, now: SwapStats) -> None:
        seen, self._swap_seen = self._swap_seen, now
        self.swaps.labels("out", "host").inc(now.swaps_out - seen.swaps_out)
        self.swaps.labels("in", "host").inc(now.swaps_in - seen.swaps_in)
        self.swaps.labels("out", "store").inc(now.spills_out - seen.spills_out)
        self.swaps.labels("in", "store").inc(now.spills_in - seen.spills_in)
        self.spilled_tokens.inc(now.spilled_tokens_in - seen.spilled_tokens_in)
        self.swap_bytes.labels("out").inc(now.bytes_out - seen.bytes_out)
        self.swap_bytes.labels("in").inc(now.bytes_in - seen.bytes_in)
        self.recompute_preemptions.labels("cost").inc(now.recomputes - seen.recomputes)
        self.recompute_preemptions.labels("no_room").inc(
            now.recomputes_no_room - seen.recomputes_no_room
        )

    def observe_prompt_phases(self, queue_s: float, prefill_s: float) -> None:
        """A prompt computed here: arrival to its first step, first step to first token."""
        self.vllm_queue_time.labels(self.model_name).observe(queue_s)
        self.vllm_prefill_time.labels(self.model_name).observe(prefill_s)

    def render(self, refresh: Callable[[], None] | None = None) -> bytes:
        if refresh is not None:
            refresh()
        return generate_latest(self.registry)


class Worker:
    """One prefill or decode instance. Subclasses add the role's endpoints and logic."""

    role = "worker"

    def __init__(self, settings: WorkerSettings, baton: BatonSettings):
        self.settings = settings
        self.baton = baton
        self.cluster = baton.cluster_config()
        self.instance_id = settings.resolved_id(self.role)
        self.metrics = WorkerMetrics(self.role)
        self.redis = aioredis.from_url(
            self.cluster.redis_url, socket_timeout=2.0, socket_connect_timeout=2.0
        )
        self.keys = Keys(self.cluster.redis_prefix)
        self.kv = KVStoreClient(
            make_transport(self.cluster.transport),
            self.redis,
            self.keys,
            replication=self.cluster.replication,
            client_id=self.instance_id,
            member_ttl_s=self.cluster.member_ttl_s,
            secret=ClusterSecret(self.cluster.secret),
        )
        self.publisher = IndexPublisher(
            BlockIndex(self.redis, self.keys, self.cluster.index_ttl_s), self.instance_id
        )
        self.connector_metrics = ConnectorMetrics(self.metrics.registry)
        self._connector: KVStoreConnector | None = None
        self._loop: EngineLoop | None = None
        self.heartbeat: Heartbeat | None = None
        self.draining = False
        self.in_flight: dict[str, Any] = {}
        self.background = Background()

    @property
    def loop(self) -> EngineLoop:
        if self._loop is None:
            raise RuntimeError("the worker has not started")
        return self._loop

    @property
    def engine(self) -> Engine:
        return self.loop.engine

    @property
    def connector(self) -> KVStoreConnector:
        if self._connector is None:
            raise RuntimeError(f"a {self.role} instance moves no KV through the store")
        return self._connector

    @property
    def caching(self) -> bool:
        return self.baton.enable_prefix_caching

    def make_connector(self) -> KVStoreConnector | None:
        """The KV seam this role uses (None: the engine keeps its KV to itself)."""
        return None

    def engine_config(self) -> EngineConfig:
        """The engine this role runs (``BATON_*`` settings; a role may adjust defaults)."""
        return self.baton.engine_config()

    def load(self) -> dict[str, float]:
        """Published with every heartbeat; the gateway routes on it."""
        return {}

    async def start(self) -> None:
        port = self.settings.port
        self._connector = self.make_connector()
        config = self.engine_config()
        why = "set" if self.baton.dtype != "auto" else auto_dtype(config.device).reason
        log.info("%s: dtype %s (%s: %s)", self.role, config.dtype, self.baton.dtype, why)
        engine = await asyncio.to_thread(
            Engine.from_config,
            config,
            cache_dir=self.baton.cache_dir,
            progress=False,
            connector=self._connector,
        )
        self._loop = EngineLoop(
            engine,
            on_step=self._on_step,
            on_kv_events=self._on_kv_events,
            cpus=self.baton.engine_cpu_set(),
            threads=self._thread_governor(),
        )
        self.metrics.bind(engine.loaded.name, self.instance_id)
        self.connector_metrics.bind(engine.loaded.name)
        self._loop.start()
        if self._connector is not None:
            self._connector.start(asyncio.get_running_loop(), self._loop.wake)
        await self.publisher.start()
        member = Member(
            instance_id=self.instance_id,
            role=self.role,
            host=self.settings.advertise_host,
            http_port=port,
            model=engine.loaded.name,
            dtype=config.dtype,
            kv_namespace=engine.hasher.namespace,
            block_size=engine.layout.block_size,
            capacity_bytes=engine.kv_cache.num_blocks * engine.layout.block_bytes,
            started_at=time.time(),
        )

        async def resync() -> None:
            self.publisher.resync()

        self.heartbeat = Heartbeat.for_cluster(
            self.redis, self.cluster, member, load=self._load, on_reconnect=resync
        )
        await self.heartbeat.beat()
        self.heartbeat.start()
        log.info(
            "%s %s ready: %s, %d KV blocks, prefix caching %s, http %s:%d",
            self.role,
            self.instance_id,
            engine.loaded.name,
            engine.kv_cache.num_blocks,
            "on" if self.caching else "off",
            self.settings.advertise_host,
            port,
        )

    def _on_step(self, seconds: float, tokens: int) -> None:
        """Engine thread: step metrics, and the compute rate the pull cost model uses."""
        self.metrics.observe_step(seconds, tokens)
        if self._connector is not None:
            self._connector.pull.observe_compute(tokens, seconds)

    def _on_kv_events(self, events: KVEvents) -> None:
        """The local pool's holdings, published to the prompt index (cache-aware routing)."""
        if events.removed:
            self.publisher.removed(k.hex() for k in events.removed)
        if events.stored:
            self.publisher.added(k.hex() for k in events.stored)

    def refresh_gauges(self) -> None:
        if self._loop is not None:
            self.metrics.observe_engine(self._loop.snapshot, len(self.in_flight))
            self.metrics.threads.set(self._loop.stats.threads or self.baton.num_threads or 0)

    def _load(self) -> dict[str, float]:
        snap = self.loop.snapshot
        self.metrics.observe_engine(snap, len(self.in_flight))
        load = {
            "in_flight": float(len(self.in_flight)),
            "kv_usage": snap.usage,
            "free_blocks": float(snap.free_slots),
            "draining": float(self.draining),  # routers send it nothing new
            "step_s": self.loop.stats.step_time(time.perf_counter()),
            **self.load(),
        }
        hit_rate = self.connector_metrics.hit_rate()
        if hit_rate is not None:
            load["cache_hit_rate"] = hit_rate
        return load

    def admit(self) -> None:
        """Refuse new requests once draining (the gateway tries another instance)."""
        if self.draining:
            raise ServiceError(503, f"{self.role} {self.instance_id} is draining", code="draining")

    async def drain(self) -> None:
        """SIGTERM: refuse new requests (503 ``draining``: the gateway takes them
        elsewhere), hand over or finish the requests here, then leave membership; returns
        once none is left or after ``drain_timeout_s``. It stays registered meanwhile, so
        the gateway does not take a stream that is busy handing over for a hung one."""
        if self.draining:
            return
        self.draining = True
        log.info("%s %s draining %d requests", self.role, self.instance_id, len(self.in_flight))
        if self.heartbeat is not None:  # routers learn it is draining now, not in a beat
            await self._bounded(self.heartbeat.beat(), "announcing the drain")
        self.release_requests()
        deadline = time.monotonic() + self.settings.drain_timeout_s
        while self.in_flight and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if self.in_flight:
            log.warning("drain timed out with %d requests left", len(self.in_flight))
        if self.heartbeat is not None:
            await self._bounded(self.heartbeat.stop(deregister=True), "leaving membership")

    @staticmethod
    async def _bounded(step: Awaitable[object], what: str, limit_s: float = 5.0) -> None:
        """A drain step that must not hold the exit (Redis slow or gone)."""
        try:
            await asyncio.wait_for(step, limit_s)
        except TimeoutError:
            log.warning("%s took over %.0fs during the drain; going on", what, limit_s)

    def release_requests(self) -> None:
        """Draining: make the requests here end soon (a role that can hand requests over
        does it here; by default they finish where they are)."""

    async def stop(self) -> None:
        if self.heartbeat is not None:
            await self.heartbeat.stop(deregister=True)
        await self.publisher.stop(withdraw=True)
        await self.background.drain()
        if self._loop is not None:
            await self._loop.stop()
        if self._connector is not None:
            await self._connector.close()
        await self.kv.close()
        await self.kv.transport.shutdown()
        await self.redis.aclose()

    def _thread_governor(self) -> ThreadGovernor | None:
        low, high = self.baton.num_threads or 1, self.baton.max_threads
        if high is None or high <= low:
            return None
        if not ProcStatSource.available():
            log.warning("%s: BATON_MAX_THREADS ignored: no /proc/stat here", self.role)
            return None
        log.info("%s: elastic threads %d..%d", self.role, low, high)
        return ThreadGovernor(ProcStatSource(self.baton.engine_cpu_set()), low, high)

    def stats(self) -> dict[str, float]:
        s = self.loop.stats
        snap = self.loop.snapshot
        return {
            **self._load(),
            "steps": float(s.steps),
            "busy_s": s.busy_s,
            "threads": float(s.threads or self.baton.num_threads or 0),
            "thread_changes": float(s.thread_changes),
            "swaps_out": float(snap.swap.swaps_out),
            "swaps_in": float(snap.swap.swaps_in),
            "spills_out": float(snap.swap.spills_out),
            "spills_in": float(snap.swap.spills_in),
            "spilled_tokens_in": float(snap.swap.spilled_tokens_in),
            "preemptions": float(snap.preemptions),
            "kv_blocks_total": float(snap.num_slots),
            "cached_blocks": float(snap.cached_blocks),
            "waiting": float(snap.waiting),
            "loading": float(snap.loading),
            "cleanups": float(len(self.background)),
            "running": float(snap.running),
            "requests": float(len(snap.requests)),
        }


@dataclass
class TokenStream:
    """Turns a request's engine outputs into ``token`` events; remembers how it ended."""

    generated: int = 0
    finish_reason: str | None = None
    timings: RequestTimings | None = None  # the engine's, once finished
    cache_hit: CacheHit | None = None  # prompt tokens not computed here (first output)

    async def events(
        self, outputs: asyncio.Queue[Output], steps: Callable[[], int] | None = None
    ) -> AsyncIterator[TokenEvent | WaitingEvent]:
        """Raises :class:`~shared.engine.engine_loop.StreamInterrupted` when the loop
        interrupted the request. With ``steps`` (the engine's step count), a request
        that gets no token for :data:`WAITING_EVENT_S` while the engine keeps stepping
        (queued, or preempted) yields a ``waiting`` event; a stuck engine yields none."""
        seen = steps() if steps is not None else 0
        while self.finish_reason is None:
            if steps is None:
                out = await next_output(outputs)
            else:
                try:
                    out = await asyncio.wait_for(next_output(outputs), WAITING_EVENT_S)
                except TimeoutError:
                    now = steps()
                    if now > seen:
                        seen = now
                        yield WaitingEvent(steps=now)
                    continue
            self.generated = out.num_output_tokens
            if self.cache_hit is None:
                self.cache_hit = out.cache_hit
            lps: list[TokenLogprobs | None] = list(out.new_logprobs)
            lps += [None] * (len(out.new_token_ids) - len(lps))
            for i, (tid, lp) in enumerate(zip(out.new_token_ids, lps, strict=True)):
                last = out.finished and i == len(out.new_token_ids) - 1
                reason = out.finish_reason if last else None
                yield TokenEvent(
                    token=WireToken.of(tid, lp),
                    finish_reason=reason.value if reason is not None else None,
                )
            if out.finished:
                self.finish_reason = out.finish_reason.value if out.finish_reason else "abort"
                self.timings = out.timings


def bind_request_id(request: Request) -> str | None:
    """Log lines of this request's task carry the gateway's request id."""
    rid = request.headers.get(REQUEST_ID_HEADER)
    request_id_var.set(rid)
    return rid


async def stream_events(events: AsyncGenerator[BaseModel, None]) -> Response:
    """An NDJSON response of ``events``. An error before the first event is a plain HTTP
    error (status + body); later errors end the stream with an ``error`` event. Closing
    the response early (the gateway went away) closes ``events``, whose cleanup runs."""
    try:
        first = await anext(events)
    except Exception as exc:
        return error_response(exc)

    async def body() -> AsyncIterator[bytes]:
        try:
            yield encode_event(first)
            async for event in events:
                yield encode_event(event)
        except Exception as exc:
            err = classify(exc)
            yield encode_event(ErrorEvent(code=err.code or "error", message=str(err)))
        finally:
            await events.aclose()

    return StreamingResponse(body(), media_type="application/x-ndjson")


W = TypeVar("W", bound=Worker)
# a decode stream silent this long while its engine steps says it is waiting (well under
# the gateway's progress timeout)
WAITING_EVENT_S = 5.0


def create_worker_app(worker: W, title: str, routes: Callable[[FastAPI, W], None]) -> FastAPI:
    """The FastAPI app of a worker: /health /ready /stats /metrics, then ``routes``."""

    async def build() -> W:
        return worker

    app = service_app(title, build)
    secret = ClusterSecret(worker.cluster.secret)
    secret.warn_if_open(title)
    protect(app, secret, AuthMetrics(worker.metrics.registry))

    @app.get("/ready")
    async def ready() -> JSONResponse:
        up = worker._loop is not None and worker.loop.alive and not worker.draining
        redis_ok = worker.heartbeat is not None and worker.heartbeat.healthy
        status = "ready" if up and redis_ok else ("degraded" if up else "starting")
        if worker.draining:
            status = "draining"
        body = {"status": status, "redis": redis_ok, "instance_id": worker.instance_id}
        return JSONResponse(body, status_code=200 if up else 503)

    @app.get("/stats")
    async def stats() -> dict[str, float]:
        return worker.stats()

    @app.get("/metrics")
    async def metrics() -> Response:
        body = worker.metrics.render(worker.refresh_gauges)
        return Response(body, media_type="text/plain; version=0.0.4")

    routes(app, worker)
    return app
