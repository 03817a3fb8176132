"""Routing logic (pure): JSQ on prompt tokens, least-loaded decode, benching, 503."""

from __future__ import annotations

import pytest

from services.gateway.router import Router
from shared.cluster.keys import Keys
from shared.cluster.membership import Member
from shared.serving.errors import ServiceError


def member(role: str, name: str, **load: float) -> Member:
    return Member(
        instance_id=name, role=role, host="127.0.0.1", http_port=1, model="m",
        kv_namespace="ns", load=load,
    )  # fmt: skip


def router(**members: list[Member]) -> Router:
    r = Router(redis=None, keys=Keys("t"), model="m", refresh_s=1.0)  # type: ignore[arg-type]
    r.members = {"prefill": [], "decode": [], **members}
    r.kv_namespace = "ns"
    return r


def test_prefill_joins_the_shortest_queue_in_tokens_counting_own_sends() -> None:
    r = router(prefill=[member("prefill", "a", pending_tokens=100), member("prefill", "b")])
    first = r.pick("prefill", 300)
    assert first.member.instance_id == "b"
    second = r.pick("prefill", 10)  # b now has 300 of ours in flight
    assert second.member.instance_id == "a"
    first.done()
    first.done()  # idempotent
    assert r.pick("prefill", 10).member.instance_id == "b"


def test_decode_is_least_loaded_and_benched_instances_are_skipped() -> None:
    r = router(decode=[member("decode", "x", running=3), member("decode", "y", running=1)])
    assert r.pick("decode", 1).member.instance_id == "y"
    r.bench(r.members["decode"][1])
    assert r.pick("decode", 1).member.instance_id == "x"


def test_only_matching_kv_layouts_and_no_instance_is_503() -> None:
    other = member("decode", "z").model_copy(update={"kv_namespace": "other"})
    r = router(decode=[other])
    with pytest.raises(ServiceError) as err:
        r.pick("decode", 1)
    assert err.value.status == 503 and "decode" in str(err.value)
