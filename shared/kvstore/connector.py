"""The KV-store connector: the engine's KV seam implemented over the KV store.

Prefill: a request's cached prefix is looked up in the cluster's prompt index
and leased in the store (:meth:`KVStoreConnector.plan_prefill`, before the
request reaches the engine); the engine loads it inside the request's first
step, layer ``i`` landing while layer ``i - 1`` computes, if pulling is
cheaper than recomputing (:class:`PullCost`). Every prompt block the store
lacks is written into a two-phase put as soon as its layer is final, and the
put commits once all of them are in; the put's reservation is not waited for
before the request computes (blocks final before it is back are copied out and
sent once it is).

Decode: the prompt's blocks are loaded asynchronously (the store serves layers
while prefill still writes them), except those the local pool already holds;
the request computes once they are in. Every block decode completes is copied
to a staging buffer at the end of its step and written to the store in the
background (``replicate``; it lags rather than block when staging runs out),
and when the request ends the blocks not yet written follow from its slots:
the prompt+answer of a conversation is in the store for its next turn. A
request preempted when host swap space is full spills: its last completed
blocks are staged before its slots go, and when it is admitted again it loads
every block committed by then (prompt and answer) and recomputes only the rest.

A load that fails (stale index entry, evicted block, dead store node) is
reported to the engine, which recomputes: a stale cache costs time, never
tokens. Every transfer runs on the event loop; the engine thread only
dispatches work and, in :meth:`wait_for_layer` and :meth:`end_step`, waits for
what it must not outrun.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from shared.cluster.watermarks import Watermark
from shared.engine.kv_cache_manager import Slot, cdiv
from shared.engine.kv_connector import NO_HIT, ConnectorEvents, ExternalHit, KVConnector
from shared.engine.request import Request, RequestId
from shared.engine.scheduler_output import SchedulerOutput
from shared.errors import BatonError, KVMissError, KVStoreError, TransportError
from shared.kv.kv_cache import KVCache
from shared.kv.layout import KVLayout
from shared.kvstore.client import KVStoreClient, LeaseSet
from shared.kvstore.connector_metrics import ConnectorMetrics
from shared.kvstore.pool_copies import Later, PoolCopies, Ready, SlotBytes, pool_copies
from shared.kvstore.pull_cost import PullCost, PullPolicy
from shared.kvstore.replicator import Replicator
from shared.kvstore.transfer_tasks import TransferTasks, release, retrieve
from shared.kvstore.transfers import LayerItem, Load, PutJob, StagingPool

log = logging.getLogger(__name__)
# a put's copies held for the first token (host rows): past this they go at once, taking
# CPU from the prompt's compute rather than memory without bound
MAX_HELD_BYTES = 256 << 20


@dataclass(eq=False)
class StorePlan:
    """What the connector moves for one request; it travels as ``Request.kv_transfer``.

    ``load_ids``: store ids of the request's leading blocks that can be loaded
    (prefill: a leased cached prefix; decode: every prompt block, the partial
    tail included). ``put_job``: the prompt's blocks, written as they are computed.
    """

    load_ids: list[str] = field(default_factory=list)
    load_tokens: int = 0  # tokens load_ids cover (the last block may be partial)
    asynchronous: bool = False
    wait_s: float = 0.0
    lease: LeaseSet | None = None
    put_job: PutJob | None = None
    replicate: bool = False  # decode: write every block it completes to the store

    @property
    def put_ids(self) -> list[str]:
        return self.put_job.ids if self.put_job is not None else []


def _plan(req: Request) -> StorePlan | None:
    return req.kv_transfer if isinstance(req.kv_transfer, StorePlan) else None


class KVStoreConnector(KVConnector):
    def __init__(
        self,
        kv: KVStoreClient,
        metrics: ConnectorMetrics,
        *,
        caching: bool,
        replicate: bool = True,
        pull_policy: PullPolicy = "auto",
        put_ttl_s: float = 300.0,
        load_timeout_s: float = 180.0,
        staging_blocks: int = 64,
        layerwise: Callable[[], bool] | None = None,
    ):
        """``layerwise``: asked on the engine thread as each step begins, whether its
        prompt blocks may go to the store layer by layer while the next layers compute
        (None: always); False sends them whole once the step's last layer is done, for
        a step that keeps every core busy and would lose more to the transfers'
        CPU than it gains from the overlap."""
        self.kv = kv
        self.metrics = metrics
        self.caching = caching
        self.replicate = replicate
        self.pull_policy = pull_policy
        self.put_ttl_s = put_ttl_s
        self.load_timeout_s = load_timeout_s
        self.staging_blocks = staging_blocks
        self.layerwise = layerwise
        self._step_whole = False  # this step's put jobs send whole blocks at its end
        self.tasks = TransferTasks(kv, metrics, put_ttl_s=put_ttl_s)
        self.layout: KVLayout  # set by bind()
        self.pull: PullCost  # set by bind()
        self.copies: PoolCopies  # set by bind()
        # engine thread
        self._loads: dict[RequestId, Load] = {}
        self._step_loads: list[Load] = []
        self._poisoned: set[RequestId] = set()
        self._step_plan: list[tuple[PutJob, list[int], list[Slot], bool]] = []
        self._later: list[Later] = []  # copies deferred past the step's outputs
        self.replicator = Replicator(self.tasks, caching=caching)

    def bind(self, pool: KVCache) -> None:
        super().bind(pool)
        self.layout = pool.layout
        bpt, groups = pool.layout.bytes_per_token, pool.groups
        self.pull = PullCost(
            bpt,
            self.pull_policy,
            block_size=pool.layout.block_size,
            window=(groups.window or 0) if groups.windowed else 0,
            window_bytes_per_token=groups.window_bytes_per_token(bpt),
        )
        self.copies = pool_copies(pool)
        self.tasks.pool, self.tasks.pull, self.tasks.copies = pool, self.pull, self.copies
        if self.staging_blocks:
            buffers = self.copies.staging(self.staging_blocks, pool.layout.block_bytes)
            self.tasks.staging = StagingPool(buffers)

    def start(self, loop: asyncio.AbstractEventLoop, wake: Callable[[], None]) -> None:
        """Run transfers on ``loop``; ``wake`` rouses the engine thread (both once)."""
        self.tasks.start(loop, wake)

    async def close(self) -> None:
        await self.tasks.close()

    # -- planning (event loop, before the request reaches the engine) ---------------------
    async def plan_prefill(
        self,
        req: Request,
        *,
        whole_blocks: bool = False,
        hold_staged: bool = False,
        indexed_tokens: int | None = None,
    ) -> StorePlan:
        """Lease the longest cached prefix the store holds and open the put of the
        prompt's blocks (content-addressed when caching, else request-scoped).
        Returns once the lease is settled (the engine must know what it loads); the
        put's reservation goes out at once too but is waited for by its writer only,
        so its round trip overlaps the prompt's compute instead of preceding it (a
        store that refuses it fails the put, not the prompt). ``hold_staged``: staged
        whole blocks wait for ``put_job.send_staged``, which the caller must set (once
        the first token left, and whatever happens: the put neither commits nor ends
        before). ``indexed_tokens``: what the index said the store holds of the
        prompt a moment ago (the gateway's lookup as it routed it); with 0 it is not
        asked again (a block indexed since then is recomputed rather than loaded)."""
        plan = StorePlan()
        bs = self.layout.block_size
        keys = [k.hex() for k in req.block_keys]
        # the cached prefix's lease and the put are independent round trips: both at once
        leasing: asyncio.Task[tuple[LeaseSet | None, list[str]]] | None = None
        if self.caching and self.pull.policy != "never" and indexed_tokens != 0:
            usable = keys[: (req.num_prompt_tokens - 1) // bs]
            leasing = asyncio.ensure_future(self._lease_prefix(usable))
            await asyncio.sleep(0)  # its lookup goes out first, as it did alone
        ids = keys if self.caching else [uuid.uuid4().hex for _ in keys]
        if req.num_prompt_tokens % bs:
            ids.append(uuid.uuid4().hex)  # the partial tail is request-scoped
        reserved = asyncio.ensure_future(
            self.kv.begin_put(
                ids,
                [self.layout.block_bytes] * len(ids),
                num_layers=self.layout.num_layers,
                ttl_s=self.put_ttl_s,
            )
        )
        reserved.add_done_callback(retrieve)  # its writer or end_put reports a failure
        committed: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        committed.add_done_callback(retrieve)  # a failure nobody awaits is not an error
        every = frozenset(range(len(ids)))  # until the store says which it lacks
        job = PutJob(req.request_id, reserved, ids, every, whole_blocks, committed)
        if leasing is not None:
            try:
                plan.lease, plan.load_ids = await leasing
            except BaseException:
                await asyncio.shield(self.tasks.end_put(job))
                await _drop_lease(leasing)
                raise
        if hold_staged:
            job.send_staged.clear()
        reserved.add_done_callback(lambda _: self._reserved(job))
        job.writer = self.tasks.spawn(self.tasks.writer(job), f"kv-put:{req.request_id}")
        plan.put_job = job
        return plan

    def _reserved(self, job: PutJob) -> None:
        """The put's reservation came back: only the blocks the store lacks are needed
        now; commit at once if it holds every one already (a failed reservation fails
        the job at its writer)."""
        if job.reserved.cancelled() or job.reserved.exception() is not None:
            return
        put = job.reserved.result()
        wanted = {i for _, mine in put.targets.values() for i in mine}
        job.needed = frozenset(p for p, i in enumerate(job.ids) if i in wanted)
        if job.complete and not job.failed:
            self.tasks.spawn(self.tasks.commit(job), f"kv-put-commit:{job.request_id}")

    def plan_decode(self, store_ids: Sequence[str], tokens: int, wait_s: float) -> StorePlan:
        """The request's first ``tokens`` of KV come from the store (as prefill writes
        them, or as an earlier decode replicated them); what it computes is written to
        the store as it completes: for failover (replication, with a watermark) and for
        reuse (caching); with neither, nothing is."""
        return StorePlan(
            load_ids=list(store_ids),
            load_tokens=tokens,
            asynchronous=True,
            wait_s=wait_s,
            replicate=self.replicate or self.caching,
        )

    async def final_watermark(self, request_id: str) -> Watermark | None:
        """After a request was aborted here: how much of its KV is in the store, once its
        last blocks are written (a drain hands this to the next instance)."""
        return await self.tasks.final_watermark(RequestId(request_id))

    async def abandon(self, plan: StorePlan) -> None:
        """A plan whose request never reached the engine: undo its lease and put."""
        await release(plan.lease)
        plan.lease = None
        if plan.put_job is not None:
            await self.tasks.end_put(plan.put_job)

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

    # -- the connector (engine thread) ------------------------------------------------------
    def external_hit(self, request: Request, num_local_tokens: int) -> ExternalHit:
        plan = _plan(request)
        if plan is not None and request.spilled:
            self._resume_from_store(request, plan)
        if plan is None or not plan.load_ids:
            return NO_HIT
        bs = self.layout.block_size
        if plan.asynchronous:  # the last block may be partial (the prompt's tail)
            loadable = min(plan.load_tokens, len(plan.load_ids) * bs)
            return ExternalHit(max(0, loadable - num_local_tokens), asynchronous=True)
        tokens = len(plan.load_ids) * bs - num_local_tokens
        if tokens <= 0:
            return NO_HIT
        if not self.pull.worth_pulling(tokens):
            self.metrics.declined.inc(tokens)
            return NO_HIT
        return ExternalHit(tokens)

    def _resume_from_store(self, request: Request, plan: StorePlan) -> None:
        """A spilled request comes back: load what its replication committed, when that
        is more than the prompt. Every block it loads now is committed: an uncommitted
        one is recomputed, never waited for."""
        committed = self.replicator.committed_ids(request.request_id)
        tokens = len(committed) * self.layout.block_size
        if tokens > plan.load_tokens:
            plan.load_ids, plan.load_tokens = committed, tokens
        plan.wait_s = 0.0

    def spill(self, request: Request) -> bool:
        """Keep a preempted decode request's KV in the store when loading its generated
        part back is cheaper than recomputing it (the pull cost model: this instance's
        measured load bandwidth against its compute rate). Not after a failed load: the
        request then recomputes and loads nothing."""
        plan = _plan(request)
        if plan is None or not (plan.asynchronous and plan.replicate and request.load_external):
            return False
        if not self.pull.worth_pulling(request.num_computed_tokens - request.num_prompt_tokens):
            return False
        return self.replicator.spill(request, self._stored_ids)

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
        self.tasks.soon(self.tasks.launch, load)

    def loading(self, request_id: RequestId) -> bool:
        """Whether a load into ``request_id``'s slots is still moving bytes. Read from
        the event loop: a decode stream counts it as progress, which no engine step
        shows; once the load ended it stops counting, whether or not the engine thread
        took it up (a stuck one does not)."""
        with self.tasks.cond:
            load = self._loads.get(request_id)
            return load is not None and not load.done

    def wait_for_layer(self, layer: int) -> None:
        loads = self._step_loads
        if not loads:
            return
        deadline = time.monotonic() + self.load_timeout_s
        cancelled = False
        cond = self.tasks.cond
        with cond:
            while pending := [x for x in loads if not x.done and x.layers <= layer]:
                if not cancelled and time.monotonic() >= deadline:
                    log.warning("%d in-step KV loads stalled; cancelling them", len(pending))
                    for load in pending:
                        self.tasks.soon(self.tasks.cancel, load)
                    cancelled = True
                cond.wait(timeout=1.0)
            self._poisoned = {x.request_id for x in loads if x.failed}
            ready = [x.layer_ready[layer] for x in loads if len(x.layer_ready) > layer]
        for r in ready:  # a staged pool: the layer's copies into the slots come first
            self.copies.order_before_compute(r)

    def save_layer(self, layer: int, step: SchedulerOutput) -> None:
        if layer == 0:
            self._step_whole = self.layerwise is not None and not self.layerwise()
            self._step_plan = self._plan_step(step)
            self.replicator.stage(step, self._stored_ids)
        last = layer == self.layout.num_layers - 1
        for job, idxs, slots, whole in self._step_plan:
            if job.request_id in self._poisoned:
                job.next_block = min(job.next_block, job.step_start)  # rewrite them on retry
                continue
            if whole and not last:
                continue
            if whole:
                item = LayerItem(None, idxs, self._whole_blocks(job, slots))
            elif job.holds_copies and not job.send_staged.is_set():
                # copied out: a write of the pool's bytes would queue behind the copies
                # held for the first token, and the step would wait for it
                rows = self.copies.staging(len(slots), self.layout.layer_bytes)
                item = LayerItem(layer, idxs, self.copies.from_pool(slots, layer, out=rows))
            elif not job.reserved.done():  # read across threads: set once
                # copied out too (the write waits for the put's reservation, the step
                # must not), but sent as soon as the reservation is back
                rows = self.copies.staging(len(slots), self.layout.layer_bytes)
                copy = self.copies.from_pool(slots, layer, out=rows)
                item = LayerItem(layer, idxs, copy, staged_for_reservation=True)
            else:
                item = LayerItem(layer, idxs, self.copies.from_pool(slots, layer))
            if item.held and not job.send_staged.is_set():
                job.holds_copies |= whole
                job.held_bytes += sum(b.numel() for b in item.copy.buffers)
                if job.held_bytes > MAX_HELD_BYTES:  # too much host memory: send them now
                    self.tasks.soon(job.send_staged.set)
            self.tasks.dispatch(job, item)

    def _whole_blocks(self, job: PutJob, slots: list[Slot]) -> SlotBytes:
        """A put's whole blocks: copied into staging buffers when enough are free (a
        memcpy here, and the step ends without waiting for the store), else the slots'
        own bytes (a CUDA pool's go by DMA), which end_step waits for; but while the
        put holds staged copies for the first token, or its reservation is still on its
        way, into fresh host rows: the send of the slots' own bytes would wait behind
        them, and the step that computes that token with it."""
        staging = self.tasks.staging
        taken = staging.take_many(len(slots)) if staging is not None else None
        if staging is None or taken is None:
            # read across threads: flags, each set once (the reservation's too)
            if job.send_staged.is_set() and job.reserved.done():
                return self.copies.blocks(slots)
            rows = self.copies.staging(len(slots), self.layout.block_bytes)
            return SlotBytes(list(rows), self._copy_out(job, [(slots, rows)]))
        rows = staging.buffers
        ready = self._copy_out(  # a copy per run of consecutive buffers (split pool: a gather)
            job, [(slots[at : at + n], rows[taken[at] : taken[at] + n]) for at, n in _runs(taken)]
        )

        def give_back() -> None:
            for i in taken:
                staging.give(i)

        return SlotBytes([rows[i] for i in taken], ready, done=give_back)

    def _copy_out(self, job: PutJob, parts: list[tuple[list[Slot], torch.Tensor]]) -> Ready:
        """Whole blocks copied into host rows (``parts``: slots, rows): now, or where the
        send waits for the first token anyway (held) and the pool is the host's own,
        after the step's outputs are handed over (:meth:`flush`): on 2 cores, copying
        a 512-token prompt's 12 MB at its last layer took 2-4 ms of its first token.
        Not for a pool split by layer groups: a block's window part may go once the
        step ends."""
        if self.copies.staged or self.pool_windowed or job.send_staged.is_set():
            return self._copy_parts(parts)
        later = Later(lambda: self._copy_parts(parts), self.tasks.soon)
        self._later.append(later)
        return later

    def _copy_parts(self, parts: list[tuple[list[Slot], torch.Tensor]]) -> Ready:
        ready = Ready()
        for slots, rows in parts:
            ready = self.copies.from_pool(slots, out=rows).ready
        return ready

    def flush(self) -> None:
        if not self._later:
            return
        later, self._later = self._later, []
        with torch.inference_mode():  # rows made in the forward are inference tensors
            for copy in later:
                copy.run()

    def _plan_step(self, step: SchedulerOutput) -> list[tuple[PutJob, list[int], list[Slot], bool]]:
        """Per request with a put: the blocks that become final in this step (every
        block whose last token is computed now; on the prompt's last chunk, the partial
        tail too) and the store lacks. A step that sends whole blocks at its end defers
        an earlier chunk's blocks to the prompt's last chunk: written while the next
        chunk computes, they would take the CPU it computes on. A pool split by layer
        groups copies them out whole at the chunk's end instead (deferred, the chunk's
        window parts would have to stay until the last chunk); held for the first token
        like the last chunk's, their send takes no CPU from the next chunks either."""
        bs = self.layout.block_size
        out = []
        for s in step.scheduled:
            plan = _plan(s.request)
            job = plan.put_job if plan is not None else None
            if job is None:
                continue
            end = s.request.num_computed_tokens + s.num_new_tokens
            last_chunk = end >= s.request.num_prompt_tokens
            if self._step_whole and not last_chunk and not self.pool_windowed:
                continue
            whole = job.whole_blocks or self._step_whole
            final = cdiv(end, bs) if last_chunk else end // bs
            final = min(final, len(job.ids))
            job.step_start = job.next_block
            idxs = [i for i in range(job.next_block, final) if i in job.needed]
            job.next_block = max(job.next_block, final)
            if idxs:
                out.append((job, idxs, [s.request.slots[i] for i in idxs], whole))
        return out

    def _stored_ids(self, req: Request) -> list[str] | None:
        """For a request that replicates: the ids of its leading full blocks the store
        holds (what it loaded; nothing if its load failed and it recomputed)."""
        plan = _plan(req)
        if plan is None or not plan.replicate:
            return None
        if not req.load_external:
            return []
        return plan.load_ids[: plan.load_tokens // self.layout.block_size]

    def end_step(self) -> frozenset[RequestId]:
        loads = self._step_loads
        self.tasks.wait_writes()
        cond = self.tasks.cond
        with cond:
            while any(not x.done for x in loads):
                cond.wait(timeout=1.0)
        failed = frozenset(x.request_id for x in loads if x.failed)
        for load in loads:
            self._loads.pop(load.request_id, None)
            for ready in load.layer_ready:  # a failed load's late copies precede recompute
                self.copies.order_before_compute(ready)
        self.copies.order_after_saves()
        self._step_loads = []
        self._poisoned = set()
        self._step_plan = []
        if failed:
            log.warning("%d in-step KV loads failed; recomputing those requests", len(failed))
        return failed

    @property
    def pool_windowed(self) -> bool:
        return self.pool is not None and self.pool.windowed

    def window_hold(self, request: Request) -> int | None:
        """The first block the put still has to send (one the store lacks, a cached
        prefix's included), and the first block replication has not staged: both read
        the pool later, sliding layers included."""
        plan = _plan(request)
        if plan is None:
            return None
        holds = []
        job = plan.put_job
        if job is not None:  # the first block it still has to send (the store lacks it)
            holds.append(min((i for i in job.needed if i >= job.next_block), default=len(job.ids)))
        staged = self.replicator.staged_blocks(request.request_id)
        if staged is None and plan.replicate and self.tasks.staging is not None:
            # not started yet: it will start after what the store holds
            known = self._stored_ids(request)  # (none after a failed load)
            staged = None if known is None else len(known)
        if staged is not None:
            holds.append(staged)
        return min(holds, default=None)

    def request_finished(self, request: Request) -> bool:
        plan = _plan(request)
        if plan is None:
            return False
        held = False
        load = self._loads.pop(request.request_id, None)
        if load is not None:
            with self.tasks.cond:
                held = load.abandoned = not load.done
            if held:
                self.tasks.soon(self.tasks.cancel, load)
        if plan.lease is not None:  # leased but never loaded
            self.tasks.soon(self.tasks.release_soon, plan.lease)
            plan.lease = None
        if plan.put_job is not None:
            self.tasks.soon(self.tasks.end_put_soon, plan.put_job)
        if plan.replicate:  # reads no slot while a load fills them (nothing computed yet)
            held = self.replicator.finished(request) or held
        return held

    def poll(self) -> ConnectorEvents:
        return self.tasks.events.take()


def _runs(indices: list[int]) -> list[tuple[int, int]]:
    """(position, length) of each run of consecutive values in ``indices``."""
    runs: list[tuple[int, int]] = []
    for at, index in enumerate(indices):
        if runs and indices[at - 1] + 1 == index:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((at, 1))
    return runs


async def _drop_lease(leasing: asyncio.Task[tuple[LeaseSet | None, list[str]]]) -> None:
    """Whatever lease ``leasing`` takes, released (its request will not load it)."""
    leasing.cancel()
    try:
        lease, _ = await leasing
    except asyncio.CancelledError:
        return  # cancelled before it held one, or a held one expires with its TTL
    except (BatonError, OSError) as exc:
        log.info("looking up a cached prefix failed after its put did: %s", exc)
        return
    await release(lease)
