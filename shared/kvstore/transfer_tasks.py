"""The event-loop half of the KV-store connector: the tasks that move KV bytes.

Loads stream blocks from the store into pool slots; put writers send a
prompt's layers into its two-phase put and commit it; replication writes whole
blocks (from staging copies, or from an ended request's slots) and advances
the request's watermark. Each tells the
engine thread how far it got under :attr:`TransferTasks.cond` (loads: layers
landed; writers: items still reading the pool) and reports finished transfers
through :attr:`TransferTasks.events`, waking the engine thread. Everything here
runs on the event loop except the methods marked thread-safe.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable, Coroutine
from typing import Any

from shared.cluster.watermarks import Watermark, Watermarks
from shared.engine.kv_cache_manager import Slot
from shared.engine.request import RequestId
from shared.errors import KVStoreError, TransportError
from shared.kv.kv_cache import KVCache
from shared.kvstore.client import KVStoreClient, LeaseSet
from shared.kvstore.connector_metrics import ConnectorMetrics
from shared.kvstore.pool_copies import PoolCopies, Ready
from shared.kvstore.pull_cost import PullCost
from shared.kvstore.transfers import Events, LayerItem, Load, PutJob, Replication, StagingPool

log = logging.getLogger(__name__)
TRANSFER_ERRORS = (KVStoreError, TransportError, asyncio.CancelledError)
ENDED_KEEP_S = 60.0


def retrieve(fut: asyncio.Future[Any]) -> None:
    """Mark a future's failure as seen (nobody may await a put's outcome)."""
    if not fut.cancelled():
        fut.exception()


class TransferTasks:
    def __init__(self, kv: KVStoreClient, metrics: ConnectorMetrics, *, put_ttl_s: float):
        self.kv = kv
        self.metrics = metrics
        self.put_ttl_s = put_ttl_s
        self.cond = threading.Condition()
        self.events = Events()
        self.writes_pending = 0  # layer items dispatched and not yet sent (under cond)
        self.pool: KVCache | None = None
        self.copies: PoolCopies | None = None  # how transfers reach the pool's bytes
        self.pull: PullCost | None = None
        self.staging: StagingPool | None = None
        self.watermarks: Watermarks | None = None  # decode: where replication is recorded
        self.instance_id = ""
        # replications of requests that ended, until they settle (a drain reads them)
        self.ended: dict[RequestId, Replication] = {}
        self._aio: asyncio.AbstractEventLoop | None = None
        self._wake: Callable[[], None] = lambda: None
        self._tasks: set[asyncio.Task[None]] = set()

    def start(self, loop: asyncio.AbstractEventLoop, wake: Callable[[], None]) -> None:
        self._aio = loop
        self._wake = wake

    def layout_block_size(self) -> int:
        return self._pool().layout.block_size

    def _pool(self) -> KVCache:
        if self.pool is None:
            raise RuntimeError("the connector is not bound to an engine's KV pool")
        return self.pool

    def _copies(self) -> PoolCopies:
        if self.copies is None:
            raise RuntimeError("the connector is not bound to an engine's KV pool")
        return self.copies

    # -- scheduling work from the engine thread (thread-safe) ------------------------------
    def soon(self, fn: Callable[..., object], *args: object) -> None:
        if self._aio is None:
            raise RuntimeError("the connector's transfers were not started")
        self._aio.call_soon_threadsafe(fn, *args)

    def dispatch(self, job: PutJob, item: LayerItem) -> None:
        """Hand a layer item to the job's writer; an item of the pool's own bytes reads
        the pool until sent (a staged copy does not)."""
        if item.copy.reads_pool:
            with self.cond:
                self.writes_pending += 1
        self.soon(job.queue.put_nowait, item)

    def wait_writes(self) -> None:
        with self.cond:
            while self.writes_pending:
                self.cond.wait(timeout=1.0)

    def spawn(self, coro: Coroutine[Any, Any, None], name: str) -> asyncio.Task[None]:
        task = asyncio.get_running_loop().create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    # -- loads ---------------------------------------------------------------------------------
    def launch(self, load: Load) -> None:
        load.task = self.spawn(self._load(load), f"kv-load:{load.request_id}")

    def cancel(self, load: Load) -> None:
        if load.task is not None:
            load.task.cancel()

    async def _load(self, load: Load) -> None:
        pool, copies = self._pool(), self._copies()
        layout = pool.layout
        started = time.perf_counter()
        error: BaseException | None = None
        nbytes = len(load.slots) * layout.block_bytes
        try:
            if load.asynchronous and copies.staged:
                # a CUDA pool waits for the whole load anyway: the committed blocks go
                # straight into the slots (by DMA from a same-host store's pinned arena)
                into = copies.blocks(load.slots)
                await self.kv.get(load.ids, into.buffers, wait_s=load.wait_s)
                with self.cond:
                    load.layers = layout.num_layers
            else:
                nbytes = await self._stream_layers(load, copies)
        except TRANSFER_ERRORS as exc:
            error = exc
        except Exception as exc:  # a bug must not leave the engine waiting forever
            log.exception("KV load of %s failed", load.request_id)
            error = exc
        finally:
            await release(load.lease)
        self._observe_load(load, nbytes, started, error)
        with self.cond:
            load.error, load.done = error, True
            abandoned = load.abandoned
            self.cond.notify_all()
        if abandoned:
            self.events.released(load.request_id)
        elif load.asynchronous and error is None:
            self.events.loaded(load.request_id)
        elif load.asynchronous:
            self.events.failed(load.request_id)
        self._wake()

    async def _stream_layers(self, load: Load, copies: PoolCopies) -> int:
        """Layers as the store streams them (the decode side pulls while prefill still
        writes): in-step loads land layer by layer, the engine ordering its compute
        after each; an asynchronous one lands whole once every layer arrived. Returns
        the bytes it moves."""
        landing = copies.landing(load.slots)
        async for layer in self.kv.stream(
            load.ids,
            landing.rows,
            num_layers=self._pool().layout.num_layers,
            wait_s=load.wait_s,
            layer_into=landing.layer_into,
            only=landing.only,
        ):
            ready = Ready() if load.asynchronous else copies.layer_to_pool(landing, layer)
            with self.cond:
                load.layer_ready.append(ready)
                load.layers = layer + 1
                self.cond.notify_all()
        if load.asynchronous:
            await copies.blocks_to_pool(landing).wait()
        return landing.nbytes(self._pool().layout)

    def _observe_load(
        self, load: Load, nbytes: int, started: float, error: BaseException | None
    ) -> None:
        if error is None:
            seconds = time.perf_counter() - started
            self.metrics.observe_load(nbytes, seconds)
            if self.pull is not None:
                self.pull.observe_load(nbytes, seconds)
                self.metrics.crossover.set(min(self.pull.crossover_tokens(), 1e9))
        elif not isinstance(error, asyncio.CancelledError):
            self.metrics.stale.inc()
            log.warning("KV load of %s failed: %s", load.request_id, error)

    # -- puts ------------------------------------------------------------------------------------
    async def writer(self, job: PutJob) -> None:
        """Write each layer item of the job as it comes; commit once complete. An item
        counts as done (the engine may reuse its slots) once its bytes left; the commit
        round trip happens after that, off the engine's path."""
        layout = self._pool().layout
        while (item := await job.queue.get()) is not None:
            layer, idxs, copy = item.layer, item.indices, item.copy
            try:
                if not job.failed:
                    # every block staged before the reservation came back goes to the
                    # handle, which sends each replica only the ones it reserved
                    ids = [job.ids[i] for i in idxs]
                    put = await job.reserved
                    if item.held:
                        await job.send_staged.wait()
                    await copy.ready.wait()
                    if layer is None:
                        await put.write(ids, copy.buffers)
                    else:
                        await put.write(ids, copy.buffers, layers=(layer, layer + 1))
                    self.metrics.saved_bytes.inc(sum(b.numel() for b in copy.buffers))
                    if layer is None or layer == layout.num_layers - 1:
                        job.written.update(idxs)
            except (KVStoreError, TransportError) as exc:
                log.warning("KV put of %s failed: %s", job.request_id, exc)
                self._fail(job, exc)
            except Exception as exc:  # a bug must not leave the engine waiting forever
                log.exception("KV put of %s failed", job.request_id)
                self._fail(job, exc)
            finally:
                copy.done()
                if copy.reads_pool:
                    with self.cond:
                        self.writes_pending -= 1
                        self.cond.notify_all()
            if job.complete and not job.failed and not job.committed.done():
                await self.commit(job)

    async def commit(self, job: PutJob) -> None:
        """(Once the job is complete, so its reservation came back.)"""
        try:
            await (await job.reserved).commit()
        except (KVStoreError, TransportError) as exc:
            log.warning("committing the KV put of %s failed: %s", job.request_id, exc)
            self._fail(job, exc)
            return
        if not job.committed.done():
            job.committed.set_result(None)

    def _fail(self, job: PutJob, error: BaseException) -> None:
        job.failed = True
        if not job.committed.done():
            job.committed.set_exception(error)

    def end_put_soon(self, job: PutJob) -> None:
        self.spawn(self.end_put(job), f"kv-put-end:{job.request_id}")

    async def end_put(self, job: PutJob) -> None:
        """Stop the writer once it drained; revoke the put unless it committed."""
        job.queue.put_nowait(None)
        if job.writer is not None:
            await asyncio.gather(job.writer, return_exceptions=True)
        if job.committed.done() and job.committed.exception() is None:
            return
        self._fail(job, KVStoreError("the request ended before its KV was stored"))
        try:
            put = await asyncio.shield(job.reserved)
        except (KVStoreError, TransportError):
            return  # nothing was reserved
        try:
            await put.revoke()
        except (KVStoreError, TransportError) as exc:  # the reservation's TTL frees it
            log.warning("revoking the KV put of %s failed: %s", job.request_id, exc)

    # -- saves ----------------------------------------------------------------------------------
    def release_soon(self, lease: LeaseSet) -> None:
        self.spawn(release(lease), "kv-lease-release")

    def replicate_soon(
        self,
        rep: Replication,
        indices: list[int],
        staged: list[int] | None,
        slots: list[Slot] | None,
        ready: Ready | None = None,
    ) -> None:
        """Write blocks ``indices`` of a replication, from staging buffers (their bytes in
        place once ``ready``) or (a request that ended) from its slots, which are
        released when written."""
        rep.pending += 1
        rep.settled.clear()
        self.spawn(
            self._replicate(rep, indices, staged, slots, ready or Ready()),
            f"kv-replicate:{rep.request_id}",
        )

    def finish_replication(
        self, rep: Replication, keep: bool, indices: list[int], slots: list[Slot]
    ) -> None:
        rep.keep = keep
        self.ended[rep.request_id] = rep
        if indices:
            self.replicate_soon(rep, indices, None, slots)
        elif rep.pending == 0:  # else the last staged write in flight settles it
            self._settle(rep)

    async def _replicate(
        self,
        rep: Replication,
        indices: list[int],
        staged: list[int] | None,
        slots: list[Slot] | None,
        ready: Ready,
    ) -> None:
        layout = self._pool().layout
        ids = [rep.ids[i] for i in indices]
        written = False
        try:
            if staged is not None and self.staging is not None:
                await ready.wait()
                buffers = [self.staging.buffers[i] for i in staged]
                await self.kv.put(ids, buffers, num_layers=layout.num_layers)
            else:
                put = await self.kv.begin_put(
                    ids,
                    [layout.block_bytes] * len(ids),
                    num_layers=layout.num_layers,
                    ttl_s=self.put_ttl_s,
                )
                try:
                    blocks = self._copies().blocks(slots or [])
                    await blocks.ready.wait()
                    await put.write(ids, blocks.buffers)
                    await put.commit()
                except BaseException:
                    await put.revoke()
                    raise
            written = True
        except (KVStoreError, TransportError) as exc:
            log.warning("replicating %d blocks of %s failed: %s", len(ids), rep.request_id, exc)
        finally:  # the staging buffers and slots go back before Redis is written
            if staged is not None and self.staging is not None:
                for index in staged:
                    self.staging.give(index)
            if slots is not None:
                self.events.released(rep.request_id)
                self._wake()
            if not written:
                self._replicated(rep)
        if written:
            self.metrics.saved_bytes.inc(len(ids) * layout.block_bytes)
            self.metrics.replicated_bytes.inc(len(ids) * layout.block_bytes)
            rep.committed.update(indices)
            try:
                await self._advance(rep, layout.block_size)
            finally:
                self._replicated(rep)

    def _replicated(self, rep: Replication) -> None:
        rep.pending -= 1
        if rep.pending == 0:
            self._settle(rep)

    async def _advance(self, rep: Replication, block_size: int) -> None:
        moved = False
        while rep.watermark in rep.committed:
            rep.committed.discard(rep.watermark)
            rep.watermark += 1
            moved = True
        if moved:
            with self.cond:
                rep.committed_blocks = rep.watermark
        lag = (rep.staged - rep.watermark) * block_size
        self.metrics.replication_lag.observe(lag)
        if moved and rep.keep and self.watermarks is not None:
            await self.watermarks.advance(
                rep.request_id,
                self.instance_id,
                rep.watermark * block_size,
                rep.ids[: rep.watermark],
            )

    def _settle(self, rep: Replication) -> None:
        rep.settled.set()
        if rep.request_id not in self.ended:
            return
        if rep.keep:  # a drain reads it soon; a client that left never does
            asyncio.get_running_loop().call_later(
                ENDED_KEEP_S, self.ended.pop, rep.request_id, None
            )
            return
        del self.ended[rep.request_id]
        if self.watermarks is not None:
            self.spawn(self.watermarks.drop(rep.request_id), "kv-watermark-drop")

    async def final_watermark(self, rid: RequestId, wait_s: float = 10.0) -> Watermark | None:
        """Once an ended request's last blocks are written (or after ``wait_s``): how far
        its KV is stored."""
        rep = self.ended.pop(rid, None)
        if rep is None:
            return None
        try:
            await asyncio.wait_for(rep.settled.wait(), wait_s)
        except TimeoutError:
            log.warning("the last KV writes of %s are late; handing over what is stored", rid)
        bs = self.layout_block_size()
        return Watermark(
            instance_id=self.instance_id,
            tokens=rep.watermark * bs,
            block_ids=rep.ids[: rep.watermark],
        )

    async def close(self) -> None:
        """Cancel whatever still runs (service shutdown)."""
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)


async def release(lease: LeaseSet | None) -> None:
    if lease is not None:
        await lease.release()
