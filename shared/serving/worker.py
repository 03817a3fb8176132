"""What a prefill and a decode instance share: the engine on its thread (with the
KV-store connector as its KV seam, for the roles that move KV), Redis membership
with load, the publisher of the local pool's holdings to the prompt index, the KV
store client and settings. Its series are in :mod:`shared.serving.worker_metrics`,
its HTTP app in :mod:`shared.serving.worker_app`, and a request's token stream in
:mod:`shared.serving.token_stream`.

Long-lived parts are created once in :meth:`Worker.start` (called from the
FastAPI lifespan) and torn down in reverse order by :meth:`Worker.stop`.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Awaitable
from typing import Any

from pydantic import Field
from pydantic_settings import BaseSettings

from shared.cluster import redis_client
from shared.cluster.auth import ClusterSecret
from shared.cluster.block_index import BlockIndex, IndexPublisher, window_entry
from shared.cluster.keys import Keys
from shared.cluster.membership import Heartbeat, Member, default_advertise_host
from shared.config import BatonSettings, EngineConfig
from shared.engine.elastic_threads import ProcStatSource, ThreadGovernor
from shared.engine.engine import Engine
from shared.engine.engine_loop import (
    ENGINE_THREAD,
    EngineLoop,
    keep_openmp_off_this_thread,
    on_passing_thread,
)
from shared.engine.kv_events import KVEvents
from shared.engine.step_pacer import StepPacer
from shared.hardware import auto_dtype
from shared.kvstore.client import KVStoreClient
from shared.kvstore.connector import KVStoreConnector
from shared.kvstore.connector_metrics import ConnectorMetrics
from shared.serving.background import Background
from shared.serving.errors import ServiceError
from shared.serving.worker_metrics import WorkerMetrics
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


class Worker:
    """One prefill or decode instance. Subclasses add the role's endpoints and logic."""

    role = "worker"

    def __init__(self, settings: WorkerSettings, baton: BatonSettings):
        self.settings = settings
        self.baton = baton
        self.cluster = baton.cluster_config()
        self.instance_id = settings.resolved_id(self.role)
        self.metrics = WorkerMetrics(self.role)
        self.redis = redis_client.connect(self.cluster.redis_url)
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
    def serving(self) -> bool:
        """Its engine loop runs and it takes new requests (it is not draining)."""
        return self._loop is not None and self._loop.alive and not self.draining

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
        keep_openmp_off_this_thread()
        connector = self._connector
        engine = await on_passing_thread(
            lambda: Engine.from_config(
                config, cache_dir=self.baton.cache_dir, progress=False, connector=connector
            )
        )
        self._loop = EngineLoop(
            engine,
            on_step=self._on_step,
            on_kv_events=self._on_kv_events,
            cpus=self.baton.engine_cpu_set(),
            threads=self._thread_governor(),
            pacer=self.step_pacer(),
        )
        self.metrics.bind(engine.loaded.name, self.instance_id)
        self.connector_metrics.bind(engine.loaded.name)
        self._loop.start()
        if self._connector is not None:
            self._connector.start(asyncio.get_running_loop(), self._loop.wake)
            reached = await self.kv.connect()
            log.info("%s: connected to %d KV store node(s)", self.role, reached)
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
            kv_window=engine.kv_cache.groups.window if engine.kv_cache.windowed else None,
            capacity_bytes=engine.kv_cache.nbytes,
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
            "%s %s ready: %s, %d KV slots (%s), prefix caching %s, http %s:%d",
            self.role,
            self.instance_id,
            engine.loaded.name,
            engine.kv_cache.num_blocks,
            engine.kv_cache.groups.describe(),
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
        if events.removed or events.window_removed:
            self.publisher.removed(k.hex() for k in events.removed)
            self.publisher.removed(window_entry(k.hex()) for k in events.window_removed)
        if events.stored or events.window_stored:
            self.publisher.added(k.hex() for k in events.stored)
            self.publisher.added(window_entry(k.hex()) for k in events.window_stored)

    def refresh_gauges(self) -> None:
        if self._loop is not None:
            self.metrics.observe_engine(self._loop.snapshot, len(self.in_flight))
            self.metrics.threads.set(self._loop.stats.threads or self.baton.num_threads or 0)
            self.metrics.observe_thread_seconds(self._loop.stats.thread_seconds)

    def _load(self) -> dict[str, float]:
        snap = self.loop.snapshot
        self.metrics.observe_engine(snap, len(self.in_flight))
        load = {
            "in_flight": float(len(self.in_flight)),
            "kv_usage": snap.usage,
            "free_blocks": float(snap.free_slots),
            "draining": float(self.draining),  # routers send it nothing new
            "step_s": self.loop.stats.step_time(time.perf_counter()),
            "tokens_s": self.loop.stats.recent_tokens_s,  # prompt throughput, for SLO lending
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

    def step_pacer(self) -> StepPacer | None:
        """Paces this role's steps to a latency target (None: back to back)."""
        return None

    def _thread_governor(self) -> ThreadGovernor | None:
        low, high = self.baton.num_threads or 1, self.baton.max_threads
        if high is None or high <= low:
            return None
        if not ProcStatSource.available():
            log.warning("%s: BATON_MAX_THREADS ignored: no /proc/stat here", self.role)
            return None
        log.info("%s: elastic threads %d..%d", self.role, low, high)
        source = ProcStatSource(self.baton.engine_cpu_set(), engine_thread=ENGINE_THREAD)
        return ThreadGovernor(source, low, high)

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
            # pacing (a TPOT target): steps held back, and the time given to others
            "paced_steps": float(self.loop.pacer.paced_steps if self.loop.pacer else 0),
            "paced_s": self.loop.pacer.paced_s if self.loop.pacer else 0.0,
            # seconds of engine steps on 2+ threads (elastic prefill using a freed core)
            "multi_thread_s": sum(v for n, v in s.thread_seconds.items() if n > 1),
        }
