"""Decode's KV replication: every block a request completes goes to the store, and the
request's watermark in Redis follows what is committed (DéjàVu).

Engine thread: one step after a block fills (the engine has keyed it by then,
and a full block of a running request never changes) it is copied into a
preallocated staging buffer and handed to the event loop, which writes it in
the background; replication never holds a slot and lags rather than blocks
when staging runs out. When a request ends, the blocks not yet replicated are
written from its slots (held until written): an aborted request (a client gone,
a drain migrating it) keeps its watermark for the instance that resumes it; a
finished one drops it, and keeps its blocks in the store only for reuse
(prompt+answer caching) when caching is on.

Block ids: content keys when caching (shared with every instance), else ids
unique to the request.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable

from shared.engine.kv_cache_manager import Slot
from shared.engine.request import FinishReason, Request, RequestId
from shared.engine.scheduler_output import SchedulerOutput
from shared.kvstore.transfer_tasks import TransferTasks
from shared.kvstore.transfers import Replication


class Replicator:
    def __init__(self, tasks: TransferTasks, *, caching: bool):
        self.tasks = tasks
        self.caching = caching
        self.replications: dict[RequestId, Replication] = {}  # written on the engine thread

    def start(self, req: Request, stored_ids: list[str]) -> Replication:
        """Track ``req``, whose leading full blocks ``stored_ids`` are in the store."""
        rep = Replication(req.request_id, list(stored_ids), len(stored_ids), len(stored_ids))
        self.replications[req.request_id] = rep
        return rep

    def _block_id(self, req: Request, index: int) -> str:
        return req.block_keys[index].hex() if self.caching else uuid.uuid4().hex

    def stage(self, step: SchedulerOutput, stored: Callable[[Request], list[str] | None]) -> None:
        """Stage the blocks completed before this step by the replicating requests in it
        (``stored(req)``: the ids of its leading blocks already in the store, or None for
        a request that does not replicate)."""
        for s in step.scheduled:
            self._stage_request(s.request, stored)

    def spill(self, req: Request, stored: Callable[[Request], list[str] | None]) -> bool:
        """``req`` is preempted and gives up its slots: stage its completed blocks not
        staged yet while the slots still hold them (as many as free staging buffers
        take; the rest is recomputed). True when the store will hold KV of it past the
        prompt, up to the watermark (``committed_ids``) for when it resumes."""
        rep = self._stage_request(req, stored)
        bs = self.tasks.layout_block_size()
        return rep is not None and rep.staged * bs > req.num_prompt_tokens

    def staged_blocks(self, request_id: RequestId) -> int | None:
        """How many leading blocks of the request are staged (or were in the store); the
        rest is read from its slots later. None: it does not replicate."""
        rep = self.replications.get(request_id)
        return None if rep is None else rep.staged

    def committed_ids(self, request_id: RequestId) -> list[str]:
        """Ids of the request's leading blocks committed to the store, in order."""
        rep = self.replications.get(request_id)
        if rep is None:
            return []
        with self.tasks.cond:  # the event loop publishes it
            committed = rep.committed_blocks
        return rep.ids[:committed]

    def _stage_request(
        self, req: Request, stored: Callable[[Request], list[str] | None]
    ) -> Replication | None:
        """Copy the request's full blocks not staged yet into staging buffers and hand
        them to the event loop; None for a request that does not replicate."""
        staging, pool, copies = self.tasks.staging, self.tasks.pool, self.tasks.copies
        if staging is None or pool is None or copies is None:
            return None
        rep = self.replications.get(req.request_id)
        if rep is None:
            known = stored(req)
            if known is None:
                return None
            rep = self.start(req, known)
        bs = pool.layout.block_size
        full = min(req.num_computed_tokens // bs, len(req.block_keys), len(req.slots))
        indices: list[int] = []
        buffers: list[int] = []
        ready = None
        while rep.staged < full:
            index = staging.take()
            if index is None:  # the store lags: these go from the slots at the end
                break
            out = staging.buffers[index : index + 1]
            # copies run in order: the last one's completion covers the earlier ones
            ready = copies.from_pool([req.slots[rep.staged]], out=out).ready
            rep.ids.append(self._block_id(req, rep.staged))
            indices.append(rep.staged)
            buffers.append(index)
            rep.staged += 1
        if indices:
            self.tasks.soon(self.tasks.replicate_soon, rep, indices, buffers, None, ready)
        return rep

    def finished(self, req: Request) -> bool:
        """The request ended: write what it computed and did not replicate yet (when it
        may resume elsewhere, or for caching). True while that reads its slots."""
        rep = self.replications.pop(req.request_id, None)
        if rep is None:
            return False
        # an aborted request may resume elsewhere: its watermark (if replication is on) stays
        keep = req.finish_reason is FinishReason.ABORT and self.tasks.watermarks is not None
        bs = self.tasks.layout_block_size()
        full = min(req.num_computed_tokens // bs, len(req.block_keys), len(req.slots))
        indices = list(range(rep.staged, full)) if (keep or self.caching) else []
        slots: list[Slot] = [req.slots[i] for i in indices]
        for i in indices:
            rep.ids.append(self._block_id(req, i))
        rep.staged += len(indices)
        self.tasks.soon(self.tasks.finish_replication, rep, keep, indices, slots)
        return bool(indices)
