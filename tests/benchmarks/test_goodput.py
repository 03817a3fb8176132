"""benchmarks/goodput.py's attainment and table (fabricated request timelines)."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks.goodput import (
    RateRun,
    attainment,
    goodput,
    parse_args,
    plot,
    share_within,
    table,
    trace_specs,
)
from shared.bench import workload as wl
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


def test_goodput_is_the_highest_rate_whose_share_holds_with_every_lower_one() -> None:
    runs = [
        RateRun(rate, rep, 30, 0, 1.0, 0.05, 1.0, {"0.1": share})
        for rate, rep, share in (
            (1, 0, 1.0), (1, 1, 0.9), (2, 0, 0.95), (2, 1, 0.9), (3, 0, 0.5), (3, 1, 0.6),
            (4, 0, 1.0), (4, 1, 1.0),  # a lucky high rate after a miss does not count
        )
    ]  # fmt: skip
    assert goodput(runs, "0.1") == 2
    assert goodput(runs[4:6], "0.1") == 0.0


def test_attainment_at_other_slos_comes_from_each_requests_latencies() -> None:
    samples = ((1.0, 0.05), (2.5, 0.2), (0.5, 0.5), (None, None))
    run = RateRun(1, 0, 4, 1, 1.0, 0.05, 0.5, {}, samples)
    assert share_within(run, 3.0, 0.25) == 2 / 4
    assert share_within(run, 6.0, 0.5) == 3 / 4  # scale 2
    assert share_within(run, 0.75, 0.0625) == 0.0  # scale 0.25


def test_a_trace_replay_keeps_its_bursts_at_the_mean_rate_asked(tmp_path: Path) -> None:
    rows = [wl.TraceRow(t, 2000, 40) for t in (0.0, 0.1, 0.2, 5.0, 9.0)]  # 4 gaps in 9 s
    args = parse_args(["--trace", "t.csv", "--num-prompts", "5", "--token-scale", "0.5"])
    specs = trace_specs(rows, 2.0, args, seed=0)
    arrivals = [s.arrival for s in specs]
    assert (len(arrivals) - 1) / (arrivals[-1] - arrivals[0]) == pytest.approx(2.0)
    assert arrivals[1] - arrivals[0] == pytest.approx(0.1 * (4 / 9) / 2.0)  # a burst stays one
    assert {len(s.prompt) for s in specs} == {1000} and {s.max_tokens for s in specs} == {20}


def test_the_plot_is_drawn_for_every_server_that_ran(tmp_path: Path) -> None:
    args = parse_args(["--rates", "1", "2", "--tpot-targets", "0.05", "0.1"])
    sample = ((1.0, 0.04), (2.0, 0.08))
    runs = [RateRun(r, 0, 2, 0, 1.0, 0.05, 1.0, {"0.05": 0.5, "0.1": 1.0}, sample) for r in (1, 2)]
    out = tmp_path / "attainment.png"
    plot({"Baton": runs, "vLLM": "did not start"}, args, out)
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
