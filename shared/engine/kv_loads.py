"""The scheduler's side of the KV connector: how much KV it may load for a request,
and the asynchronous loads in flight until the connector reports them.

Bookkeeping only: the requests stay the scheduler's and their slots the
:class:`KVCacheManager`'s. A request in ``loading`` holds slots the connector is
filling; nothing computes on them until its load is reported ended.
"""

from __future__ import annotations

from collections.abc import Sequence

from shared.engine.kv_cache_manager import Slot
from shared.engine.kv_connector import NO_HIT, ExternalHit, KVConnector
from shared.engine.request import Request, RequestId


class KVLoads:
    def __init__(self, connector: KVConnector | None, block_size: int):
        self.connector = connector
        self.block_size = block_size
        self.loading: dict[RequestId, Request] = {}
        self._target: dict[RequestId, int] = {}  # computed tokens once the load lands

    def offer(self, req: Request, local: int) -> ExternalHit:
        """The connector's offer past ``local`` cached tokens, clamped: an in-step load
        stops at the last full block before the final token (whose logits the step
        needs), an asynchronous one where the request must compute."""
        if self.connector is None or not req.load_external:
            return NO_HIT
        hit = self.connector.external_hit(req, local)
        if hit.asynchronous:
            room = req.num_tokens - local - (0 if req.awaiting_first_token else 1)
        else:
            room = (req.num_tokens - 1) // self.block_size * self.block_size - local
        n = max(0, min(hit.num_tokens, room))
        return ExternalHit(n, hit.asynchronous) if n else NO_HIT

    def start(self, req: Request, first_block: int, slots: Sequence[Slot]) -> None:
        """An in-step load into ``slots`` (``req``'s blocks from ``first_block`` on)."""
        if self.connector is None:
            raise RuntimeError("a load was planned without a connector")
        self.connector.start_load(req, first_block, slots)

    def start_async(
        self, req: Request, first_block: int, slots: Sequence[Slot], target: int
    ) -> None:
        """A load ``req`` waits for, parked, until it has ``target`` computed tokens."""
        self.loading[req.request_id] = req
        self._target[req.request_id] = target
        self.start(req, first_block, slots)

    def landed(self, request_id: RequestId) -> Request | None:
        """The request whose load ended well, its computed tokens now the load's end;
        None when it is not loading (it finished meanwhile)."""
        req = self.loading.pop(request_id, None)
        if req is not None:
            req.num_computed_tokens = self._target.pop(request_id)
        return req

    def failed(self, request_id: RequestId) -> Request | None:
        """The request whose load failed (its slots hold garbage); None as above."""
        self._target.pop(request_id, None)
        return self.loading.pop(request_id, None)

    def discard(self, request_id: RequestId) -> None:
        self.loading.pop(request_id, None)
        self._target.pop(request_id, None)
