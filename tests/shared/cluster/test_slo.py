"""SLO attainment: verdicts, the last minute's shares, the status line, and the Redis
record ``baton status`` reads (a real redis-server)."""

from __future__ import annotations

import asyncio

import pytest
import redis.asyncio as aioredis

from shared.cluster.keys import Keys
from shared.cluster.slo import SloWindow, Verdict, judge, publish, read
from shared.config import BatonSettings, SloConfig
from shared.procs import RedisProcess

BOTH = SloConfig(ttft_s=1.0, tpot_s=0.1)


def test_a_request_meets_each_target_it_is_within() -> None:
    assert judge(BOTH, 0.5, 0.05) == Verdict(True, True)
    assert judge(BOTH, 1.5, 0.05) == Verdict(False, True)
    assert judge(BOTH, 0.5, 0.2) == Verdict(True, False)
    assert judge(BOTH, 1.0, 0.1).both  # at the target is within it
    assert judge(BOTH, 0.5, None) == Verdict(True, True)  # one output token: no TPOT
    assert judge(BOTH, None, None) == Verdict(False, False)  # failed: misses both
    only_ttft = judge(SloConfig(ttft_s=1.0), 0.5, 9.0)
    assert only_ttft == Verdict(True, None) and only_ttft.both


def test_attainment_counts_the_last_window_only() -> None:
    window = SloWindow(BOTH, window_s=60.0)
    window.record(judge(BOTH, 5.0, 0.05), now=0.0)  # falls out of the window
    for ttft, tpot in ((0.5, 0.05), (0.5, 0.2), (2.0, 0.05), (0.2, None)):
        window.record(judge(BOTH, ttft, tpot), now=50.0)
    a = window.attainment(now=100.0)
    assert a.requests == 4
    assert (a.ttft_met, a.tpot_met, a.both_met) == (0.75, 0.75, 0.5)
    line = a.describe()
    assert line == (
        "SLO TTFT <= 1 s, TPOT <= 0.1 s: last 60 s, 4 requests, 50% met both (TTFT 75%, TPOT 75%)"
    )
    assert window.attainment(now=200.0).describe().endswith("no request in the last 60 s")
    assert SloWindow(SloConfig()).attainment().describe() == "SLO not set"


def test_targets_come_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BATON_SLO_TTFT", "3")
    monkeypatch.setenv("BATON_SLO_TPOT", "0.1")
    assert BatonSettings().slo() == SloConfig(ttft_s=3.0, tpot_s=0.1)
    monkeypatch.setenv("BATON_SLO_TPOT", "0")
    with pytest.raises(ValueError, match="slo_tpot"):
        BatonSettings()
    monkeypatch.delenv("BATON_SLO_TTFT")
    monkeypatch.delenv("BATON_SLO_TPOT")
    assert not BatonSettings().slo().is_set


def test_the_published_attainment_is_read_back_and_expires(redis_server: RedisProcess) -> None:
    async def go() -> None:
        redis = aioredis.from_url(redis_server.url)
        keys = Keys("slo-test")
        try:
            assert await read(redis, keys) is None
            window = SloWindow(BOTH)
            window.record(judge(BOTH, 0.5, 0.05))
            await publish(redis, keys, window.attainment(), ttl_s=0.3)
            back = await read(redis, keys)
            assert back == window.attainment() and back is not None and back.requests == 1
            await asyncio.sleep(0.5)
            assert await read(redis, keys) is None  # its gateway stopped publishing
        finally:
            await redis.aclose()

    asyncio.run(go())
