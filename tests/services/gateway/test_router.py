"""Routing logic (pure): cost in prompt tokens (queued work + what is not cached) within
a balance bound, least-loaded decode, benching, 503; reading index rows into hits."""

from __future__ import annotations

import time

import pytest

from services.gateway.prefix_locator import PrefixHits, hits_from_holders
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


def test_prefill_goes_where_the_prompt_is_cached_unless_that_queue_is_far_longer() -> None:
    r = router(prefill=[member("prefill", "a", pending_tokens=300), member("prefill", "b")])
    hot = PrefixHits(local={"a": 960})
    pick = r.pick("prefill", 1000, hits=hot)
    # a: 300 queued + 40 to compute; b: 0 queued + 1000 to compute
    assert pick.member.instance_id == "a" and pick.predicted_cached == 960
    assert pick.cost == 40  # only the uncached work counts as queued there
    pick.done()
    r.members["prefill"][0] = member("prefill", "a", pending_tokens=5000)
    far = r.pick("prefill", 1000, hits=hot)  # beyond the balance bound (4096 tokens)
    assert far.member.instance_id == "b" and far.predicted_cached == 0


def test_store_hits_make_every_prefill_instance_cheap() -> None:
    r = router(prefill=[member("prefill", "a", pending_tokens=50), member("prefill", "b")])
    hits = PrefixHits(local={"a": 960}, store=960)
    pick = r.pick("prefill", 1000, hits=hits)
    # both reuse 960 tokens; b pulls them (a small charge) but its queue is empty
    assert pick.member.instance_id == "b" and pick.predicted_cached == 960


def test_prediction_never_covers_the_last_prompt_token() -> None:
    r = router(prefill=[member("prefill", "a")])
    r.block_size = 16
    assert r.pick("prefill", 64, hits=PrefixHits(store=64)).predicted_cached == 48


def test_decode_ties_go_to_the_instance_holding_the_conversation() -> None:
    r = router(decode=[member("decode", "x", running=1), member("decode", "y", running=1)])
    assert r.pick("decode", 1, hits=PrefixHits(local={"y": 320})).member.instance_id == "y"


def test_hits_from_holders_count_live_prefixes_per_worker_and_across_stores() -> None:
    live = {"s1": "kvstore", "s2": "kvstore", "p1": "prefill", "d1": "decode"}
    rows = [
        {"s1", "p1", "d1"},
        {"s2", "p1", "gone"},  # the store's blocks sit on different nodes
        {"s1", "d1"},
        {"gone"},  # held only by a dead instance: not a hit
    ]
    hits = hits_from_holders(rows, live, block_size=16)
    assert hits.store == 48
    assert hits.local == {"p1": 32, "d1": 16}
    assert hits.cached("p1") == 48 and hits.cached("x") == 48


def test_a_worker_keeping_only_its_window_counts_a_prefix_as_far_as_its_window_is_held() -> None:
    """Window 32 tokens, 16-token blocks: a prefix of n blocks is reusable where blocks
    n-2 .. n-1 (its next row's window, one row back) have their window entries. p1 lost
    the window layers of blocks 0-3 (evicted before the blocks themselves): its 8 held
    blocks are reusable (their last window is there), a 5-block prefix of them is
    not; w2 keeps every layer and counts as before."""
    live = {"p1": "prefill", "w2": "prefill", "s1": "kvstore"}
    rows = [{"p1", "w2", "s1"} for _ in range(8)]
    window_rows: list[set[str]] = [set() for _ in range(4)] + [{"p1"} for _ in range(4)]
    hits = hits_from_holders(rows, live, 16, {"p1": 32}, window_rows)
    assert hits.local == {"p1": 128, "w2": 128} and hits.store == 128
    window_rows[6] = set()  # block 6 loses its window layers too
    hits = hits_from_holders(rows, live, 16, {"p1": 32}, window_rows)
    assert hits.local["p1"] == 96  # 8 blocks need 6..7: 6 lacks -> 6 blocks need 4..5
    cut = hits_from_holders(rows[:5], live, 16, {"p1": 32}, window_rows[:5])
    assert cut.local == {"w2": 80}  # 5 need 3..4: 3 lacks -> 3 need 1..2 -> ... none
    wider = hits_from_holders(rows, live, 16, {"p1": 40}, window_rows)
    assert wider.local == {"w2": 128}  # 40 tokens: 8 need 5..7, 6 need 3..5, ... none


def test_equal_costs_take_turns() -> None:
    """Idle instances and no cache: requests alternate instead of all going to one."""
    r = router(prefill=[member("prefill", "a"), member("prefill", "b")])
    chosen = []
    for _ in range(4):
        pick = r.pick("prefill", 100)
        chosen.append(pick.member.instance_id)
        pick.done()
    assert chosen == ["a", "b", "a", "b"]


def test_a_prompt_in_flight_counts_as_held_by_its_prefill(monkeypatch: pytest.MonkeyPatch) -> None:
    r = router(prefill=[member("prefill", "a"), member("prefill", "b", pending_tokens=1000)])
    r.block_size = 16
    keys = tuple(f"k{i}" for i in range(10))
    first = r.pick("prefill", 170, hits=PrefixHits(keys=keys))
    twin = r.pick("prefill", 180, hits=PrefixHits(keys=(*keys[:8], "x", "y")))
    # the twin waits on a for the 8 blocks being computed there: 170 queued + 52 to compute
    assert first.member.instance_id == twin.member.instance_id == "a"
    assert twin.predicted_cached == 128
    first.done()
    twin.done()
    clock = time.monotonic() + 10
    monkeypatch.setattr(time, "monotonic", lambda: clock)
    late = r.pick("prefill", 170, hits=PrefixHits(keys=keys))
    assert late.predicted_cached == 0  # forgotten: the index speaks for it now


def test_a_bench_ends_when_the_instance_restarts_under_the_same_id() -> None:
    """A draining instance refuses connections and is benched; the process that replaces
    it (same id, new start time) takes traffic as soon as it is registered, not after
    the bench: in a rolling restart the other instance drains next."""
    old = member("prefill", "a")
    r = router(prefill=[old])
    r.bench(old)
    assert r.live("prefill") == []
    restarted = old.model_copy(update={"started_at": old.started_at + 60.0})
    r.members["prefill"] = [restarted]
    assert r.live("prefill") == [restarted]
    r.members["prefill"] = [old]  # a stale view of the old process: still benched
    assert r.live("prefill") == []
