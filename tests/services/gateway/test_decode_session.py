"""The hang rule (pure): a decode stream is hung once silent past the bound, where the
bound is the policy's or a few of its instance's recent steps, whichever is longer,
and the silence was seen by enough checks in a row (one late check after a stall of
the gateway's own event loop is not the instance's silence)."""

from __future__ import annotations

from typing import Any, cast

from services.gateway.decode_session import HANG_CHECK_S, DecodeSession, FailoverPolicy
from services.gateway.router import Pick, Router
from shared.cluster.membership import Member


class FakeRouter:
    """Only what the rule reads: the instance's published step time."""

    def __init__(self, step_s: float):
        self.step = step_s

    def step_s(self, member: Member) -> float:
        return self.step


def session(step_s: float, silence_s: float = 0.75) -> DecodeSession:
    member = Member(instance_id="d", role="decode", host="h", http_port=1, model="m")
    router = cast(Router, FakeRouter(step_s))
    pick = Pick(member, "decode", 1.0, router)
    none = cast(Any, None)
    return DecodeSession(
        "r", none, pick, none, none, router, none, none, none, FailoverPolicy(silence_s=silence_s)
    )


def test_silence_past_the_bound_over_enough_checks_is_a_hang() -> None:
    s = session(step_s=0.02)
    assert not s._stalled(0.5, 2)
    assert s._stalled(0.8, 3)  # 3 checks of 0.25 s: 0.75 s seen


def test_one_late_check_is_the_gateways_stall_not_the_instances() -> None:
    s = session(step_s=0.02)
    assert not s._stalled(2.0, 1)
    assert not s._stalled(2.0, 2)


def test_long_steps_lengthen_the_bound() -> None:
    s = session(step_s=0.6)  # 3 steps: 1.8 s
    assert not s._stalled(1.5, int(1.5 / HANG_CHECK_S))
    assert s._stalled(1.9, int(1.9 / HANG_CHECK_S) + 1)
