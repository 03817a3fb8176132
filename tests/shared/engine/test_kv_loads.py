"""KVLoads: the connector's offers clamped to what a step may load, and the bookkeeping
of asynchronous loads (with the fake connector of these tests)."""

from __future__ import annotations

from shared.engine.kv_cache_manager import Slot
from shared.engine.kv_connector import NO_HIT
from shared.engine.kv_loads import KVLoads
from tests.shared.engine.fake_connector import FakeConnector
from tests.shared.engine.stepping import req


def test_no_connector_or_no_external_loads_offers_nothing() -> None:
    r = req(16)
    assert KVLoads(None, 4).offer(r, 0) == NO_HIT
    connector = FakeConnector()
    connector.offer(r, 16)
    r.load_external = False
    assert KVLoads(connector, 4).offer(r, 0) == NO_HIT


def test_an_in_step_load_stops_at_the_last_full_block_before_the_final_token() -> None:
    connector = FakeConnector()
    loads = KVLoads(connector, 4)
    r = req(16)
    connector.offer(r, 16)  # everything: but the step must compute the last token
    hit = loads.offer(r, 4)
    assert (hit.num_tokens, hit.asynchronous) == (8, False)  # blocks 1-2 of 0-3
    r2 = req(10)
    connector.offer(r2, 10, asynchronous=True)
    hit = loads.offer(r2, 0)
    assert (hit.num_tokens, hit.asynchronous) == (9, True)  # all but the final token


def test_an_async_load_sets_the_computed_tokens_only_when_it_landed() -> None:
    connector = FakeConnector()
    loads = KVLoads(connector, 4)
    a, b, c = req(12), req(12), req(12)
    for r in (a, b, c):
        loads.start_async(r, 0, [Slot(0), Slot(1)], target=8)
    assert set(loads.loading) == {a.request_id, b.request_id, c.request_id}
    assert [load.request for load in connector.started] == [a, b, c]
    assert loads.landed(a.request_id) is a and a.num_computed_tokens == 8
    assert loads.failed(b.request_id) is b and b.num_computed_tokens == 0
    loads.discard(c.request_id)  # finished while loading
    assert loads.landed(c.request_id) is None and loads.failed(c.request_id) is None
    assert not loads.loading
