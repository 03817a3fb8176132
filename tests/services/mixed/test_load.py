"""A mixed instance's load report splits the engine's figures by role (pure: a fake
worker holding a snapshot and its requests in flight)."""

from __future__ import annotations

from types import SimpleNamespace

from services.mixed.worker import Mixed, is_prefill, prefill_id
from shared.engine.request import RequestId
from shared.engine.snapshot import EngineSnapshot


def test_each_role_counts_only_its_own_requests() -> None:
    a, b, c = prefill_id("a"), "b", "c"  # a prompt computing; two streams, c waiting for KV
    snap = EngineSnapshot(
        waiting=1,
        running=2,
        pending_tokens=300 + 1 + 500,
        pending_by_request={RequestId(a): 300, RequestId(b): 1, RequestId(c): 500},
        waiting_ids=frozenset({RequestId(c)}),
    )
    fake = SimpleNamespace(loop=SimpleNamespace(snapshot=snap), in_flight={a: 0, b: 0, c: 0})
    load = Mixed.load(fake)  # type: ignore[arg-type]
    assert load["pending_tokens"] == 300.0 and load["jobs"] == 1.0  # not the streams' 501
    assert load["running"] == 1.0 and load["waiting_kv"] == 1.0  # not the prompt
    assert (load["serving_prefill"], load["serving_decode"]) == (1.0, 2.0)
    assert is_prefill(a) and not is_prefill(b)
