"""A fake KV connector for scheduler and engine tests: it moves no bytes unless given a
source pool; the test decides what it offers, when loads end and whether they fail."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from shared.engine.kv_cache_manager import Slot
from shared.engine.kv_connector import NO_HIT, ConnectorEvents, ExternalHit, KVConnector
from shared.engine.request import Request, RequestId
from shared.engine.scheduler_output import SchedulerOutput


@dataclass
class Load:
    request: Request
    first_block: int
    slots: list[Slot]


@dataclass
class FakeConnector(KVConnector):
    offers: dict[RequestId, ExternalHit] = field(default_factory=dict)
    hold_on_finish: set[RequestId] = field(default_factory=set)
    fail_in_step: set[RequestId] = field(default_factory=set)
    loads: dict[RequestId, Load] = field(default_factory=dict)  # started, not yet ended
    started: list[Load] = field(default_factory=list)
    finished: list[RequestId] = field(default_factory=list)
    layers_waited: list[int] = field(default_factory=list)
    layers_saved: list[int] = field(default_factory=list)
    # spills: keep a preempted request's whole computed blocks and offer them back
    keep_spills: bool = False
    block_size: int = 4
    spilled: dict[RequestId, list[Slot]] = field(default_factory=dict)  # slots at the call
    _events: dict[str, set[RequestId]] = field(
        default_factory=lambda: {"loaded": set(), "failed": set(), "released": set()}
    )

    def offer(self, request: Request, num_tokens: int, asynchronous: bool = False) -> None:
        self.offers[request.request_id] = ExternalHit(num_tokens, asynchronous)

    # -- what the test does ------------------------------------------------------
    def end_load(self, request_id: RequestId, ok: bool = True) -> Load:
        load = self.loads.pop(request_id)
        self._events["loaded" if ok else "failed"].add(request_id)
        return load

    def release(self, request_id: RequestId) -> None:
        self._events["released"].add(request_id)

    # -- the connector ---------------------------------------------------------------
    def external_hit(self, request: Request, num_local_tokens: int) -> ExternalHit:
        hit = self.offers.get(request.request_id, NO_HIT)
        return ExternalHit(max(0, hit.num_tokens - num_local_tokens), hit.asynchronous)

    def start_load(self, request: Request, first_block: int, slots: Sequence[Slot]) -> None:
        load = Load(request, first_block, list(slots))
        self.started.append(load)
        self.loads[request.request_id] = load

    def wait_for_layer(self, layer: int) -> None:
        self.layers_waited.append(layer)

    def save_layer(self, layer: int, step: SchedulerOutput) -> None:
        self.layers_saved.append(layer)

    def end_step(self) -> frozenset[RequestId]:
        in_step = {rid for rid, load in self.loads.items() if not self._asynchronous(rid)}
        for rid in in_step:
            del self.loads[rid]
        failed = frozenset(in_step & self.fail_in_step)
        self.fail_in_step -= failed
        return failed

    def _asynchronous(self, rid: RequestId) -> bool:
        return self.offers.get(rid, NO_HIT).asynchronous

    def request_finished(self, request: Request) -> bool:
        self.finished.append(request.request_id)
        if request.request_id in self.loads:  # a load in flight still writes its slots
            self.loads.pop(request.request_id)
            return True
        return request.request_id in self.hold_on_finish

    def spill(self, request: Request) -> bool:
        if not self.keep_spills:
            return False
        self.spilled[request.request_id] = list(request.slots)
        kept = request.num_computed_tokens // self.block_size * self.block_size
        self.offer(request, kept, asynchronous=True)
        return True

    def poll(self) -> ConnectorEvents:
        events = ConnectorEvents(
            loaded=frozenset(self._events["loaded"]),
            failed=frozenset(self._events["failed"]),
            released=frozenset(self._events["released"]),
        )
        for ids in self._events.values():
            ids.clear()
        return events
