"""The mixed pool's lending policy (pure): a mixed instance whose own queue is empty
takes the other role's work only while that role is over its bound, and the router
offers it (and gives it back) accordingly."""

from __future__ import annotations

import pytest

from services.gateway.lending import LendPolicy, serving
from services.gateway.router import Router
from shared.cluster.keys import Keys
from shared.cluster.membership import Member
from shared.config import SloConfig
from shared.engine.step_pacer import PACE_MARGIN

POLICY = LendPolicy(prefill_tokens=1000.0, decode_running=4.0)


def member(role: str, name: str, mixed: bool = True, **load: float) -> Member:
    load = {"mixed": 1.0, **load} if mixed else load
    return Member(
        instance_id=name, role=role, host="127.0.0.1", http_port=1, model="m",
        kv_namespace="ns", load=load,
    )  # fmt: skip


def published(m: Member, role: str) -> float:
    return m.load.get("pending_tokens" if role == "prefill" else "running", 0.0)


def router(prefill: list[Member], decode: list[Member]) -> Router:
    r = Router(redis=None, keys=Keys("t"), model="m", refresh_s=1.0, lend=POLICY)  # type: ignore[arg-type]
    r.members = {"prefill": prefill, "decode": decode, "colocated": [], "kvstore": []}
    r.kv_namespace = "ns"
    return r


def test_prefill_over_its_bound_borrows_an_idle_decode_instance() -> None:
    p = member("prefill", "p", pending_tokens=1500)
    idle, busy = member("decode", "d1", running=1), member("decode", "d2", running=4)
    waiting = member("decode", "d3", running=0, waiting_kv=1)
    assert POLICY.lendable("prefill", [p], [idle, busy, waiting], published) == [idle]
    calm = member("prefill", "p", pending_tokens=900)
    assert POLICY.lendable("prefill", [calm], [idle], published) == []


def test_a_decode_instance_whose_steps_are_slow_is_not_lent_until_they_recover() -> None:
    """Its streams' time per output token comes first: while the prompts it took (or its
    own streams) keep its recent steps at or over the bound, it is given back."""
    p = member("prefill", "p", pending_tokens=1500)
    slow = member("decode", "d1", running=1, step_s=0.075)
    quick = member("decode", "d2", running=1, step_s=0.05)
    idle = member("decode", "d3", running=0, step_s=0.0)
    assert POLICY.lendable("prefill", [p], [slow, quick, idle], published) == [quick, idle]
    unbounded = LendPolicy(prefill_tokens=1000.0, decode_running=4.0, decode_step_s=0.0)
    assert unbounded.lendable("prefill", [p], [slow], published) == [slow]


def test_a_prefill_instance_is_lent_whatever_its_step_time() -> None:
    full = member("decode", "d", running=4)
    slow = member("prefill", "p", step_s=0.5)
    assert POLICY.lendable("decode", [full], [slow], published) == [slow]


def test_only_mixed_instances_are_lent() -> None:
    p = member("prefill", "p", pending_tokens=5000)
    plain = member("decode", "d", mixed=False)
    assert POLICY.lendable("prefill", [p], [plain], published) == []


def test_decode_over_its_bound_borrows_a_prefill_instance_with_nothing_queued() -> None:
    full, waiting = member("decode", "d1", running=4), member("decode", "d2", waiting_kv=2)
    empty, queued = member("prefill", "p1"), member("prefill", "p2", pending_tokens=10)
    assert POLICY.lendable("decode", [full, waiting], [empty, queued], published) == [empty]
    room = member("decode", "d3", running=3)
    assert POLICY.lendable("decode", [full, room], [empty], published) == []


def test_a_role_with_no_instance_left_takes_every_mixed_one() -> None:
    busy = member("prefill", "p", pending_tokens=10)
    assert POLICY.lendable("decode", [], [busy], published) == [busy]


def test_the_router_lends_and_gives_back_as_queues_change() -> None:
    r = router([member("prefill", "p", pending_tokens=1500)], [member("decode", "d")])
    lent = r.pick("prefill", 100)
    assert (lent.member.instance_id, lent.role) == ("d", "prefill")
    # d's own role: its share of this gateway's prompt work is not decode work
    assert r.score(lent.member, "decode") == 0.0
    r.members["decode"] = [member("decode", "d", waiting_kv=1)]  # its own queue grew
    assert r.pick("prefill", 100).member.instance_id == "p"


def test_a_decode_instance_takes_one_lent_prompt_at_a_time() -> None:
    """Its streams wait for every prompt it computes: a burst must not pile prompts on it
    (the load report lags, so this gateway's own picks count at once)."""
    busy = member("decode", "d", running=1, pending_tokens=200)  # a lent prompt not done
    assert (
        POLICY.lendable("prefill", [member("prefill", "p", pending_tokens=1500)], [busy], published)
        == []
    )
    r = router([member("prefill", "p", pending_tokens=1500)], [member("decode", "d", running=1)])
    assert r.pick("prefill", 300).member.instance_id == "d"
    assert r.pick("prefill", 300).member.instance_id == "p"  # d still computes the first
    assert r.pick("prefill", 300).member.instance_id == "p"


def test_a_request_prefilled_on_a_mixed_instance_may_decode_there() -> None:
    r = router([member("prefill", "p")], [member("decode", "d", running=4)])
    prefill = r.pick("prefill", 500)
    assert prefill.member.instance_id == "p"
    # p's queue holds only this request's prompt: it does not count against lending
    decode = r.pick("decode", 1, alongside=prefill)
    assert (decode.member.instance_id, decode.role) == ("p", "decode")
    other = r.pick("prefill", 500)
    assert r.pick("decode", 1, alongside=other).member.instance_id == "d"  # p has a queue


def test_load_reports_say_what_each_instance_serves() -> None:
    lent = member("decode", "d", serving_prefill=2.0, serving_decode=3.0)
    assert serving([lent, member("decode", "e", serving_decode=1.0)], "prefill") == 1
    r = router([member("prefill", "p")], [lent])
    assert r.lent() == {"prefill": 1, "decode": 0}


def test_decode_is_lent_only_instances_that_can_read_its_kv() -> None:
    other = member("prefill", "q").model_copy(update={"kv_namespace": "other"})
    r = router([member("prefill", "p"), other], [member("decode", "d", running=4)])
    assert [m.instance_id for m in r.candidates("decode")] == ["d", "p"]


def test_with_a_ttft_target_prefill_is_over_its_bound_when_the_wait_puts_it_at_risk() -> None:
    """The queue ahead is judged in seconds at the instance's recent prompt rate: 3,000
    tokens are a risk at 1,000 tokens/s under a 3 s target (3 s > 0.3 s) and not at
    20,000 tokens/s (0.15 s); before the instance has a rate, the token bound holds."""
    slo = POLICY.for_slo(SloConfig(ttft_s=3.0))
    assert slo.ttft_s == 3.0 and slo.decode_step_s == POLICY.decode_step_s
    idle = member("decode", "d", running=1)
    slow = member("prefill", "p", pending_tokens=3000, tokens_s=1000)
    fast = member("prefill", "p", pending_tokens=3000, tokens_s=20000)
    assert slo.prefill_wait_s(slow, published) == pytest.approx(3.0)
    assert slo.lendable("prefill", [slow], [idle], published) == [idle]
    assert slo.lendable("prefill", [fast], [idle], published) == []
    cold = member("prefill", "p", pending_tokens=1500)  # no rate yet: over 1,000 tokens
    assert slo.prefill_wait_s(cold, published) is None
    assert slo.lendable("prefill", [cold], [idle], published) == [idle]
    # one prefill instance with a short wait is enough to keep every prompt at home
    assert slo.lendable("prefill", [slow, fast], [idle], published) == []


def test_with_a_tpot_target_a_decode_instance_is_lent_while_its_steps_keep_the_paced_share() -> (
    None
):
    slo = POLICY.for_slo(SloConfig(tpot_s=0.05))
    assert slo.decode_step_s == pytest.approx(PACE_MARGIN * 0.05)
    p = member("prefill", "p", pending_tokens=1500)
    quick = member("decode", "d1", running=1, step_s=0.03)
    near = member("decode", "d2", running=1, step_s=0.045)  # under 75 ms, over 40
    assert slo.lendable("prefill", [p], [quick, near], published) == [quick]
    # a bound set explicitly (BATON_GATEWAY_LEND_DECODE_STEP_S) stays
    given = POLICY.for_slo(SloConfig(tpot_s=0.05), step_bound_given=True)
    assert given.decode_step_s == POLICY.decode_step_s
    assert POLICY.for_slo(SloConfig()) == POLICY  # no targets: today's bounds
