"""Metrics on hand-made timelines with known TTFT, TPOT, ITL and goodput."""

from __future__ import annotations

import math

import pytest

from shared.bench.metrics import SLO, Distribution, RequestResult, summarize


def timeline(start: float, stamps: list[float], prompt: int = 10) -> RequestResult:
    return RequestResult(prompt, len(stamps), start, tuple(stamps), stamps[-1])


def test_one_request_definitions() -> None:
    r = timeline(0.0, [0.5, 0.6, 0.8, 1.1])  # 4 tokens
    assert r.ttft == pytest.approx(0.5)
    assert r.e2e == pytest.approx(1.1)
    assert r.tpot == pytest.approx((1.1 - 0.5) / 3)
    assert r.itls == pytest.approx([0.1, 0.2, 0.3])
    single = timeline(1.0, [1.25])
    assert single.ttft == pytest.approx(0.25) and single.tpot is None and single.itls == []


def test_summary_counts_failures_and_throughput() -> None:
    ok1 = timeline(0.0, [0.2, 0.3, 0.4])
    ok2 = timeline(1.0, [1.4, 1.6])
    failed = RequestResult(10, 0, 2.0, (), 2.5, error="HTTP 503: no live decode")
    s = summarize([ok1, ok2, failed], duration_s=4.0)
    assert (s.completed, s.failed) == (2, 1)
    assert s.errors == {"HTTP 503": 1}
    assert s.request_throughput == pytest.approx(0.5)
    assert s.output_throughput == pytest.approx(5 / 4)
    assert s.total_token_throughput == pytest.approx((5 + 20) / 4)
    assert s.ttft.count == 2 and s.ttft.mean == pytest.approx(0.3)
    assert s.tpot.median == pytest.approx((0.1 + 0.2) / 2)
    assert s.itl.count == 3
    assert s.goodput is None


def test_goodput_counts_requests_meeting_every_slo() -> None:
    fast = timeline(0.0, [0.1, 0.15, 0.2])  # ttft 0.1, tpot 0.05
    slow_start = timeline(0.0, [0.9, 0.95])  # ttft 0.9
    slow_tokens = timeline(0.0, [0.1, 0.5, 0.9])  # tpot 0.4
    failed = RequestResult(5, 0, 0.0, (), 0.1, error="boom")
    slo = SLO.parse("ttft=500ms,tpot=0.1")
    assert slo == SLO(ttft=0.5, tpot=0.1)
    s = summarize([fast, slow_start, slow_tokens, failed], duration_s=2.0, slo=slo)
    assert s.goodput == pytest.approx(0.5)  # one request in two seconds


def test_percentiles_and_empty_distributions() -> None:
    d = Distribution.of([float(x) for x in range(1, 101)])
    assert d.median == pytest.approx(50.5) and d.p90 == pytest.approx(90.1)
    assert d.p99 == pytest.approx(99.01)
    empty = Distribution.of([])
    assert empty.count == 0 and math.isnan(empty.mean)


@pytest.mark.parametrize("bad", ["ttft", "speed=1", "ttft=-1", "tpot=abc"])
def test_bad_slo_is_rejected(bad: str) -> None:
    with pytest.raises(ValueError):
        SLO.parse(bad)
