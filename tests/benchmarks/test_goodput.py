"""benchmarks/goodput.py's attainment and table (fabricated request timelines)."""

from __future__ import annotations

from benchmarks.goodput import RateRun, attainment, parse_args, table
from shared.bench.metrics import RequestResult


def result(ttft: float, tpot: float, tokens: int = 11, error: str | None = None) -> RequestResult:
    first = 10.0 + ttft
    chunks = (first, first + tpot * (tokens - 1))
    return RequestResult(8, tokens, 10.0, () if error else chunks, chunks[-1], error=error)


def test_a_request_counts_when_it_meets_ttft_and_each_tpot_target() -> None:
    results = [
        result(1.0, 0.04),  # meets all
        result(1.0, 0.2),  # TPOT within 0.25 only
        result(4.0, 0.01),  # TTFT missed
        result(1.0, 0.01, tokens=1),  # one token: no TPOT to miss
        result(1.0, 0.01, error="boom"),  # failed: misses everything
    ]
    ttft_met, met = attainment(results, 3.0, [0.05, 0.1, 0.25])
    assert ttft_met == 3 / 5
    assert met == {"0.05": 2 / 5, "0.1": 2 / 5, "0.25": 3 / 5}


def test_the_table_averages_repeats_per_rate_and_over_all_runs() -> None:
    args = parse_args(["--rates", "0.5", "1", "--tpot-targets", "0.1", "--repeats", "2"])
    runs = [
        RateRun(rate, rep, 30, 0, 1.0, 0.05, 1.0, {"0.1": share})
        for rate, rep, share in ((0.5, 0, 1.0), (0.5, 1, 0.8), (1.0, 0, 0.5), (1.0, 1, 0.3))
    ]
    text = table({"Baton": runs, "vLLM": "did not start"}, args)
    assert "| Baton | 0.5 | 1,000 ms | 50 ms | 100% | 90% |" in text
    assert "| Baton | 1 | 1,000 ms | 50 ms | 100% | 40% |" in text
    assert "| Baton | mean | | | 100% | 65% |" in text
    assert "| vLLM | - | - | - | - | did not start |" in text
