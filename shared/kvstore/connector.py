"""The KV-store connector: the engine's KV seam implemented over the KV store.

Prefill: a request's cached prefix is looked up in the cluster's prompt index
and leased in the store (:meth:`KVStoreConnector.plan_prefill`, before the
request reaches the engine); the engine loads it inside the request's first
step, layer ``i`` landing while layer ``i - 1`` computes, if pulling is
cheaper than recomputing (:class:`PullCost`). Every prompt block the store
lacks is written into a two-phase put as soon as its layer is final, and the
put commits once all of them are in.

Decode: the prompt's blocks are loaded asynchronously (the store serves layers
while prefill still writes them), except those the local pool already holds;
the request computes once they are in. When a request ends, its prompt+answer
blocks that decode computed are written to the store (``save_on_finish``), so
the next turn of a conversation reuses them.

A load that fails (stale index entry, evicted block, dead store node) is
reported to the engine, which recomputes: a stale cache costs time, never
tokens. Every transfer runs on the event loop; the engine thread only
dispatches work and, in :meth:`wait_for_layer` and :meth:`end_step`, waits for
what it must not outrun.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
import uuid
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass, field
from typing import Any

from shared.engine.kv_cache_manager import Slot, cdiv
from shared.engine.kv_connector import NO_HIT, ConnectorEvents, ExternalHit, KVConnector
from shared.engine.request import Request, RequestId
from shared.engine.scheduler import SchedulerOutput
from shared.errors import KVMissError, KVStoreError, TransportError
from shared.kv.kv_cache import KVCache
from shared.kv.layout import KVLayout
from shared.kvstore.client import KVStoreClient, LeaseSet
from shared.kvstore.connector_metrics import ConnectorMetrics
from shared.kvstore.pull_cost import PullCost, PullPolicy
from shared.kvstore.transfers import Events, Load, PutJob

log = logging.getLogger(__name__)
TRANSFER_ERRORS = (KVStoreError, TransportError, asyncio.CancelledError)


@dataclass(eq=False)
class StorePlan:
    """What the connector moves for one request; it travels as ``Request.kv_transfer``.

    ``load_ids``: store ids of the request's leading blocks that can be loaded
    (prefill: a leased cached prefix; decode: every prompt block, the partial
    tail included). ``put``: the prompt's blocks, written as they are computed.
    """

    load_ids: list[str] = field(default_factory=list)
    asynchronous: bool = False
    wait_s: float = 0.0
    lease: LeaseSet | None = None
    put_job: PutJob | None = None
    save_on_finish: bool = False

    @property
    def put_ids(self) -> list[str]:
        return self.put_job.ids if self.put_job is not None else []


def _retrieve(fut: asyncio.Future[None]) -> None:
    if not fut.cancelled():
        fut.exception()


def _plan(req: Request) -> StorePlan | None:
    return req.kv_transfer if isinstance(req.kv_transfer, StorePlan) else None


class KVStoreConnector(KVConnector):
    def __init__(
        self,
        kv: KVStoreClient,
        metrics: ConnectorMetrics,
        *,
        caching: bool,
        pull_policy: PullPolicy = "auto",
        put_ttl_s: float = 300.0,
        load_timeout_s: float = 180.0,
    ):
        self.kv = kv
        self.metrics = metrics
        self.caching = caching
        self.pull_policy = pull_policy
        self.put_ttl_s = put_ttl_s
        self.layout: KVLayout  # set by bind()
        self.pull: PullCost  # set by bind()
        self.load_timeout_s = load_timeout_s
        self._aio: asyncio.AbstractEventLoop | None = None
        self._wake: Callable[[], None] = lambda: None
        self._cond = threading.Condition()
        self._events = Events()
        self._tasks: set[asyncio.Task[None]] = set()
        # engine thread
        self._loads: dict[RequestId, Load] = {}
        self._step_loads: list[Load] = []
        self._poisoned: set[RequestId] = set()
        self._step_plan: list[tuple[PutJob, list[int], list[Slot]]] = []
        self._writes_pending = 0  # under _cond

    def bind(self, pool: KVCache) -> None:
        super().bind(pool)
        self.layout = pool.layout
        self.pull = PullCost(pool.layout.bytes_per_token, self.pull_policy)

    def start(self, loop: asyncio.AbstractEventLoop, wake: Callable[[], None]) -> None:
        """Run transfers on ``loop``; ``wake`` rouses the engine thread (both once)."""
        self._aio = loop
        self._wake = wake

    @property
    def kv_pool(self) -> KVCache:
        if self.pool is None:
            raise RuntimeError("the connector is not bound to an engine's KV pool")
        return self.pool

    def _soon(self, fn: Callable[..., object], *args: object) -> None:
        if self._aio is None:
            raise RuntimeError("KVStoreConnector.start() was not called")
        self._aio.call_soon_threadsafe(fn, *args)

    def _spawn(self, coro: Coroutine[Any, Any, None], name: str) -> asyncio.Task[None]:
        task = asyncio.get_running_loop().create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    # -- planning (event loop, before the request reaches the engine) ---------------------
    async def plan_prefill(self, req: Request, *, whole_blocks: bool = False) -> StorePlan:
        """Lease the longest cached prefix the store holds and open the put of the
        prompt's blocks (content-addressed when caching, else request-scoped)."""
        plan = StorePlan()
        bs = self.layout.block_size
        keys = [k.hex() for k in req.block_keys]
        if self.caching and self.pull.policy != "never":
            usable = keys[: (req.num_prompt_tokens - 1) // bs]
            plan.lease, plan.load_ids = await self._lease_prefix(usable)
        ids = keys if self.caching else [uuid.uuid4().hex for _ in keys]
        if req.num_prompt_tokens % bs:
            ids.append(uuid.uuid4().hex)  # the partial tail is request-scoped
        try:
            put = await self.kv.begin_put(
                ids,
                [self.layout.block_bytes] * len(ids),
                num_layers=self.layout.num_layers,
                ttl_s=self.put_ttl_s,
            )
        except BaseException:
            await self._release_lease(plan.lease)
            raise
        needed = {i for _, wanted in put.targets.values() for i in wanted}
        committed: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        committed.add_done_callback(_retrieve)  # a failure nobody awaits is not an error
        job = PutJob(
            req.request_id,
            put,
            ids,
            frozenset(p for p, i in enumerate(ids) if i in needed),
            whole_blocks,
            committed,
        )
        job.writer = self._spawn(self._writer(job), f"kv-put:{req.request_id}")
        if job.complete:  # the store holds every block already
            self._spawn(self._commit(job), f"kv-put-commit:{req.request_id}")
        plan.put_job = job
        return plan

    def plan_decode(self, store_ids: Sequence[str], wait_s: float) -> StorePlan:
        """The prompt's blocks come from the store (as prefill writes them)."""
        return StorePlan(
            load_ids=list(store_ids), asynchronous=True, wait_s=wait_s, save_on_finish=self.caching
        )

    async def abandon(self, plan: StorePlan) -> None:
        """A plan whose request never reached the engine: undo its lease and put."""
        await self._release_lease(plan.lease)
        plan.lease = None
        if plan.put_job is not None:
            await self._end_put(plan.put_job)

    async def _lease_prefix(self, ids: list[str]) -> tuple[LeaseSet | None, list[str]]:
        """Lease the longest prefix of ``ids`` the index says the store holds. An entry
        the store no longer backs shortens the prefix (once) and is counted."""
        if not ids:
            return None, []
        n = await self.kv.lookup(ids)
        for _ in range(2):
            if n == 0:
                return None, []
            try:
                return await self.kv.lease(ids[:n], ttl_s=self.put_ttl_s), ids[:n]
            except KVMissError as exc:
                self.metrics.stale.inc()
                missing = [ids.index(i) for i in exc.ids if i in ids[:n]]
                n = min(missing) if missing else 0
            except (KVStoreError, TransportError) as exc:
                log.warning("leasing a cached prefix failed; recomputing it: %s", exc)
                return None, []
        return None, []

    async def _release_lease(self, lease: LeaseSet | None) -> None:
        if lease is not None:
            await lease.release()

    # -- the connector (engine thread) ------------------------------------------------------
    def external_hit(self, request: Request, num_local_tokens: int) -> ExternalHit:
        plan = _plan(request)
        if plan is None or not plan.load_ids:
            return NO_HIT
        bs = self.layout.block_size
        if plan.asynchronous:  # the prompt's blocks, the partial tail included
            loadable = min(request.num_prompt_tokens, len(plan.load_ids) * bs)
            return ExternalHit(max(0, loadable - num_local_tokens), asynchronous=True)
        tokens = len(plan.load_ids) * bs - num_local_tokens
        if tokens <= 0:
            return NO_HIT
        if not self.pull.worth_pulling(tokens):
            self.metrics.declined.inc(tokens)
            return NO_HIT
        return ExternalHit(tokens)

    def start_load(self, request: Request, first_block: int, slots: Sequence[Slot]) -> None:
        plan = _plan(request)
        ids = plan.load_ids[first_block : first_block + len(slots)] if plan else []
        if plan is None or len(ids) != len(slots):
            raise RuntimeError(f"no load of {len(slots)} blocks was offered to {request}")
        load = Load(
            request.request_id, ids, list(slots), plan.asynchronous, plan.wait_s, plan.lease
        )
        plan.lease = None  # the load releases it
        self._loads[request.request_id] = load
        if not load.asynchronous:
            self._step_loads.append(load)
        self._soon(self._launch, load)

    def wait_for_layer(self, layer: int) -> None:
        loads = self._step_loads
        if not loads:
            return
        deadline = time.monotonic() + self.load_timeout_s
        cancelled = False
        with self._cond:
            while pending := [x for x in loads if not x.done and x.layers <= layer]:
                if not cancelled and time.monotonic() >= deadline:
                    log.warning("%d in-step KV loads stalled; cancelling them", len(pending))
                    for load in pending:
                        self._soon(self._cancel, load)
                    cancelled = True
                self._cond.wait(timeout=1.0)
            self._poisoned = {x.request_id for x in loads if x.failed}

    def save_layer(self, layer: int, step: SchedulerOutput) -> None:
        if layer == 0:
            self._step_plan = self._plan_step(step)
        last = layer == self.layout.num_layers - 1
        for job, idxs, slots in self._step_plan:
            if job.request_id in self._poisoned:
                job.next_block = min(job.next_block, job.step_start)  # rewrite them on retry
                continue
            if job.whole_blocks and not last:
                continue
            with self._cond:
                self._writes_pending += 1
            self._soon(job.queue.put_nowait, (layer, idxs, slots))

    def _plan_step(self, step: SchedulerOutput) -> list[tuple[PutJob, list[int], list[Slot]]]:
        """Per request with a put: the blocks that become final in this step (every
        block whose last token is computed now; on the prompt's last chunk, the partial
        tail too) and the store lacks."""
        bs = self.layout.block_size
        out = []
        for s in step.scheduled:
            plan = _plan(s.request)
            job = plan.put_job if plan is not None else None
            if job is None:
                continue
            end = s.request.num_computed_tokens + s.num_new_tokens
            final = cdiv(end, bs) if end >= s.request.num_prompt_tokens else end // bs
            final = min(final, len(job.ids))
            job.step_start = job.next_block
            idxs = [i for i in range(job.next_block, final) if i in job.needed]
            job.next_block = max(job.next_block, final)
            if idxs:
                out.append((job, idxs, [s.request.slots[i] for i in idxs]))
        return out

    def end_step(self) -> frozenset[RequestId]:
        loads = self._step_loads
        with self._cond:
            while self._writes_pending or any(not x.done for x in loads):
                self._cond.wait(timeout=1.0)
        failed = frozenset(x.request_id for x in loads if x.failed)
        for load in loads:
            self._loads.pop(load.request_id, None)
        self._step_loads = []
        self._poisoned = set()
        self._step_plan = []
        if failed:
            self.metrics.stale.inc(len(failed))
            log.warning("%d in-step KV loads failed; recomputing those requests", len(failed))
        return failed

    def request_finished(self, request: Request) -> bool:
        plan = _plan(request)
        if plan is None:
            return False
        held = False
        load = self._loads.pop(request.request_id, None)
        if load is not None:
            with self._cond:
                held = load.abandoned = not load.done
            if held:
                self._soon(self._cancel, load)
        if plan.lease is not None:  # leased but never loaded
            self._soon(self._spawn_release, plan.lease)
            plan.lease = None
        if plan.put_job is not None:
            self._soon(self._spawn_end_put, plan.put_job)
        if not held and plan.save_on_finish:
            held = self._save_computed(request)
        return held

    def poll(self) -> ConnectorEvents:
        return self._events.take()

    def _save_computed(self, req: Request) -> bool:
        """Write the full blocks decode computed (from the prompt's tail on) to the store;
        True while that reads the request's slots."""
        bs = self.layout.block_size
        first, full = req.num_prompt_tokens // bs, req.num_computed_tokens // bs
        if full <= first or len(req.block_keys) < full:
            return False
        ids = [k.hex() for k in req.block_keys[first:full]]
        self._soon(self._spawn_save, req.request_id, ids, req.slots[first:full])
        return True

    # -- the event loop ----------------------------------------------------------------------
    def _launch(self, load: Load) -> None:
        load.task = self._spawn(self._run_load(load), f"kv-load:{load.request_id}")

    def _cancel(self, load: Load) -> None:
        if load.task is not None:
            load.task.cancel()

    async def _run_load(self, load: Load) -> None:
        started = time.perf_counter()
        into = [self.kv_pool.block(s) for s in load.slots]
        error: BaseException | None = None
        try:
            async for layer in self.kv.stream(
                load.ids, into, num_layers=self.layout.num_layers, wait_s=load.wait_s
            ):
                with self._cond:
                    load.layers = layer + 1
                    self._cond.notify_all()
        except TRANSFER_ERRORS as exc:
            error = exc
        except Exception as exc:  # a bug must not leave the engine waiting forever
            log.exception("KV load of %s failed", load.request_id)
            error = exc
        finally:
            await self._release_lease(load.lease)
        seconds = time.perf_counter() - started
        nbytes = len(into) * self.layout.block_bytes
        if error is None:
            self.metrics.observe_load(nbytes, seconds)
            self.pull.observe_load(nbytes, seconds)
            self.metrics.crossover.set(min(self.pull.crossover_tokens(), 1e9))
        elif not isinstance(error, asyncio.CancelledError):
            log.warning("KV load of %s failed: %s", load.request_id, error)
        with self._cond:
            load.error, load.done = error, True
            abandoned = load.abandoned
            self._cond.notify_all()
        if abandoned:
            self._events.released(load.request_id)
        elif load.asynchronous and error is None:
            self._events.loaded(load.request_id)
        elif load.asynchronous:
            self.metrics.stale.inc()
            self._events.failed(load.request_id)
        self._wake()

    async def _writer(self, job: PutJob) -> None:
        """Write each layer item of the job as it comes; commit once complete. An item
        counts as done (the engine may reuse its slots) once its bytes left; the commit
        round trip happens after that, off the engine's path."""
        num_layers = self.layout.num_layers
        pool = self.kv_pool.pool
        while (item := await job.queue.get()) is not None:
            layer, idxs, slots = item
            try:
                if not job.failed:
                    ids = [job.ids[i] for i in idxs]
                    if job.whole_blocks:
                        await job.put.write(ids, [pool[s] for s in slots])
                        nbytes = len(slots) * self.layout.block_bytes
                    else:
                        segments = [pool[s, layer] for s in slots]
                        await job.put.write(ids, segments, layers=(layer, layer + 1))
                        nbytes = len(slots) * self.layout.layer_bytes
                    self.metrics.saved_bytes.inc(nbytes)
                    if layer == num_layers - 1:
                        job.written.update(idxs)
            except (KVStoreError, TransportError) as exc:
                job.failed = True
                log.warning("KV put of %s failed: %s", job.request_id, exc)
                self._settle_put(job, exc)
            except Exception as exc:  # a bug must not leave the engine waiting forever
                job.failed = True
                log.exception("KV put of %s failed", job.request_id)
                self._settle_put(job, exc)
            finally:
                with self._cond:
                    self._writes_pending -= 1
                    self._cond.notify_all()
            if job.complete and not job.failed and not job.committed.done():
                await self._commit(job)

    async def _commit(self, job: PutJob) -> None:
        try:
            await job.put.commit()
        except (KVStoreError, TransportError) as exc:
            job.failed = True
            log.warning("committing the KV put of %s failed: %s", job.request_id, exc)
            self._settle_put(job, exc)
            return
        self._settle_put(job)

    def _settle_put(self, job: PutJob, error: BaseException | None = None) -> None:
        if job.committed.done():
            return
        if error is None:
            job.committed.set_result(None)
        else:
            job.committed.set_exception(error)

    def _spawn_end_put(self, job: PutJob) -> None:
        self._spawn(self._end_put(job), f"kv-put-end:{job.request_id}")

    async def _end_put(self, job: PutJob) -> None:
        """Stop the writer once it drained; revoke the put unless it committed."""
        job.queue.put_nowait(None)
        if job.writer is not None:
            await asyncio.gather(job.writer, return_exceptions=True)
        if not (job.committed.done() and job.committed.exception() is None):
            self._settle_put(job, KVStoreError("the request ended before its KV was stored"))
            try:
                await job.put.revoke()
            except (KVStoreError, TransportError) as exc:  # the reservation's TTL frees it
                log.warning("revoking the KV put of %s failed: %s", job.request_id, exc)

    def _spawn_release(self, lease: LeaseSet) -> None:
        self._spawn(lease.release(), "kv-lease-release")

    def _spawn_save(self, rid: RequestId, ids: list[str], slots: list[Slot]) -> None:
        self._spawn(self._save(rid, ids, slots), f"kv-save:{rid}")

    async def _save(self, rid: RequestId, ids: list[str], slots: list[Slot]) -> None:
        """Prompt+answer caching: whole blocks, two-phase, only those the store lacks."""
        pool = self.kv_pool
        try:
            put = await self.kv.begin_put(
                ids,
                [self.layout.block_bytes] * len(ids),
                num_layers=self.layout.num_layers,
                ttl_s=self.put_ttl_s,
            )
            try:
                await put.write(ids, [pool.block(s) for s in slots])
                await put.commit()
            except BaseException:
                await put.revoke()
                raise
            self.metrics.saved_bytes.inc(len(ids) * self.layout.block_bytes)
        except (KVStoreError, TransportError) as exc:
            log.warning("caching the answer blocks of %s failed: %s", rid, exc)
        finally:
            self._events.released(rid)
            self._wake()

    async def close(self) -> None:
        """Cancel whatever still runs (service shutdown)."""
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
