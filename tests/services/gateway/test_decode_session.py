"""The hang rule (pure): a decode stream is hung once silent past the bound, where the
bound is the policy's or a few of its instance's recent steps, whichever is longer,
and the silence was seen by enough checks in a row (one late check after a stall of
the gateway's own event loop is not the instance's silence)."""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Coroutine
from typing import Any, cast

import pytest

from services.gateway.decode_session import (
    HANG_CHECK_S,
    DecodeSession,
    FailoverPolicy,
    _Interrupted,
)
from services.gateway.metrics import GatewayMetrics
from services.gateway.router import Pick, Router
from shared.cluster.membership import Member
from shared.serving.errors import ServiceError
from shared.serving.protocol import DecodeRequest, SamplingSpec


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


class FakeResumeRouter(FakeRouter):
    """Enough of a router for a resume: benches, block size, this gateway's load."""

    block_size = 16

    def __init__(self) -> None:
        super().__init__(0.02)
        self.benched: list[str] = []
        self.local: dict[tuple[str, str], float] = collections.defaultdict(float)

    def bench(self, member: Member) -> None:
        self.benched.append(member.instance_id)

    def ended(self, pick: Pick) -> None:
        pass


class FakeWatermarks:
    async def read(self, worker_id: str) -> None:
        return None


class FakeBackground:
    def spawn(self, aw: Coroutine[Any, Any, Any], name: str) -> None:
        aw.close()


class FakeStream:
    async def aclose(self) -> None:
        pass


def test_a_stalled_lone_instance_takes_its_request_back() -> None:
    """A decode instance judged stalled (silent, still registered) with no other one to
    resume on: the resume's retries may pick it again, so the request goes on there
    instead of failing. One that hung is never retried."""
    member = Member(instance_id="d", role="decode", host="h", http_port=1, model="m")
    router = FakeResumeRouter()
    tried_sets: list[set[str]] = []

    async def open_decode(body: DecodeRequest, tried: set[str]) -> tuple[Pick, Any]:
        tried_sets.append(set(tried))
        if member.instance_id in tried:
            raise ServiceError(503, "no decode instance", code="no_live_instance")
        return Pick(member, "decode", 1.0, cast(Router, router)), FakeStream()

    body = DecodeRequest(
        request_id="r",
        prompt_token_ids=list(range(1, 40)),
        sampling=SamplingSpec(max_tokens=8, temperature=0.0, top_p=1.0, seed=1),
    )
    s = DecodeSession(
        "r", body, Pick(member, "decode", 1.0, cast(Router, router)), cast(Any, FakeStream()),
        open_decode, cast(Router, router), cast(Any, FakeWatermarks()), GatewayMetrics("m", 2048),
        cast(Any, FakeBackground()), FailoverPolicy(failover_timeout_s=5.0),
    )  # fmt: skip
    s.generated = [7]
    asyncio.run(s._resume(_Interrupted("stalled")))
    assert tried_sets == [{"d"}, set()] and router.benched == ["d"]
    assert s.pick.member.instance_id == "d" and s.resumes == 1

    tried_sets.clear()
    hung = DecodeSession(
        "r", body, Pick(member, "decode", 1.0, cast(Router, router)), cast(Any, FakeStream()),
        open_decode, cast(Router, router), cast(Any, FakeWatermarks()), GatewayMetrics("m", 2048),
        cast(Any, FakeBackground()), FailoverPolicy(failover_timeout_s=0.6),
    )  # fmt: skip
    with pytest.raises(ServiceError, match="no decode instance took"):
        asyncio.run(hung._resume(_Interrupted("hung")))
    assert all(t == {"d"} for t in tried_sets)
